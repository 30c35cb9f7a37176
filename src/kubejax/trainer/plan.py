"""The memory plan: the bytes each device holds for a training run, before anything starts.

From the model's config (parameter shapes, without building the weights), the task, the mesh,
the micro-batch, the sequence length, the dtypes, `remat` and the optimizer: the parameters,
their gradients and the optimizer state on each device (sharded as `kubejax.trainer.sharding`
shards them), the activations the backward pass keeps, and what the step gathers or copies on
top. The launcher refuses a job whose plan exceeds the device's memory, naming each figure and
the smallest mesh / micro-batch that fits; `kubejax plan` prints it.

The activation counts are those of the layers' saved tensors per token (kubejax's decoder and
BERT); checked against XLA's compiled memory analysis within 25 % (tests/trainer/test_plan.py).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from kubejax import tpu
from kubejax.errors import InfeasibleError
from kubejax.models import attention, weights
from kubejax.models.partitioning import is_matrix, logical_tree, path_name
from kubejax.trainer import precision, sharding
from kubejax.trainer.config import AUTO, ConfigError, TrainConfig, parse_bytes

#: Device memory by GPU product (the `nvidia.com/gpu.product` node label), where the name does
#: not carry it ("NVIDIA-H100-80GB-HBM3" does: read from the name).
GPU_MEMORY = {"L4": "24GB", "A10G": "24GB", "A10": "24GB", "T4": "16GB", "L40S": "48GB",
              "L40": "48GB", "H200": "141GB", "B200": "180GB"}  # fmt: skip


def gpu_memory(product: str) -> int | None:
    """A GPU's memory from its product name ("NVIDIA-A100-SXM4-40GB", "NVIDIA-L4"), if known."""
    m = re.search(r"(\d+)GB", product.upper())
    if m:
        return int(m[1]) * 10**9
    for name, size in GPU_MEMORY.items():
        if re.search(rf"(^|[-_ ]){name}($|[-_ ])", product.upper()):
            return parse_bytes(size)
    return None


#: The share of a GPU's memory JAX takes for its allocator by default (it preallocates 75 %;
#: `XLA_PYTHON_CLIENT_MEM_FRACTION` in the workers' environment changes it).
JAX_MEMORY_FRACTION = 0.75


#: GKE's node label naming a TPU slice's type (`kubejax.tpu`).
TPU_SELECTOR = "cloud.google.com/gke-tpu-accelerator"


def device_memory_of(cfg: TrainConfig, node_selector: dict | None = None) -> int | None:
    """The memory the plan checks against: the `device_memory` setting (a size such as 80GiB,
    or a TPU type: tpu-v5-lite-podslice, v5e, ...), else the accelerator of the pods' node
    selector (a GPU's `nvidia.com/gpu.product` times JAX_MEMORY_FRACTION; a TPU slice's
    `cloud.google.com/gke-tpu-accelerator`: one chip's HBM), else what JAX reports of its first
    device (a GPU's or TPU's `bytes_limit`, the chip's table figure where it reports none;
    nothing on CPU)."""
    if cfg.device_memory:
        return _memory_setting(cfg.device_memory)
    selector = node_selector or {}
    if selector.get(TPU_SELECTOR):
        return _tpu_memory(selector[TPU_SELECTOR], TPU_SELECTOR)
    product = selector.get("nvidia.com/gpu.product")
    if product:
        memory = gpu_memory(product)
        return None if memory is None else int(memory * JAX_MEMORY_FRACTION)
    if node_selector is None and jax.devices()[0].platform in ("gpu", "tpu"):
        device = jax.devices()[0]
        limit = (device.memory_stats() or {}).get("bytes_limit")
        return limit or tpu.chip_memory(device.device_kind)
    return None


def _memory_setting(text: str) -> int:
    """`device_memory`: a size, or a TPU type (one chip's memory)."""
    return tpu.chip_memory(text) or parse_bytes(text)


def _tpu_memory(name: str, setting: str) -> int:
    memory = tpu.chip_memory(name)
    if memory is None:
        raise ConfigError(f"{setting}: {name!r} is not a TPU type ({tpu.known_types()})")
    return memory


def platform_of(
    cfg: TrainConfig, node_selector: dict | None = None, devices_per_worker: int = 0
) -> str:
    """Where the run's devices are: "tpu", "gpu" or "cpu", from the node selector, the pods'
    accelerator count or the `device_memory` setting (a TPU type); with neither a selector nor
    a count, this process's first device's."""
    selector = node_selector or {}
    if selector.get(TPU_SELECTOR) or (
        cfg.device_memory and tpu.chip_memory(cfg.device_memory) is not None
    ):
        return "tpu"
    if selector.get("nvidia.com/gpu.product") or devices_per_worker > 0:
        return "gpu"
    if node_selector is not None:
        return "cpu"
    return jax.devices()[0].platform


