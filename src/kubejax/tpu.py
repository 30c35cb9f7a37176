"""Cloud TPUs as JAX and GKE name them: each chip's memory, and the slices GKE offers.

An `accelerator` setting is `cpu`, `nvidia` (GPUs, as the `gpus_per_worker`/`devices_per_worker`
settings ask) or a GKE TPU type (`tpu-v5-lite-podslice`, ...); with a TPU type, `tpu_topology`
(`2x4`, `4x4`, ...) names the slice. From one row of `SLICES` come the worker pods' node
selectors (`cloud.google.com/gke-tpu-accelerator`, `cloud.google.com/gke-tpu-topology`), their
`google.com/tpu` limit (the chips of one host: GKE runs one Pod per TPU VM) and the number of
workers (the slice's hosts); the memory plan reads the chip's memory through `chip_memory`.

HBM per chip from Google's Cloud TPU system-architecture pages (v4 32 GiB, v5e 16 GiB, v5p
95 GiB, v6e 32 GiB). What a program may use is a little less: on a v5e chip JAX's
`memory_stats()["bytes_limit"]` read 15.75 GiB of the 16 (../shared/TPU.md), the same share is
assumed of the others. `jax.devices()[0].device_kind` names the chip ("TPU v5 lite"); GKE's node
label `cloud.google.com/gke-tpu-accelerator` names the slice's type ("tpu-v5-lite-podslice").
Nothing here imports JAX: the launchers (every KFP task) read this table.
"""

from __future__ import annotations

import dataclasses
import math

from kubejax.errors import KubejaxError
from kubejax.version import IMAGE

GIB = 2**30
#: The share of a chip's HBM a program may use (15.75 of 16 GiB on the v5e measured).
USABLE = 15.75 / 16

#: GKE's node labels of a TPU slice's nodes, and the container resource of its chips.
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
RESOURCE = "google.com/tpu"
#: The accelerator choices that are not TPUs: CPU pods, and GPU pods (today's path).
CPU, NVIDIA = "cpu", "nvidia"
#: The worker image with `jax[tpu]` (trainer_image/Dockerfile, JAX_VARIANT=tpu): JAX's CUDA and
#: TPU backends conflict in one image, so TPU workers run a variant of their own.
TPU_IMAGE = f"{IMAGE}-tpu"


class TPUError(KubejaxError, ValueError):
    """A TPU setting GKE does not offer, or one that contradicts the slice; names the setting."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: its name, HBM per chip, JAX's device kinds and GKE's type names."""

    name: str
    hbm_gib: int
    device_kinds: tuple[str, ...]
    gke_types: tuple[str, ...]
    #: bfloat16 peak of one chip, TFLOP/s (the spec sheets'), for MFU figures.
    peak_tflops: float

    @property
    def usable_bytes(self) -> int:
        """What one chip's programs may hold."""
        return int(self.hbm_gib * GIB * USABLE)


GENERATIONS = (
    Generation("v4", 32, ("TPU v4",), ("tpu-v4-podslice",), 275.0),
    Generation(
        "v5e", 16, ("TPU v5 lite", "TPU v5e"), ("tpu-v5-lite-podslice", "tpu-v5-lite-device"), 197.0
    ),
    Generation("v5p", 95, ("TPU v5", "TPU v5p"), ("tpu-v5p-slice",), 459.0),
    Generation("v6e", 32, ("TPU v6 lite", "TPU v6e"), ("tpu-v6e-slice",), 918.0),
)


def generation(name: str) -> Generation | None:
    """The generation of a GKE TPU type, a JAX device kind or a short name (v5e), if known."""
    key = name.strip().lower()
    for g in GENERATIONS:
        names = (g.name, *g.gke_types, *(k.lower() for k in g.device_kinds))
        if key in names:
            return g
    return None


def chip_memory(name: str) -> int | None:
    """Bytes one chip's programs may use, by GKE TPU type, device kind or short name."""
    g = generation(name)
    return None if g is None else g.usable_bytes


