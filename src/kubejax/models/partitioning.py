"""Logical axis names of every parameter of every family, by the parameter's name.

The models hard-code no sharding: each weight's axes get logical names here (MaxText's: `embed`,
`heads`, `mlp`, `vocab`), and the trainer maps them to mesh axes with one rules table
(`kubejax.trainer.sharding.RULES`). Key/value projections' output axis is `heads` too (their KV
heads split like the query heads; the trainer checks both counts divide the tensor axis).
Anything not named here (norms, biases over the hidden size, position tables' rows, heads over
the labels) has no named axis and is replicated.

Activations are pinned too (`constrain`): left alone, the partitioner (GSPMD) computed FSDP's
products split by the weights' sharded axis, gathering every device's activations instead of
the layer's weights (a 4-device step held three times the activations of data parallelism).
"""

from __future__ import annotations

import math
import re

import jax
from jax.sharding import PartitionSpec

#: (pattern over the parameter's path, logical axes of its dimensions), first match wins.
LOGICAL_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(embed_tokens|word)\.embedding$", ("vocab", "embed")),
    (r"(position|token_type)\.embedding$", (None, "embed")),
    # QLoRA's codes and scales ([in or in / 2 or in / block, out]) shard like the kernel.
    (r"\.(q_proj|k_proj|v_proj|query|key|value)\.(kernel|qkernel|qscale)$", ("embed", "heads")),
    (r"\.(q_proj|k_proj|v_proj|query|key|value)\.bias$", ("heads",)),
    (r"\.(o_proj|attn_out)\.(kernel|qkernel|qscale)$", ("heads", "embed")),
    (r"\.(gate_proj|up_proj|intermediate)\.(kernel|qkernel|qscale)$", ("embed", "mlp")),
    (r"\.(gate_proj|up_proj|intermediate)\.bias$", ("mlp",)),
    (r"\.(down_proj|output)\.(kernel|qkernel|qscale)$", ("mlp", "embed")),
    (r"lm_head\.kernel$", ("embed", "vocab")),
    (r"(score|classifier|pooler)\.kernel$", ("embed", None)),
)


#: Activations' logical axes → mesh axes: the batch over data × fsdp, heads and the MLP width
#: over tensor; the hidden axis whole (FSDP shards weights, not the activations' features).
ACTIVATION_RULES = {
    "batch": ("data", "fsdp"),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}


def constrain(x: jax.Array, *axes: str | None) -> jax.Array:
    """`x` pinned to the sharding its logical `axes` have on the mesh of the trace (the
    trainer's named mesh, `jax.sharding.use_abstract_mesh`); unchanged without one (one
    device, the data-parallel step)."""
    mesh = _named_mesh()
    if mesh is None:
        return x
    spec = [_mesh_axes(mesh, axis, dim) or None for axis, dim in zip(axes, x.shape, strict=True)]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def ways(axis: str, dim: int) -> int:
    """Over how many devices `constrain` splits a dimension of `dim` with the logical `axis` on
    the trace's mesh (1 without one)."""
    mesh = _named_mesh()
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in _mesh_axes(mesh, axis, dim))


def _named_mesh():
    """The trace's abstract mesh where it shards by name (FSDP, tensor), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"fsdp", "tensor"} & set(mesh.axis_names):
        return None
    return mesh


def _mesh_axes(mesh, axis: str | None, dim: int) -> tuple[str, ...]:
    """The mesh axes a dimension of `dim` with the logical `axis` splits over: its rule's axes
    of more than one device, none where they do not divide it."""
    names = tuple(a for a in ACTIVATION_RULES.get(axis, ()) if mesh.shape.get(a, 1) > 1)
    return names if names and dim % math.prod(mesh.shape[a] for a in names) == 0 else ()


def path_name(path) -> str:
    """A parameter's dotted path ("model.layers.0.self_attn.q_proj.kernel")."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value":
            continue  # a Variable's own array, not a module named `value` (BERT's)
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        parts.append(str(name))
    return ".".join(parts)


def stacked(name: str) -> bool:
    """Whether the parameter called `name` belongs to a decoder's stacked layers
    (`model.layers.self_attn.q_proj.kernel`: [layers, in, out]; BERT's `bert.layers.0.…` is
    one layer's)."""
    return re.search(r"(^|\.)layers\.(?!\d)", name) is not None


def is_matrix(name: str, ndim: int) -> bool:
    """Whether the parameter called `name` is a weight matrix or table (of each layer, when
    stacked), as opposed to a vector (a bias, a norm's scale)."""
    return ndim - stacked(name) >= 2


def logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of the parameter called `name` with `ndim` dimensions; a decoder's
    stacked layers (`model.layers.…`, [layers, ...]) lead with an unsharded layer axis."""
    for pattern, axes in LOGICAL_AXES:
        if re.search(pattern, name):
            if len(axes) == ndim:
                return axes
            if stacked(name) and len(axes) + 1 == ndim:
                return (None, *axes)
    return (None,) * ndim


def logical_tree(params):
    """The logical axes of every leaf of a parameter tree, as a tree of tuples."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: logical_axes(path_name(path), x.ndim), params
    )
