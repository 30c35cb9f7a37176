"""Multi-process JAX from either Kubeflow engine's environment.

Training Operator v1 (JAXJob) injects into every worker: COORDINATOR_ADDRESS (the hostname of
worker 0, no port), COORDINATOR_PORT, NUM_PROCESSES and PROCESS_ID. Kubeflow Trainer v2's
`jax-distributed` runtime (TrainJob) injects JAX_COORDINATOR_ADDRESS (host AND port),
JAX_NUM_PROCESSES and JAX_PROCESS_ID (kubejax's `jax-tpu` runtime too). Where neither is set
but GKE's TPU environment is (TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES, and TPU_WORKER_ID,
which GKE gives the pods of a multi-host slice's Indexed Job), the workers find each other as JAX
does on Cloud TPU: `jax.distributed.initialize()` with no arguments, JAX's own cluster detection
reading that environment (Multislice's MEGASCALE_* variables included). A single-host TPU VM sets
TPU_WORKER_HOSTNAMES=localhost: one process. Without any the trainer runs as one process over
its local devices (one TPU host's chips included).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
DEFAULT_PORT = 6666
_INITIALIZED = False


#: (address, process count, process id) variable names of each engine, the current one first.
CONTRACTS = {
    "trainjob": ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
    "jaxjob": ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID"),
}


#: GKE's TPU environment: the slice's workers (JAX reads TPU_PROCESS_ADDRESSES first), this one's.
TPU_HOSTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
TPU_WORKER_ID = "TPU_WORKER_ID"
#: Multislice: the number of slices (each slice's workers repeat the process ids per slice).
TPU_SLICES, TPU_SLICE_ID = "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process sits in the job, and which contract said so (`trainjob`, `jaxjob`,
    `tpu`: GKE's TPU environment, whose coordinator JAX finds itself; `none`)."""

    coordinator: str | None
    num_processes: int
    process_id: int
    contract: str = "none"


def _tpu_env(env) -> ProcessEnv:
    """GKE's TPU environment as a ProcessEnv (`contract` "tpu"; the coordinator is JAX's to
    find: the first worker of the slice), or "none" when it is absent or one host."""
    hosts = next((env[name] for name in TPU_HOSTS if env.get(name)), "")
    workers = [h for h in hosts.split(",") if h]
    try:
        slices = int(env.get(TPU_SLICES) or 1)
        slice_id = int(env.get(TPU_SLICE_ID) or 0)
        worker = int(env.get(TPU_WORKER_ID) or 0)
    except ValueError as err:
        raise ValueError(
            f"{TPU_WORKER_ID}/{TPU_SLICES}/{TPU_SLICE_ID}: not integers ({err})"
        ) from err
    n = len(workers) * slices
    if n < 2:
        return ProcessEnv(None, 1, 0)
    if not 0 <= worker < len(workers):
        raise ValueError(
            f"{TPU_WORKER_ID}: {worker} is not in 0..{len(workers) - 1} (the slice's "
            f"{len(workers)} workers in {next(name for name in TPU_HOSTS if env.get(name))})"
        )
    return ProcessEnv(None, n, slice_id * len(workers) + worker, "tpu")


def process_env(environ: dict[str, str] | None = None) -> ProcessEnv:
    """Read the engine's contract (TrainJob's or JAXJob's), else GKE's TPU environment, from
    the environment."""
    env = os.environ if environ is None else environ
    contract = next((c for c, names in CONTRACTS.items() if env.get(names[0])), None)
    if contract is None:
        return _tpu_env(env)
    addr_var, n_var, id_var = CONTRACTS[contract]
    address = env[addr_var]
    try:
        n = int(env.get(n_var, "1"))
        pid = int(env.get(id_var, "0"))
        port = int(env.get("COORDINATOR_PORT", str(DEFAULT_PORT)))
    except ValueError as err:
        raise ValueError(f"{n_var}/{id_var}/COORDINATOR_PORT: not integers ({err})") from err
    if not 0 <= pid < n:
        raise ValueError(f"{id_var}: {pid} is not in 0..{n - 1} ({n_var}={n})")
    # JAXJob gives the host alone and the port apart; TrainJob gives host:port.
    host = address if ":" in address else f"{address}:{port}"
    return ProcessEnv(host, n, pid, contract)


def initialize(environ: dict[str, str] | None = None, timeout_s: int = 300) -> ProcessEnv:
    """Join the job's processes (once), waiting up to `timeout_s` for all of them (pods may
    start minutes apart on a busy cluster); on CPU, collectives go over gloo. On GKE's TPU
    environment alone, JAX's own Cloud TPU detection does it (no arguments but the wait)."""
    global _INITIALIZED
    penv = process_env(environ)
    if penv.num_processes == 1 or _INITIALIZED:
        return penv
    if penv.contract == "tpu":
        jax.distributed.initialize(initialization_timeout=timeout_s)
        _INITIALIZED = True
        return penv
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=penv.coordinator,
        num_processes=penv.num_processes,
        process_id=penv.process_id,
        initialization_timeout=timeout_s,
    )
    _INITIALIZED = True
    return penv


def data_mesh() -> Mesh:
    """One mesh axis, `data`, over every device of every process."""
    return Mesh(np.array(jax.devices()), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Parameters and optimizer state: a full copy on every device."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, leading: int = 0) -> NamedSharding:
    """Batch arrays split on the batch axis, which follows `leading` unsharded axes: over
    `data` (and `fsdp` on a named mesh, `kubejax.trainer.sharding`)."""
    if mesh.axis_names == (DATA_AXIS,):
        return NamedSharding(mesh, PartitionSpec(*([None] * leading), DATA_AXIS))
    from kubejax.trainer.sharding import batch_spec

    return NamedSharding(mesh, batch_spec(mesh, leading))


def global_batch(local: dict[str, np.ndarray], mesh: Mesh, leading: int = 0) -> dict:
    """Global arrays from this process's share of a batch."""
    sharding = batch_sharding(mesh, leading)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def replicate(tree, mesh: Mesh):
    """Host values identical on every process → replicated global arrays."""
    sharding = replicated(mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree
    )
