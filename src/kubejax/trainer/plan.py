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

from kubejax.errors import InfeasibleError
from kubejax.models import weights
from kubejax.models.partitioning import logical_tree
from kubejax.trainer import sharding
from kubejax.trainer.config import ConfigError, TrainConfig, parse_bytes

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


def device_memory_of(cfg: TrainConfig, node_selector: dict | None = None) -> int | None:
    """The memory the plan checks against: the `device_memory` setting (what a device can
    use), else the GPU of the pods' node selector (`nvidia.com/gpu.product`) times
    JAX_MEMORY_FRACTION, else what JAX reports of its first device (a GPU's `bytes_limit`,
    which is that share already; nothing on CPU)."""
    if cfg.device_memory:
        return parse_bytes(cfg.device_memory)
    product = (node_selector or {}).get("nvidia.com/gpu.product")
    if product:
        memory = gpu_memory(product)
        return None if memory is None else int(memory * JAX_MEMORY_FRACTION)
    if node_selector is None and jax.devices()[0].platform == "gpu":
        return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    return None


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
) -> MemoryPlan:
    """The plan of `cfg` (mesh, batch, dtypes, remat, optimizer) on `devices` devices
    (`params`: the model's `abstract_params`, when already at hand)."""
    sizes = sharding.parse_mesh(cfg.mesh, devices)
    if params is None:
        params = abstract_params(model_cfg, cfg.task or "classification", num_labels)
    shards = _shard_counts(params, sizes)
    pbytes = 2 if cfg.param_dtype == "bfloat16" else 4
    elems = [(x.size // n, x.ndim) for x, n in zip(jax.tree.leaves(params), shards, strict=True)]
    held = sum(e * (pbytes if nd >= 2 else 4) for e, nd in elems)
    if cfg.peft == "qlora":  # the projections' codes and block scales in place of the kernels
        held -= _quantized_saving(cfg, model_cfg, params, shards, pbytes)
    # What trains: everything, or LoRA's adapters (replicated, float32, added to what is held)
    # and a classifier's head (held already).
    trains = elems
    if cfg.peft != "none":
        adapters, head = _lora_elements(cfg, model_cfg, params)
        held += sum(e * 4 for e, _ in adapters)
        trains = adapters + head
    trained = sum(e * (pbytes if nd >= 2 and cfg.peft == "none" else 4) for e, nd in trains)
    batch_devices = sizes["data"] * sizes["fsdp"]
    micro = cfg.global_batch_size // cfg.grad_accum_steps // batch_devices
    return MemoryPlan(
        mesh=sizes,
        micro_batch=micro,
        length=cfg.max_length,
        params=held,
        # The accumulation's running sum beside each micro-batch's gradients.
        grads=trained * (2 if cfg.grad_accum_steps > 1 else 1),
        optimizer=sum(_moment_elements(cfg, e, nd) * 4 for e, nd in trains),
        activations=_activations(cfg, model_cfg, sizes, micro),
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
            scales = x.shape[0] // block_size(x.shape[0]) * x.shape[1] * 4
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
            head.append((x.size, x.ndim))
        elif name in names:
            adapters += [(x.shape[0] * cfg.lora_rank, 2), (cfg.lora_rank * x.shape[1], 2)]
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


def _moment_elements(cfg: TrainConfig, elements: int, ndim: int) -> int:
    """float32 values the optimizer keeps for a parameter shard of `elements`."""
    if cfg.optimizer == "adamw":
        return 2 * elements
    if cfg.optimizer == "lion":
        return elements
    if cfg.optimizer == "sgd":
        return 0 if cfg.momentum == 0 else elements
    # Adafactor: a matrix's row and column statistics (≈ 2·√elements), a vector's own.
    return 2 * math.isqrt(elements) if ndim >= 2 else elements


def _activations(cfg: TrainConfig, model_cfg, sizes: dict[str, int], micro: int) -> int:
    """What the backward pass keeps of one micro-batch on one device: per token and layer,
    the inputs of every product and norm, the attention's float32 scores and probabilities
    (heads × length), the MLP's intermediates; with `remat` only the projections' outputs
    (`minimal`) or each layer's input (`full`), plus one layer's worth being recomputed."""
    t = sizes["tensor"]
    h, layers, n = model_cfg.hidden_size, model_cfg.num_hidden_layers, cfg.max_length
    heads = model_cfg.num_attention_heads
    head_dim = getattr(model_cfg, "head_dim", h // heads)
    q = heads * head_dim // t
    kv = getattr(model_cfg, "num_key_value_heads", heads) * head_dim // t
    m = model_cfg.intermediate_size // t
    gated = hasattr(model_cfg, "num_key_value_heads")  # decoders: gate · up
    scores = 2 * heads // t * n * 4  # float32 scores and probabilities, per query token
    elems = 6 * h + 3 * q + 3 * kv + (4 if gated else 2) * m
    if sizes["fsdp"] > 1:
        # Each weight's gradient shard is computed from its input re-laid across the fsdp
        # devices: a second copy of the products' inputs (measured on XLA's CPU compiler).
        elems += 2 * h + q + m
    cbytes = 2 if cfg.dtype == "bfloat16" else 4
    layer = elems * cbytes + scores
    kept = {
        "none": layer,
        "minimal": (2 * h + q + 2 * kv + (2 if gated else 1) * m) * cbytes,
        "full": h * cbytes,
    }[cfg.remat]
    tokens = micro * n
    recomputed = 0 if cfg.remat == "none" else layer
    # The embeddings' output and the final norm's, beside the layers.
    return tokens * (layers * kept + recomputed + 2 * h * cbytes)


def _gathered(params, shards: list[int], sizes, pbytes: int, cfg: TrainConfig) -> int:
    """FSDP gathers each layer's weights for its products and holds the layer's whole gradient
    before reducing it to shards: two copies of the largest layer (or the embedding table), one
    under LoRA (the frozen base has no gradient); bfloat16 weights are updated through a float32
    copy of each shard."""
    from kubejax.models.partitioning import path_name

    out = 0
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if sizes["fsdp"] > 1:
        groups: dict[str, int] = {}
        for (path, x), n in zip(flat, shards, strict=True):
            name = path_name(path)
            layer = re.match(r".*?layers?\.\d+\.", name)
            key = layer[0] if layer else name
            whole = x.size // n * (sizes["fsdp"] if n % sizes["fsdp"] == 0 and n > 1 else 1)
            groups[key] = groups.get(key, 0) + whole * (pbytes if x.ndim >= 2 else 4)
        # Under LoRA the gathered base takes no gradient: one copy.
        out += (2 if cfg.peft == "none" else 1) * max(groups.values())
    if cfg.param_dtype == "bfloat16" and cfg.peft == "none":
        out += sum(x.size // n * 4 for (_, x), n in zip(flat, shards, strict=True) if x.ndim >= 2)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def smallest_fit(
    cfg: TrainConfig, model_cfg, num_labels: int, devices: int, device_memory: int
) -> tuple[str, int, MemoryPlan] | None:
    """The largest micro-batch (fewest accumulation steps) that fits with some mesh, and for
    it the least sharding (fsdp before tensor): (mesh, grad_accum_steps, plan), or None when
    nothing on `devices` devices fits."""
    params = abstract_params(model_cfg, cfg.task or "classification", num_labels)
    tensors = []
    for tensor in _divisors(devices):
        try:
            sharding.check_model(model_cfg, {"tensor": tensor})
            tensors.append(tensor)
        except sharding.MeshError:
            pass
    for accum in _divisors(cfg.global_batch_size):
        for tensor in tensors:
            if (cfg.global_batch_size // accum) % (devices // tensor):
                continue
            for fsdp in _divisors(devices // tensor):
                mesh = f"data={devices // tensor // fsdp},fsdp={fsdp},tensor={tensor}"
                trial = dataclasses.replace(cfg, mesh=mesh, grad_accum_steps=accum)
                plan = plan_memory(trial, model_cfg, num_labels, devices, device_memory, params)
                if plan.fits:
                    return mesh, accum, plan
    return None


def check_fits(
    cfg: TrainConfig, model_cfg, num_labels: int, devices: int, device_memory: int
) -> MemoryPlan:
    """The plan, or ConfigError naming each figure and the smallest setting that fits."""
    plan = plan_memory(cfg, model_cfg, num_labels, devices, device_memory)
    if plan.fits:
        return plan
    fit = smallest_fit(cfg, model_cfg, num_labels, devices, device_memory)
    advice = (
        f"fits with mesh={fit[0]} and grad_accum_steps={fit[1]} ({human(fit[2].total)} per device)"
        if fit
        else f"no mesh of {devices} devices fits even one row per device: more devices "
        "(replicas × devices_per_worker), bfloat16 weights (param_dtype), remat or a shorter "
        "max_length"
    )
    raise InfeasibleError(
        f"device_memory: the run needs {human(plan.total)} per device ({plan.figures()}), "
        f"more than the {human(device_memory)} of the device; {advice}"
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


def check_job(
    cfg: TrainConfig, replicas: int, devices_per_worker: int, node_selector: dict | None = None
) -> tuple[MemoryPlan | None, int]:
    """Check a job before it is submitted: the mesh against replicas × devices per worker
    (one device a worker when 0: a CPU pod), the tensor axis against the model's heads and
    MLP, and the memory plan against the device's memory where it is known
    (`device_memory_of`). Returns the plan (None when no memory is known: the model's config is
    then read only for a tensor axis) and the device count; ConfigError names the numbers."""
    devices = replicas * max(devices_per_worker, 1)
    try:
        sizes = sharding.parse_mesh(cfg.mesh, devices)
    except sharding.MeshError as err:
        raise InfeasibleError(
            f"{err} (replicas {replicas} × devices_per_worker {max(devices_per_worker, 1)})"
        ) from err
    memory = device_memory_of(cfg, node_selector or {})
    if not memory and sizes["tensor"] == 1 and cfg.peft == "none":
        return None, devices
    model_cfg = _model_config(cfg)
    if cfg.peft != "none":
        _check_lora(cfg, model_cfg.model_type)
    try:
        sharding.check_model(model_cfg, sizes)
    except sharding.MeshError as err:
        raise InfeasibleError(str(err)) from err
    if not memory:
        return None, devices
    # The head's size (the labels) is negligible beside the model: Yelp's 5 when not given.
    return check_fits(cfg, model_cfg, cfg.num_labels or 5, devices, memory), devices


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
    try:
        return model_config(cfg)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model: {cfg.model}: {err}") from err
