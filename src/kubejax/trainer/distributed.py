"""Multi-process JAX from either Kubeflow engine's environment.

Training Operator v1 (JAXJob) injects into every worker: COORDINATOR_ADDRESS (the hostname of
worker 0, no port), COORDINATOR_PORT, NUM_PROCESSES and PROCESS_ID. Kubeflow Trainer v2's
`jax-distributed` runtime (TrainJob) injects JAX_COORDINATOR_ADDRESS (host AND port),
JAX_NUM_PROCESSES and JAX_PROCESS_ID. Without either the trainer runs as one process over its
local devices.
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


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process sits in the job, and which engine's contract said so."""

    coordinator: str | None
    num_processes: int
    process_id: int
    contract: str = "none"


def process_env(environ: dict[str, str] | None = None) -> ProcessEnv:
    """Read the engine's contract (TrainJob's or JAXJob's) from the environment."""
    env = os.environ if environ is None else environ
    contract = next((c for c, names in CONTRACTS.items() if env.get(names[0])), None)
    if contract is None:
        return ProcessEnv(None, 1, 0)
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
    start minutes apart on a busy cluster); on CPU, collectives go over gloo."""
    global _INITIALIZED
    penv = process_env(environ)
    if penv.coordinator is None or _INITIALIZED:
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