@dataclasses.dataclass(frozen=True)
class SliceShape:
    """One slice GKE offers: its type and topology, its chips, its hosts (GKE nodes, one worker
    Pod each) and the GKE machine type of those hosts."""

    accelerator: str
    topology: str
    chips: int
    hosts: int
    machine_type: str

    @property
    def chips_per_host(self) -> int:
        """The `google.com/tpu` limit of each worker Pod."""
        return self.chips // self.hosts

    @property
    def node_selector(self) -> dict[str, str]:
        """The labels GKE puts on this slice's nodes."""
        return {ACCELERATOR_LABEL: self.accelerator, TOPOLOGY_LABEL: self.topology}

    def describe(self) -> str:
        """`tpu-v5-lite-podslice 4x4 (16 chips: 4 hosts × 4)`, for messages."""
        return (
            f"{self.accelerator} {self.topology} ({self.chips} chips: {self.hosts} "
            f"host{'s' if self.hosts > 1 else ''} × {self.chips_per_host})"
        )


# The slices, one row per (type, topology, host shape): topology, chips, hosts (GKE nodes, VMs),
# GKE machine type. Sources: GKE's "Plan TPUs in GKE" reference tables
# (cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus) and the Cloud TPU pages
# (cloud.google.com/tpu/docs/v5e, /v5p, /v6e, /v4). Read and cross-checked:
# - v6e: the v6e page's table (topology, chips, hosts, VMs, GKE machine type): 1x1 and 2x2 on one
#   VM, 2x4 on one 8-chip VM (ct6e-standard-8t) or two 4-chip VMs, 4x4 and up on 4-chip VMs.
# - v5e: the v5e page gives chips per topology (1x1 … 16x16) in 8-chip hosts; GKE builds multi-host
#   v5e slices of 4-chip nodes (ct5lp-hightpu-4t): GKE's node-pool auto-creation page says a
#   16x16 ct5lp-hightpu-4t pool "always has either 64 nodes or zero nodes".
# - v5p: the v5p page's table (topology, chips, hosts; ct5p-hightpu-4t, 4 chips a host).
# - v4: GKE's example of a 2x2x2 slice on two ct4p-hightpu-4t machines; 4 chips a host.
# Not confirmed from Google's own tables (the stored copy of the plan-tpus page ends before them):
# v5e 2x4 on two 4-chip nodes (a GKE autoscaler test and xpk's table, AI-Hypercomputer/xpk
# src/xpk/core/system_characteristics.py, say 2 nodes), v5p 2x2x4 and the v4 topologies beyond
# 2x2x2 (xpk's table). Larger 3D shapes GKE accepts (v5p up to 16x16x24, twisted tori) are left
# out until needed: a topology missing here is refused, never guessed.
_V5E, _V6E = "tpu-v5-lite-podslice", "tpu-v6e-slice"
_V5P, _V4 = "tpu-v5p-slice", "tpu-v4-podslice"
_2D = (("1x1", 1, 1, "1t"), ("2x2", 4, 1, "4t"), ("2x4", 8, 1, "8t"), ("2x4", 8, 2, "4t"),
       ("4x4", 16, 4, "4t"), ("4x8", 32, 8, "4t"), ("8x8", 64, 16, "4t"),
       ("8x16", 128, 32, "4t"), ("16x16", 256, 64, "4t"))  # fmt: skip
_V5P_SHAPES = (("2x2x1", 4, 1), ("2x2x2", 8, 2), ("2x2x4", 16, 4), ("2x4x4", 32, 8),
               ("4x4x4", 64, 16), ("4x4x8", 128, 32), ("4x8x8", 256, 64), ("8x8x8", 512, 128),
               ("8x8x16", 1024, 256), ("8x16x16", 2048, 512), ("16x16x16", 4096, 1024),
               ("16x16x24", 6144, 1536))  # fmt: skip
_V4_SHAPES = (("2x2x1", 4, 1), ("2x2x2", 8, 2), ("2x2x4", 16, 4), ("2x4x4", 32, 8),
              ("4x4x4", 64, 16), ("4x4x8", 128, 32), ("4x8x8", 256, 64), ("8x8x8", 512, 128),
              ("8x8x12", 768, 192), ("8x8x16", 1024, 256), ("8x16x16", 2048, 512))  # fmt: skip
SLICES: tuple[SliceShape, ...] = (
    *(SliceShape(_V5E, t, c, h, f"ct5lp-hightpu-{m}") for t, c, h, m in _2D),
    *(SliceShape(_V6E, t, c, h, f"ct6e-standard-{m}") for t, c, h, m in _2D),
    *(SliceShape(_V5P, t, c, h, "ct5p-hightpu-4t") for t, c, h in _V5P_SHAPES),
    *(SliceShape(_V4, t, c, h, "ct4p-hightpu-4t") for t, c, h in _V4_SHAPES),
)
#: The GKE TPU types an `accelerator` setting may name, in the table's order.
TPU_TYPES = tuple(dict.fromkeys(s.accelerator for s in SLICES))
ACCELERATORS = (CPU, NVIDIA, *TPU_TYPES)


