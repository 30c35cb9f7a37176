"""The named mesh (`data`, `fsdp`, `tensor`, MaxText's convention) and where parameters,
optimizer state and batches live on it.

`mesh` setting: `data=2,fsdp=2,tensor=1` style, one axis may be -1 (every device left); empty
means data-parallel over every device, the trainer's default. Parameters get their shardings
from their logical axes (`kubejax.models.partitioning`) through `RULES`: FSDP shards the
hidden (`embed`) axis of every weight over `fsdp`; tensor parallelism splits heads, the MLP
width and the vocabulary over `tensor` (Megatron's column/row splits: q/k/v/gate/up by output,
o/down by input). Batches split over `data` × `fsdp`. An axis a dimension does not divide is
left unsharded for that dimension (a head over 5 labels).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kubejax.models.partitioning import logical_tree

AXES = ("data", "fsdp", "tensor")
#: Logical axis → mesh axis.
RULES = {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
#: Mesh axes the batch is split over.
BATCH_AXES = ("data", "fsdp")


class MeshError(ValueError):
    """A mesh setting that does not fit the devices or the model; names the numbers."""


def parse_mesh(text: str, devices: int) -> dict[str, int]:
    """Axis sizes from the `mesh` setting, -1 resolved; refused when they do not multiply to
    the device count."""
    sizes = dict.fromkeys(AXES, 1)
    if not text.strip():
        sizes["data"] = devices
        return sizes
    given = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(-?\d+)\s*", part)
        if not m or m[1] not in AXES:
            raise MeshError(
                f"mesh: {part.strip()!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)}"
            )
        size = int(m[2])
        if size == 0 or size < -1:
            raise MeshError(f"mesh: {m[1]}={size}; a size is positive or -1 (the rest)")
        given[m[1]] = size
    sizes.update(given)
    rest = [a for a, s in sizes.items() if s == -1]
    if len(rest) > 1:
        raise MeshError(f"mesh: only one axis may be -1, got {', '.join(rest)}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if rest:
        if devices % known:
            raise MeshError(f"mesh: {text} — {known} does not divide the {devices} devices")
        sizes[rest[0]] = devices // known
    if math.prod(sizes.values()) != devices:
        raise MeshError(
            f"mesh: {text} makes {math.prod(sizes.values())} devices, but the job has {devices} "
            "(processes × local devices); make the sizes multiply to it or use -1 for one axis"
        )
    return sizes


def make_mesh(sizes: dict[str, int]) -> Mesh:
    """The mesh over every process's devices, axes in `AXES` order (GSPMD-style, Auto axes)."""
    shape = tuple(sizes[a] for a in AXES)
    devices = np.array(jax.devices()).reshape(shape)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def is_sharded(mesh: Mesh) -> bool:
    """Whether parameters are sharded on this mesh (an fsdp or tensor axis over 1)."""
    return any(mesh.shape.get(a, 1) > 1 for a in ("fsdp", "tensor"))


def check_model(model_cfg, sizes: dict[str, int]) -> None:
    """The tensor axis must divide the attention heads, the KV heads and the MLP width."""
    tensor = sizes["tensor"]
    if tensor == 1:
        return
    heads = model_cfg.num_attention_heads
    counts = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(model_cfg, "num_key_value_heads", heads),
        "intermediate_size": model_cfg.intermediate_size,
    }
    for name, count in counts.items():
        if count % tensor:
            raise MeshError(f"mesh: tensor={tensor} does not divide the model's {name} ({count})")


def spec_of(axes: tuple, shape: tuple[int, ...], sizes) -> PartitionSpec:
    """The PartitionSpec of a parameter with these logical axes and shape on a mesh of these
    axis sizes (`mesh.shape`, or a plan's mapping)."""
    out = []
    for axis, dim in zip(axes, shape, strict=True):
        mesh_axis = RULES.get(axis) if axis else None
        size = sizes.get(mesh_axis, 1) if mesh_axis else 1
        out.append(mesh_axis if size > 1 and dim % size == 0 else None)
    return PartitionSpec(*out)


def param_shardings(params, mesh: Mesh):
    """A NamedSharding for every parameter (a tree like `params`; arrays or shape structs)."""
    axes = logical_tree(params)
    return jax.tree.map(
        lambda a, x: NamedSharding(mesh, spec_of(a, x.shape, mesh.shape)),
        axes,
        params,
        is_leaf=lambda a: isinstance(a, tuple),
    )


def placement(mesh: Mesh):
    """`name, shape → NamedSharding` for loading a parameter straight into its shards; None
    where nothing is sharded (the parameters are replicated once loaded)."""
    from kubejax.models.partitioning import logical_axes

    if not is_sharded(mesh):
        return None
    return lambda name, shape: NamedSharding(
        mesh, spec_of(logical_axes(name, len(shape)), shape, mesh.shape)
    )


def state_shardings(tx, opt_state, params_shardings, mesh: Mesh):
    """The optimizer state's shardings: each moment like its parameter, the rest replicated."""
    import optax

    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        opt_state,
        params_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def state_layout(params, opt_state, tx, mesh: Mesh):
    """Where the trainer keeps its parameters and optimizer state (`opt_state`: its shapes will
    do): (the parameters' shardings, the state's, and the pair a sharded step is made with);
    replicated, one sharding each and None for the pair."""
    if not is_sharded(mesh):
        replicated = NamedSharding(mesh, PartitionSpec())
        return replicated, replicated, None
    params_sh = param_shardings(params, mesh)
    opt_sh = state_shardings(tx, opt_state, params_sh, mesh)
    return params_sh, opt_sh, (params_sh, opt_sh)


def batch_spec(mesh: Mesh, leading: int = 0) -> PartitionSpec:
    """Batch arrays: split on the batch axis (after `leading` axes) over data × fsdp."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    return PartitionSpec(*([None] * leading), axes if len(axes) > 1 else axes[0])


def shard_fraction(array: jax.Array) -> float:
    """The share of an array's elements its first device holds (1.0: replicated)."""
    shard = array.addressable_shards[0].data
    return shard.size / array.size