def human(n: float) -> str:
    """Bytes in GiB/MiB, as people read them."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device for one training run."""

    mesh: dict[str, int]
    micro_batch: int  # rows per device per micro-batch
    length: int
    params: int
    grads: int
    optimizer: int
    activations: int
    gathered: int  # FSDP's gathered layer weights and gradients; bfloat16 weights' float32 copy
    device_memory: int | None = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered

    @property
    def fits(self) -> bool:
        return self.device_memory is None or self.total <= self.device_memory

    def figures(self) -> str:
        """The figures in one line."""
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        parts = ", ".join(
            f"{name} {human(getattr(self, name))}"
            for name in ("params", "grads", "optimizer", "activations", "gathered")
        )
        return (
            f"{parts}, on mesh {mesh} with {self.micro_batch} rows of {self.length} tokens a "
            "device a micro-batch"
        )

    def describe(self) -> str:
        """One line per figure."""
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        rows = [
            f"mesh {mesh}; {self.micro_batch} rows of {self.length} tokens per device per "
            "micro-batch",
            f"  parameters   {human(self.params)}",
            f"  gradients    {human(self.grads)}",
            f"  optimizer    {human(self.optimizer)}",
            f"  activations  {human(self.activations)}",
            f"  gathered     {human(self.gathered)}",
            f"  total        {human(self.total)} per device"
            + (f" of {human(self.device_memory)}" if self.device_memory else ""),
        ]
        return "\n".join(rows)


def abstract_params(model_cfg, task: str, num_labels: int) -> dict:
    """The model's parameter shapes (`jax.ShapeDtypeStruct`s, float32), nothing allocated."""
    from flax import nnx

    if weights.is_decoder(model_cfg):
        from kubejax.models import decoder_weights

        build = lambda: decoder_weights.build(model_cfg, task, num_labels)  # noqa: E731
    else:
        from kubejax.models.bert import BertClassifier

        build = lambda: BertClassifier(model_cfg, num_labels, rngs=nnx.Rngs(0))  # noqa: E731
    return nnx.state(nnx.eval_shape(build), nnx.Param)