def check_accelerator(accelerator: str, setting: str = "accelerator") -> str:
    """The accelerator setting, checked (empty: `nvidia`, today's GPU-or-CPU path)."""
    name = (accelerator or NVIDIA).strip()
    if name not in ACCELERATORS:
        raise TPUError(f"{setting}: {accelerator!r} is not one of {', '.join(ACCELERATORS)}")
    return name


def is_tpu(accelerator: str) -> bool:
    """Whether the accelerator setting names a TPU type (checked)."""
    return check_accelerator(accelerator) in TPU_TYPES


def topologies(accelerator: str) -> list[str]:
    """The topologies GKE offers for a TPU type, smallest first."""
    return list(dict.fromkeys(s.topology for s in SLICES if s.accelerator == accelerator))


def tpu_slice(
    accelerator: str,
    topology: str,
    chips_per_host: int = 0,
    *,
    setting: str = "tpu_topology",
    host_setting: str = "devices_per_worker",
) -> SliceShape:
    """The slice of a TPU type and topology; `chips_per_host` (0: the fewest hosts GKE offers)
    picks among its host shapes (a v5e or v6e 2x4 on one 8-chip host or two 4-chip hosts).
    TPUError names `setting` (the topology's) or `host_setting` (the chips per host)."""
    accelerator = check_accelerator(accelerator)
    if accelerator not in TPU_TYPES:
        raise TPUError(
            f"{setting}: {topology!r} needs a TPU accelerator (one of {', '.join(TPU_TYPES)}), "
            f"not accelerator {accelerator}"
        )
    offered = topologies(accelerator)
    if not topology:
        raise TPUError(
            f"{setting}: required with accelerator {accelerator}; one of {', '.join(offered)}"
        )
    shapes = [s for s in SLICES if s.accelerator == accelerator and s.topology == topology]
    if not shapes:
        raise TPUError(
            f"{setting}: {topology!r} is not a {accelerator} slice; one of {', '.join(offered)}"
        )
    if not chips_per_host:
        return shapes[0]
    for shape in shapes:
        if shape.chips_per_host == chips_per_host:
            return shape
    choices = " or ".join(str(s.chips_per_host) for s in shapes)
    raise TPUError(
        f"{host_setting}: a {accelerator} {topology} slice has {choices} chips on each host "
        f"(google.com/tpu per worker), not {chips_per_host}; set {choices}, or 0"
    )


def workers(shape: SliceShape, replicas: int, setting: str = "replicas") -> int:
    """The worker count of a job on `shape`: its hosts; `replicas` 0 means that, any other
    number must be it (one JAX process per host)."""
    if replicas in (0, shape.hosts):
        return shape.hosts
    raise TPUError(
        f"{setting}: {replicas} workers contradict the {shape.describe()} slice, one worker a "
        f"host; set {shape.hosts} or 0 (the slice's hosts)"
    )


def slice_of(node_selector: dict | None, chips_per_host: int = 0) -> SliceShape | None:
    """The slice a pod's node selector asks for (None without a TPU type label)."""
    selector = node_selector or {}
    accelerator = selector.get(ACCELERATOR_LABEL)
    if not accelerator:
        return None
    return tpu_slice(
        accelerator,
        selector.get(TOPOLOGY_LABEL, ""),
        chips_per_host,
        setting=f"node_selector[{TOPOLOGY_LABEL}]",
    )


def chip_count(topology: str) -> int:
    """The chips of a topology: the product of its sizes ("4x4" → 16)."""
    return math.prod(int(n) for n in topology.split("x"))


def image_for(accelerator: str, image: str = "") -> str:
    """The worker image: `image` when given, else kubejax's of this version for the
    accelerator (TPU_IMAGE on a TPU type, the CPU/CUDA one otherwise)."""
    if image:
        return image
    return TPU_IMAGE if is_tpu(accelerator) else IMAGE


def known_types() -> str:
    """The names `chip_memory` knows, for error messages."""
    return ", ".join(name for g in GENERATIONS for name in (g.name, *g.gke_types))
