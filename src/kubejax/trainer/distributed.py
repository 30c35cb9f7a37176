"""Multi-process JAX from the Training Operator's environment.

The operator injects into every JAXJob worker: COORDINATOR_ADDRESS (the hostname of worker 0,
no port), COORDINATOR_PORT, NUM_PROCESSES and PROCESS_ID. Without them the trainer runs as one
process over its local devices.
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


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process sits in the job."""

    coordinator: str | None
    num_processes: int
    process_id: int


def process_env(environ: dict[str, str] | None = None) -> ProcessEnv:
    """Read the operator's contract from the environment."""
    env = os.environ if environ is None else environ
    address = env.get("COORDINATOR_ADDRESS")
    if not address:
        return ProcessEnv(None, 1, 0)
    try:
        n = int(env.get("NUM_PROCESSES", "1"))
        pid = int(env.get("PROCESS_ID", "0"))
        port = int(env.get("COORDINATOR_PORT", str(DEFAULT_PORT)))
    except ValueError as err:
        raise ValueError(
            f"NUM_PROCESSES/PROCESS_ID/COORDINATOR_PORT: not integers ({err})"
        ) from err
    if not 0 <= pid < n:
        raise ValueError(f"PROCESS_ID: {pid} is not in 0..{n - 1} (NUM_PROCESSES={n})")
    host = address if ":" in address else f"{address}:{port}"
    return ProcessEnv(host, n, pid)


def initialize(environ: dict[str, str] | None = None) -> ProcessEnv:
    """Join the job's processes (once); on CPU, collectives go over gloo."""
    global _INITIALIZED
    penv = process_env(environ)
    if penv.coordinator is None or _INITIALIZED:
        return penv
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=penv.coordinator,
        num_processes=penv.num_processes,
        process_id=penv.process_id,
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
    """Batch arrays split on the batch axis, which follows `leading` unsharded axes."""
    return NamedSharding(mesh, PartitionSpec(*([None] * leading), DATA_AXIS))


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