def plan_memory(
    cfg: TrainConfig,
    model_cfg,
    num_labels: int,
    devices: int,
    device_memory: int | None = None,
    params=None,
    platform: str = "cpu",
) -> MemoryPlan:
    """The plan of `cfg` (mesh, batch, dtypes, remat, attention, optimizer) on `devices`
    devices of `platform` (`params`: the model's `abstract_params`, when already at hand)."""
    cfg = precision.settle(cfg, platform)[0]  # dtypes `auto` as the platform takes them
    cfg = as_asked(cfg)  # micro-batches and remat `auto` as the run first asks (`fit_memory`)
    sizes = sharding.parse_mesh(cfg.mesh, devices)
    if params is None:
        params = abstract_params(model_cfg, cfg.task or "classification", num_labels)
    shards = _shard_counts(params, sizes)
    pbytes = 2 if cfg.param_dtype == "bfloat16" else 4
    # (elements on a device, whether a matrix: `param_dtype`, else float32) of each parameter.
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    elems = [
        (x.size // n, is_matrix(path_name(path), x.ndim))
        for (path, x), n in zip(flat, shards, strict=True)
    ]
    held = sum(e * (pbytes if matrix else 4) for e, matrix in elems)
    if cfg.peft == "qlora":  # the projections' codes and block scales in place of the kernels
        held -= _quantized_saving(cfg, model_cfg, params, shards, pbytes)
    # What trains: everything, or LoRA's adapters (replicated, float32, added to what is held)
    # and a classifier's head (held already).
    trains = elems
    if cfg.peft != "none":
        adapters, head = _lora_elements(cfg, model_cfg, params)
        held += sum(e * 4 for e, _ in adapters)
        trains = adapters + head
    trained = sum(e * (pbytes if mx and cfg.peft == "none" else 4) for e, mx in trains)
    batch_devices = sizes["data"] * sizes["fsdp"]
    micro = cfg.global_batch_size // cfg.grad_accum_steps // batch_devices
    # Unrolled decoder layers (`scan_layers` false) hold two copies fewer of what trains than
    # the scan, whose loop carries the stacked layers' gradients: fitted on the v5e, the
    # Qwen2.5-0.5B shape's full FT unrolled held 1.81 and 1.97 GiB less than scanned at 256 × 32
    # and 2,048 × 4, twice its 0.92 GiB of bfloat16 weights (bench/NOTES.md T13). LoRA's
    # unrolled programs held 0.3-0.7 GiB less, its adapters next to nothing: the plan stays
    # above them. Unset (auto), the scan's figure: the most the run can hold.
    unrolled = cfg.scan_layers is False and weights.is_decoder(model_cfg)
    return MemoryPlan(
        mesh=sizes,
        micro_batch=micro,
        length=cfg.max_length,
        params=held,
        # The accumulation's running sum beside each micro-batch's gradients.
        grads=trained * (2 if cfg.grad_accum_steps > 1 else 1),
        optimizer=sum(_moment_bytes(cfg, e, mx) for e, mx in trains),
        activations=_activations(
            cfg, model_cfg, sizes, micro, attention_of(cfg, model_cfg, platform), platform
        )
        - (2 * trained if unrolled else 0),
        gathered=_gathered(params, shards, sizes, pbytes, cfg),
        device_memory=device_memory,
    )


def _quantized_saving(cfg: TrainConfig, model_cfg, params, shards: list[int], pbytes: int):
    """Bytes QLoRA saves: each projection kernel's `pbytes` a value replaced by its codes (1
    byte for int8, half for nf4) and its float32 scales, one per block of inputs."""
    from kubejax.models.quantize import block_size

    code = 1.0 if cfg.weight_qtype == "int8" else 0.5
    saved = 0
    for (name, x), n in zip(_kernels(model_cfg, params), shards, strict=True):
        if name:
            *lead, n_in, n_out = x.shape
            scales = math.prod(lead) * n_in // block_size(n_in) * n_out * 4
            saved += int((x.size * (pbytes - code) - scales) // n)
    return saved


def _kernels(model_cfg, params) -> list[tuple[str, object]]:
    """(the projection's name, or "" for what is not an adaptable projection's kernel, leaf)
    for every parameter: QLoRA quantizes the named ones, LoRA adapts those it targets."""
    from kubejax.models.lora import HEADS, target_groups
    from kubejax.models.partitioning import path_name

    projections = target_groups(model_cfg.model_type)["all"]
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts = path_name(path).split(".")
        adaptable = parts[-1] == "kernel" and parts[-2] in projections
        out.append((parts[-2] if adaptable and not set(parts) & set(HEADS) else "", x))
    return out


def _lora_elements(cfg: TrainConfig, model_cfg, params) -> tuple[list, list]:
    """(elements, ndim) of what trains under LoRA: each adapted kernel's A and B, and the
    classifier's head (BERT's with its pooler)."""
    from kubejax.models.lora import TRAINED_HEADS, target_groups, target_names
    from kubejax.models.partitioning import path_name

    names = target_names(cfg.lora_targets, target_groups(model_cfg.model_type))
    adapters, head = [], []
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), (name, _) in zip(flat, _kernels(model_cfg, params), strict=True):
        if set(path_name(path).split(".")) & set(TRAINED_HEADS):
            head.append((x.size, is_matrix(path_name(path), x.ndim)))
        elif name in names:  # a stacked decoder's kernel [layers, in, out]: an adapter a layer
            *lead, n_in, n_out = x.shape
            stack = math.prod(lead)
            rank = cfg.lora_rank
            adapters += [(stack * n_in * rank, True), (stack * rank * n_out, True)]
    return adapters, head


def _shard_counts(params, sizes: dict[str, int]) -> list[int]:
    """Into how many pieces each parameter is split on this mesh."""
    counts = []
    for axes, x in zip(
        jax.tree.leaves(logical_tree(params), is_leaf=lambda a: isinstance(a, tuple)),
        jax.tree.leaves(params),
        strict=True,
    ):
        spec = sharding.spec_of(axes, x.shape, sizes)
        counts.append(math.prod(sizes[a] for a in spec if a))
    return counts


def _moment_bytes(cfg: TrainConfig, elements: int, matrix: bool) -> int:
    """Bytes the optimizer keeps for a parameter shard of `elements`: float32 moments, the
    first one in `mu_dtype` where set."""
    mu = elements * (2 if cfg.mu_dtype == "bfloat16" else 4)
    if cfg.optimizer == "adamw":
        return mu + 4 * elements
    if cfg.optimizer == "lion":
        return mu
    if cfg.optimizer == "sgd":
        return 0 if cfg.momentum == 0 else 4 * elements
    # Adafactor: a matrix's row and column statistics (≈ 2·√elements), a vector's own.
    return 4 * (2 * math.isqrt(elements) if matrix else elements)


def attention_of(cfg: TrainConfig, model_cfg, platform: str) -> attention.Spec:
    """The attention the run takes on `platform` (`attention.choose`; BERT's is the
    reference); AttentionError becomes the setting's ConfigError."""
    return _attention(cfg, model_cfg, platform)[0]


def attention_reason(cfg: TrainConfig, model_cfg, platform: str | None = None) -> str:
    """Why `auto` takes the attention it takes (on this process's platform by default)."""
    return _attention(cfg, model_cfg, platform or jax.devices()[0].platform)[1]


def _attention(cfg: TrainConfig, model_cfg, platform: str) -> tuple[attention.Spec, str]:
    if not weights.is_decoder(model_cfg):
        if cfg.attention not in ("auto", "xla"):
            raise ConfigError(
                f"attention: {cfg.attention} applies to decoder models; BERT computes the "
                "reference attention (auto or xla)"
            )
        return attention.Spec("xla"), "BERT"
    try:
        return attention.choose(
            cfg.attention,
            platform,
            cfg.max_length,
            packing=getattr(cfg, "packing", False),
            dtype=precision.settle(cfg, platform)[0].dtype,
            head_dim=model_cfg.head_dim,
            block=cfg.attention_block,
        )
    except attention.AttentionError as err:
        raise ConfigError(str(err)) from err


#: One layer's working set while its backward pass runs (its recomputation, the gradients of
#: its intermediates in float32), in multiples of what an unrecomputed layer keeps, by
#: platform: on a TPU fitted to XLA's memory analysis of the v5e's compiled steps (Qwen2.5-0.5B
#: and Llama-3.2-1B shapes, LoRA and full, each remat; bench/NOTES.md, P1), on the CPU to its
#: compiled steps in tests/trainer/test_plan.py (XLA's CPU backend frees more of it sooner). A
#: GPU's is unmeasured: the TPU's, the higher.
WORKING_LAYERS = {"tpu": 3.0, "gpu": 3.0, "cpu": 2.0}


def _activations(
    cfg: TrainConfig,
    model_cfg,
    sizes: dict[str, int],
    micro: int,
    spec: attention.Spec,
    platform: str = "cpu",
) -> int:
    """What the backward pass holds of one micro-batch on one device. A decoder's scanned
    layers keep, per token and layer, what `remat`'s policy saves: `none` and `minimal` the
    layer's input, every projection's output and the attention's (its context; splash's and
    cuDNN's softmax statistics; `none` with the reference attention also its float32 scores),
    `full` the layer's input alone; beside them one layer's working set (`WORKING_LAYERS`; the
    reference attention's scores and probabilities of that layer; the blocked path's one
    block). BERT (unrolled, no remat) keeps the inputs of every product and norm."""
    t = sizes["tensor"]
    h, layers, n = model_cfg.hidden_size, model_cfg.num_hidden_layers, cfg.max_length
    heads = model_cfg.num_attention_heads
    head_dim = getattr(model_cfg, "head_dim", h // heads)
    q = heads * head_dim // t
    kv = getattr(model_cfg, "num_key_value_heads", heads) * head_dim // t
    m = model_cfg.intermediate_size // t
    cbytes = 2 if cfg.dtype == "bfloat16" else 4
    tokens = micro * n
    impl = spec.implementation
    scores = heads // t * n * 4  # one query's float32 scores over every key
    if not weights.is_decoder(model_cfg):
        layer = (6 * h + 3 * q + 3 * kv + 2 * m) * cbytes + 2 * scores
        return tokens * (layers * layer + 2 * h * cbytes)
    elems = 6 * h + 3 * q + 3 * kv + 4 * m
    stats = heads // t * 4 if impl in ("splash", "cudnn") else 0  # the log-sum-exp, float32
    kept = {
        "none": (3 * h + 2 * q + 2 * kv + 2 * m) * cbytes
        + stats
        + (scores if impl == "xla" else 0),
        "minimal": (3 * h + 2 * q + 2 * kv + 2 * m) * cbytes + stats,
        "full": h * cbytes,
    }[cfg.remat]
    per_layer = elems * cbytes + (scores if impl == "xla" else 0)
    working = WORKING_LAYERS.get(platform, 3.0) * per_layer
    # A classifier's last layer computes its last tokens' queries alone: the scan keeps L - 1
    # layers', the last layer its input and every token's keys and values.
    last = 0
    if (cfg.task or "classification") == "classification":
        layers -= 1
        last = h * cbytes if cfg.remat == "full" else (h + 2 * kv) * cbytes
    # The blocked path holds one block's scores, probabilities and their gradient at a time;
    # splash's fused backward kernel a layer's queries' gradient per block of keys, summed
    # after it.
    block = micro * heads // t * min(spec.block, n) * n * 10 if impl == "chunked" else 0
    if impl == "splash":
        block = tokens * -(-n // min(spec.block, n)) * q * cbytes
    # The embeddings' output and the final norm's, beside the layers.
    return int(tokens * (layers * kept + last + working + 2 * h * cbytes)) + block


def _gathered(params, shards: list[int], sizes, pbytes: int, cfg: TrainConfig) -> int:
    """FSDP gathers each layer's weights for its products and holds the layer's whole gradient
    before reducing it to shards: two copies of the largest layer (or the embedding table), one
    under LoRA (the frozen base has no gradient); bfloat16 weights' update writes new weights
    beside the old ones (its float32 arithmetic fused, measured on the TPU v5e)."""
    out = 0
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if sizes["fsdp"] > 1:
        groups: dict[str, int] = {}
        for (path, x), n in zip(flat, shards, strict=True):
            name = path_name(path)
            # One layer's weights: BERT's `layers.3.`, or a slice of the decoder's stacked
            # `model.layers.` (one layer at a time is gathered).
            layer = re.match(r".*?layers?\.(\d+\.)?", name)
            key = layer[0] if layer else name
            stacked = layer is not None and not layer[1] and x.ndim >= 1
            size = x.size // x.shape[0] if stacked else x.size
            whole = size // n * (sizes["fsdp"] if n % sizes["fsdp"] == 0 and n > 1 else 1)
            matrix = is_matrix(name, x.ndim)
            groups[key] = groups.get(key, 0) + whole * (pbytes if matrix else 4)
        # Under LoRA the gathered base takes no gradient: one copy.
        out += (2 if cfg.peft == "none" else 1) * max(groups.values())
    if cfg.param_dtype == "bfloat16" and cfg.peft == "none":
        # The update's new weights beside the old (bfloat16), before they replace them.
        out += sum(
            x.size // n * pbytes
            for (path, x), n in zip(flat, shards, strict=True)
            if is_matrix(path_name(path), x.ndim)
        )
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


#: What the plan may suggest beyond the mesh and the micro-batch, in the order it tries them,
#: one alone and then together: the setting and its value (the attention's: a memory-efficient
#: one the platform runs, `_remedies`).
REMEDIES = (
    ("attention", None),
    ("remat", "minimal"),
    ("remat", "full"),
    ("param_dtype", "bfloat16"),
    ("peft", "lora"),
)


def _remedies(cfg: TrainConfig, model_cfg, platform: str) -> list[tuple[str, object]]:
    """The `REMEDIES` that change something for `cfg` (never a setting it already has, nor
    one that would keep more than it does)."""
    decoder = weights.is_decoder(model_cfg)
    order = ("none", "minimal", "full")
    out = []
    for setting, value in REMEDIES:
        if setting == "attention":
            # The reference keeps every layer's scores: a memory-efficient one instead.
            if not decoder or attention_of(cfg, model_cfg, platform).implementation != "xla":
                continue
            auto = attention_of(dataclasses.replace(cfg, attention="auto"), model_cfg, platform)
            value = auto.implementation if auto.implementation != "xla" else "chunked"
        elif setting == "remat":
            if not decoder or order.index(value) <= order.index(as_asked(cfg).remat):
                continue
        elif (setting == "peft" and cfg.peft != "none") or getattr(cfg, setting) == value:
            continue
        out.append((setting, value))
    return out


def smallest_fit(
    cfg: TrainConfig,
    model_cfg,
    num_labels: int,
    devices: int,
    device_memory: int,
    platform: str = "cpu",
) -> list[tuple[dict, MemoryPlan]]:
    """Up to two ways to fit on `devices` devices, each changing as little as can be: the mesh
    and the micro-batch alone (the largest micro-batch, the least sharding: fsdp before
    tensor); and one of `REMEDIES` alone, or several together in their order, at the run's own
    micro-batch where that fits. Each is (the changed settings, their plan); empty when
    nothing fits."""
    cfg = as_asked(cfg)
    params = abstract_params(model_cfg, cfg.task or "classification", num_labels)
    tensors = []
    for tensor in _divisors(devices):
        try:
            sharding.check_model(model_cfg, {"tensor": tensor})
            tensors.append(tensor)
        except sharding.MeshError:
            pass

    def search(changes: dict, accums) -> tuple[dict, MemoryPlan] | None:
        base = dataclasses.replace(cfg, **changes)
        for accum in accums:
            for tensor in tensors:
                if (cfg.global_batch_size // accum) % (devices // tensor):
                    continue
                for fsdp in _divisors(devices // tensor):
                    mesh = f"data={devices // tensor // fsdp},fsdp={fsdp},tensor={tensor}"
                    trial = dataclasses.replace(base, mesh=mesh, grad_accum_steps=accum)
                    plan = plan_memory(
                        trial, model_cfg, num_labels, devices, device_memory, params, platform
                    )
                    if plan.fits:
                        found = {**changes, "mesh": mesh, "grad_accum_steps": accum}
                        changed = {k: v for k, v in found.items() if _differs(cfg, k, v, devices)}
                        return changed, plan
        return None

    options = []
    smaller = search({}, _divisors(cfg.global_batch_size))
    if smaller:
        options.append(smaller)
    remedies = _remedies(cfg, model_cfg, platform)
    candidates = [{k: v} for k, v in remedies]
    candidates += [dict(remedies[: i + 1]) for i in range(1, len(remedies))]
    for accums in ([cfg.grad_accum_steps], _divisors(cfg.global_batch_size)):
        found = next((f for c in candidates if (f := search(c, accums))), None)
        if found:
            if not options or found[0] != options[0][0]:
                options.append(found)
            break
    return options


def _differs(cfg: TrainConfig, setting: str, value, devices: int) -> bool:
    """Whether `value` of `setting` is a change for `cfg` (a mesh compared by its sizes)."""
    if setting == "mesh":
        return sharding.parse_mesh(value, devices) != sharding.parse_mesh(cfg.mesh, devices)
    return getattr(cfg, setting) != value


def check_fits(
    cfg: TrainConfig,
    model_cfg,
    num_labels: int,
    devices: int,
    device_memory: int,
    platform: str = "cpu",
) -> MemoryPlan:
    """The plan of the run as `fit_memory` settles it (`grad_accum_steps` and `remat` `auto`
    chosen), or InfeasibleError naming each figure and the least change that fits (never a
    setting the run already has)."""
    return fit_memory(cfg, model_cfg, num_labels, devices, device_memory, platform)[1].plan


#: The remat policies in the order `auto` tries them, the cheapest first: by what the backward
#: pass computes again (a decoder layer's products: 30 a step kept, 31 with `minimal`, 38 with
#: `full`: bench/NOTES.md, T2). Micro-batches come before any of them: on the v5e, Llama-3.2-1B
#: LoRA at 8,192 × 2 ran 10,513 tokens/s in one batch under `full` and 15,530 in two
#: micro-batches without remat (bench/tpu-results.md, NOTES round 44).
REMAT_BY_COST = ("none", "minimal", "full")


@dataclasses.dataclass(frozen=True)
class Fitting:
    """How a run's batch is split and what its layers keep: `grad_accum_steps` and `remat` as
    set, or as `auto` chose them (`fit_memory`), with the plan of that choice."""

    grad_accum_steps: int
    remat: str
    plan: MemoryPlan
    #: whether `auto` chose either setting
    chosen: bool = False
    #: the bytes a device needs as the run first asks (the fewest micro-batches it allows, no
    #: remat where `remat` is auto), where that does not fit
    as_asked: int | None = None
    as_asked_accum: int = 1
    decoder: bool = True

    def describe(self) -> str:
        """One piece of the trainer's first line, e.g. `2 micro-batches of 4 × 2,048, remat
        none (auto: 20.3 GiB as one batch, 15.8 GiB device)`."""
        text = _batches(self.grad_accum_steps, self.plan)
        if self.decoder:
            text += f", remat {self.remat}"
        if not self.chosen:
            return f"{text} (as set)"
        memory = self.plan.device_memory
        if memory is None:
            return f"{text} (auto: no device memory known to plan against)"
        if self.as_asked is None:
            return f"{text} (auto: {_gib(self.plan.total)} of the {_gib(memory)} device)"
        k = self.as_asked_accum
        asked = "as one batch" if k == 1 else f"in {k} micro-batches"
        if self.decoder and self.remat != "none":
            asked += " without remat"
        return f"{text} (auto: {_gib(self.as_asked)} {asked}, {_gib(memory)} device)"


def _batches(count: int, plan: MemoryPlan) -> str:
    """`2 micro-batches of 4 × 2,048`: the count, and each device's rows × tokens."""
    batches = "one batch" if count == 1 else f"{count} micro-batches"
    return f"{batches} of {plan.micro_batch} × {plan.length:,}"


def _gib(n: float) -> str:
    """Bytes for the first line: GiB to a tenth, MiB below one GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def as_asked(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with `grad_accum_steps` and `remat` `auto` read as the run first asks: one batch,
    no remat (what `plan_memory` plans where nothing has settled them)."""
    changes = {}
    if cfg.grad_accum_steps == AUTO:
        changes["grad_accum_steps"] = 1
    if cfg.remat == AUTO:
        changes["remat"] = "none"
    return dataclasses.replace(cfg, **changes) if changes else cfg


def accumulation_counts(cfg: TrainConfig, devices: int) -> list[int]:
    """The counts of micro-batches `auto` may take, fewest first: the divisors of each
    device's share of the global batch that keep a micro-batch within `max_micro_batch`
    (where set); an explicit count alone."""
    if cfg.grad_accum_steps != AUTO:
        return [int(cfg.grad_accum_steps)]
    sizes = sharding.parse_mesh(cfg.mesh, devices)
    share = max(cfg.global_batch_size // (sizes["data"] * sizes["fsdp"]), 1)
    cap = cfg.max_micro_batch or share
    return [k for k in _divisors(share) if share // k <= cap]


def remat_policies(model_cfg) -> tuple[str, ...]:
    """The remat policies a model's family runs: a decoder's (`decoder.REMAT_POLICIES`);
    BERT trains without."""
    if not weights.is_decoder(model_cfg):
        return ("none",)
    from kubejax.models.decoder import REMAT_POLICIES

    return tuple(REMAT_POLICIES)


def check_family(cfg: TrainConfig, model_cfg) -> None:
    """An explicit `remat` the model's family has no policy for: ConfigError naming it."""
    policies = remat_policies(model_cfg)
    if cfg.remat == AUTO or cfg.remat in policies:
        return
    if not weights.is_decoder(model_cfg):
        raise ConfigError(f"remat: {cfg.remat!r} applies to decoder models; BERT trains without")
    raise ConfigError(
        f"remat: {cfg.remat!r} is not a policy of the {model_cfg.model_type} model; its "
        f"policies are {', '.join((*policies, AUTO))}"
    )


def fit_memory(
    cfg: TrainConfig,
    model_cfg,
    num_labels: int,
    devices: int,
    device_memory: int | None,
    platform: str = "cpu",
    params=None,
) -> tuple[TrainConfig, Fitting]:
    """`cfg` with `grad_accum_steps` and `remat` `auto` settled, and the choice: the fastest
    arrangement whose plan fits `device_memory` — the run as it asks; else more micro-batches
    of the same global batch (`accumulation_counts`, the fewest that fit); else the cheapest
    remat policy that fits (`REMAT_BY_COST`), each with the fewest micro-batches. With no
    memory known, the run as it asks. An explicit setting is kept; InfeasibleError when
    nothing fits, naming each figure and the two nearest changes (`smallest_fit`).
    ConfigError: a remat policy the model's family lacks (`check_family`)."""
    check_family(cfg, model_cfg)
    cfg = precision.settle(cfg, platform)[0]  # never suggest the bfloat16 `auto` takes already
    decoder = weights.is_decoder(model_cfg)
    if params is None:
        params = abstract_params(model_cfg, cfg.task or "classification", num_labels)
    remats = (cfg.remat,)
    if cfg.remat == AUTO:
        remats = tuple(r for r in REMAT_BY_COST if r in remat_policies(model_cfg))
    counts = accumulation_counts(cfg, devices)
    chosen = AUTO in (cfg.grad_accum_steps, cfg.remat)
    tried: list[tuple[TrainConfig, MemoryPlan]] = []
    for remat in remats:
        for accum in counts:
            trial = dataclasses.replace(cfg, grad_accum_steps=accum, remat=remat)
            plan = plan_memory(trial, model_cfg, num_labels, devices, device_memory, params,
                               platform)  # fmt: skip
            tried.append((trial, plan))
            if plan.fits:
                first = tried[0][1]
                fitting = Fitting(
                    accum, remat, plan, chosen, None if len(tried) == 1 else first.total,
                    counts[0], decoder,
                )  # fmt: skip
                return trial, fitting
    asked, least = tried[0], tried[-1]
    raise _refusal(cfg, asked, least, model_cfg, num_labels, devices, device_memory, platform)


def _refusal(cfg, asked, least, model_cfg, num_labels, devices, device_memory, platform):
    """InfeasibleError for a run nothing `auto` tries fits: the run as it asks (each figure),
    the least `auto` tried, and up to two ways to fit from there (`smallest_fit`: the mesh, or
    a setting of `REMEDIES`), never one of the settings `auto` was left to choose."""
    (_, plan), (least_cfg, least_plan) = asked, least
    left = {k for k in ("grad_accum_steps", "remat") if getattr(cfg, k) == AUTO}
    ways = []
    for changes, p in smallest_fit(least_cfg, model_cfg, num_labels, devices, device_memory,
                                   platform):  # fmt: skip
        shown = {k: v for k, v in changes.items() if k not in left}
        if shown:
            ways.append(f"{', '.join(f'{k}={v}' for k, v in shown.items())} "
                        f"({human(p.total)} per device)")  # fmt: skip
    if ways:
        advice = "fits with " + ", or with ".join(ways)
    else:
        tried = [f"{k}={v}" for k, v in _remedies(least_cfg, model_cfg, platform)]
        options = ["more devices (replicas × devices_per_worker)", *tried, "a shorter max_length"]
        advice = (
            f"nothing on {devices} device(s) fits even one row per device: {', '.join(options)}"
        )
    least_said = ""
    if left:
        remat = f", remat {least_cfg.remat}" if weights.is_decoder(model_cfg) else ""
        least_said = (
            f", and {human(least_plan.total)} at the least that auto tries "
            f"({_batches(least_cfg.grad_accum_steps, least_plan)}{remat})"
        )
    return InfeasibleError(
        f"device_memory: the run needs {human(plan.total)} per device ({plan.figures()}), "
        f"more than the {human(device_memory)} of the device{least_said}; {advice}"
    )


def model_config(cfg: TrainConfig):
    """The model's config without its weights: a local folder's, `scratch_config`, or a hub
    id's config.json alone."""
    from pathlib import Path

    if cfg.model == "scratch":
        return weights.scratch_config(cfg.scratch_config)
    folder = Path(cfg.model).expanduser()
    if not folder.is_dir():
        from huggingface_hub import hf_hub_download

        try:
            folder = Path(hf_hub_download(cfg.model, "config.json")).parent
        except Exception as err:  # the hub client raises many kinds; all mean "not available"
            raise FileNotFoundError(
                f"neither a local folder nor a reachable hub id ({type(err).__name__})"
            ) from err
    return weights.load_config(folder)


class ModelConfigUnavailable(ConfigError):
    """The model's config cannot be read on this machine: a folder only the job's pods see
    (a volume), a hub id this machine cannot reach."""


def model_config_file(path: str):
    """The config of `--model-config`: a config.json (any name), or a folder holding one."""
    from pathlib import Path

    given = Path(path).expanduser()
    try:
        if given.is_dir():
            return weights.load_config(given)
        if not given.is_file():
            raise FileNotFoundError("neither a config.json nor a folder holding one")
        return weights.config_from_file(given)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model_config: {path}: {str(err).removeprefix('model: ')}") from err


def check_job(
    cfg: TrainConfig,
    replicas: int,
    devices_per_worker: int,
    node_selector: dict | None = None,
    model_cfg=None,
) -> tuple[MemoryPlan | None, int]:
    """Check a job before it is submitted (`fit_job`); returns the plan of the run as the
    trainer will settle it (None when no memory is known) and the device count."""
    fitting, devices = fit_job(cfg, replicas, devices_per_worker, node_selector, model_cfg)
    return (None if fitting is None else fitting.plan), devices


def fit_job(
    cfg: TrainConfig,
    replicas: int,
    devices_per_worker: int,
    node_selector: dict | None = None,
    model_cfg=None,
) -> tuple[Fitting | None, int]:
    """Check a job before it is submitted: the mesh against replicas × devices per worker
    (one device a worker when 0: a CPU pod), an explicit grad_accum_steps against each
    device's share of the batch, the tensor axis against the model's heads and MLP, a remat
    policy against the model's family, and the memory plan against the device's memory where
    it is known (`device_memory_of`), `auto` settled as the trainer settles it
    (`fit_memory`). The model's config is `model_cfg` where given (`--model-config`), else
    read without weights (`model_config`; ModelConfigUnavailable where this machine cannot
    read it). Returns the choice (None when no memory is known: the model's config is then
    read only for a tensor axis, LoRA or a remat policy) and the device count; ConfigError
    and InfeasibleError name the numbers."""
    devices = replicas * max(devices_per_worker, 1)
    try:
        sizes = sharding.parse_mesh(cfg.mesh, devices)
    except sharding.MeshError as err:
        raise InfeasibleError(
            f"{err} (replicas {replicas} × devices_per_worker {max(devices_per_worker, 1)})"
        ) from err
    batch_devices = sizes["data"] * sizes["fsdp"]
    if cfg.global_batch_size % batch_devices == 0:
        cfg.check_accumulation(batch_devices)
    memory = device_memory_of(cfg, node_selector or {})
    needs_model = sizes["tensor"] > 1 or cfg.peft != "none" or cfg.remat not in (AUTO, "none")
    if not memory and not needs_model:
        return None, devices
    if model_cfg is None:
        model_cfg = _model_config(cfg)
    check_family(cfg, model_cfg)
    if cfg.peft != "none":
        _check_lora(cfg, model_cfg.model_type)
    try:
        sharding.check_model(model_cfg, sizes)
    except sharding.MeshError as err:
        raise InfeasibleError(str(err)) from err
    platform = platform_of(cfg, node_selector or {}, devices_per_worker)
    attention_of(cfg, model_cfg, platform)  # an attention the accelerator cannot run
    if not memory:
        return None, devices
    # The head's size (the labels) is negligible beside the model: Yelp's 5 when not given.
    fitting = fit_memory(cfg, model_cfg, cfg.num_labels or 5, devices, memory, platform)[1]
    return fitting, devices


def _check_lora(cfg: TrainConfig, model_type: str) -> None:
    """The LoRA targets against the projections of the model's family."""
    from kubejax.models.lora import LoraError, target_groups, target_names

    groups = target_groups(model_type)
    try:
        unknown = [n for n in target_names(cfg.lora_targets, groups) if n not in groups["all"]]
    except LoraError as err:
        raise ConfigError(str(err)) from err
    if unknown:
        raise ConfigError(
            f"lora_targets: {', '.join(unknown)} matches no module of the {model_type} model; "
            f"its projections are {', '.join(groups['all'])} (groups: {', '.join(groups)})"
        )


def _model_config(cfg: TrainConfig):
    from pathlib import Path

    try:
        return model_config(cfg)
    except (OSError, ValueError) as err:
        # Not here at all (a volume of the pods, a hub id out of reach), or here but unusable.
        here = cfg.model == "scratch" or Path(cfg.model).expanduser().is_dir()
        error = ConfigError if here else ModelConfigUnavailable
        raise error(f"model: {cfg.model}: {err}") from err
