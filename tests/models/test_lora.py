"""LoRA: adapters on every decoder family that PEFT loads onto transformers' model with our
logits, the merged model transformers loads alone, the trainer training the adapters (and a
classifier's head) only, and LoRA settings refused naming what exists."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from kubejax.models import lora, weights
from kubejax.trainer import plan
from kubejax.trainer.config import TrainConfig
from kubejax.trainer.train import main
from tests.helpers import assert_close_to_scale, compiled_call, tiny_args
from tests.models.decoders import TINY, save_tiny


def _adapted(folder, head: str):
    """Our model of `folder` with rank-4 adapters on every projection, trained-looking: B
    random (a fresh B is zero) and, for a classifier, the head moved."""
    cfg = weights.load_config(folder)
    model, _ = weights.from_checkpoint(folder, cfg, head, 3, jnp.float32)
    adapted = lora.apply(model, rank=4, alpha=8.0, targets="all")
    # The decoder's layers are stacked: one projection of each kind holds every layer's.
    assert len(adapted) == 7
    up = model.model.layers.mlp.up_proj
    assert up.lora_a.shape == (cfg.num_hidden_layers, cfg.hidden_size, 4)
    for i, layer in enumerate(lora.adapters(model).values()):
        b = jax.random.normal(jax.random.key(i), layer.lora_b.shape) * 0.05
        layer.lora_b = nnx.LoRAParam(b)
    if head == "classification":
        model.score.kernel = nnx.Param(model.score.kernel[...] + 0.3)
    return model


@pytest.mark.parametrize("head", ["classification", "causal-lm"])
@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.slow
def test_peft_loads_our_adapter_with_our_logits_and_the_merged_model_alone(tmp_path, family, head):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ref = save_tiny(family, tmp_path / "base", head=head)
    model = _adapted(tmp_path / "base", head)
    lora.save_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == ("SEQ_CLS" if head == "classification" else "CAUSAL_LM")
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    peft_model = PeftModel.from_pretrained(ref, str(tmp_path / "adapter"), adapter_name="first")
    # Loaded again by name, to read what matched: every adapter key, nothing left over.
    result = peft_model.load_adapter(str(tmp_path / "adapter"), adapter_name="ours")
    assert result.unexpected_keys == []
    assert [k for k in result.missing_keys if "lora_" in k or "ours" in k] == []
    peft_model.set_adapter("ours")
    ids = np.random.default_rng(0).integers(1, 300, (2, 12))
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    ids[mask == 0] = 0  # the pad id: transformers' classifier finds the last token by it
    args = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    ours = np.asarray(compiled_call(model, ids, mask))
    with torch.no_grad():
        expected = peft_model(**args).logits.numpy()
    real = mask.astype(bool) if head == "causal-lm" else slice(None)
    assert_close_to_scale(ours[real], expected[real], 1e-4, f"{family} {head} with the adapter")

    lora.merge(model)
    assert lora.adapters(model) == {}
    weights.save_model_dir(model, tmp_path / "merged", ["a", "b", "c"], None, max_length=32)
    auto = AutoModelForSequenceClassification if head == "classification" else AutoModelForCausalLM
    merged = auto.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        alone = merged(**args).logits.numpy()
    assert_close_to_scale(alone[real], expected[real], 1e-4, f"{family} {head} merged")


def test_lora_settings_that_cannot_apply_are_refused_naming_what_exists(tmp_path):
    save_tiny("llama", tmp_path / "base")
    cfg = weights.load_config(tmp_path / "base")
    model, _ = weights.from_checkpoint(tmp_path / "base", cfg, "causal-lm", 0, jnp.float32)
    with pytest.raises(lora.LoraError, match="lora_rank: must be at least 1, got 0"):
        lora.apply(model, 0, 8.0, "attention")
    with pytest.raises(lora.LoraError) as err:
        lora.apply(model, 4, 8.0, "q_proj,query")
    assert str(err.value) == (
        "lora_targets: query matches no module of the model; its projections are down_proj, "
        "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (groups: attention, mlp, all)"
    )
    with pytest.raises(lora.LoraError, match="peft: the model has no LoRA adapter to export"):
        lora.save_adapter(model, tmp_path / "adapter", "base")
    assert lora.target_names("attention,gate_proj") == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"
    )  # fmt: skip


@pytest.mark.slow
def test_trainer_trains_the_adapters_and_head_only(tiny_decoder_dir, prepared_decoder, tmp_path):
    """peft=lora: the loss falls, the base's weights are the checkpoint's (the merged model
    differs from the base only by each adapter's A·B·scale), the optimizer state holds the
    adapters' and the head's moments only, and the model folder holds the PEFT adapter."""
    from safetensors.numpy import load_file

    out = tmp_path / "out"
    settings = {"peft": "lora", "lora_rank": 4, "lora_alpha": 16, "max_steps": 24,
                "global_batch_size": 16, "learning_rate": 3e-3}  # fmt: skip
    assert main(tiny_args(tiny_decoder_dir, prepared_decoder, out, **settings)) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [row["loss"] for row in metrics["train"]]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
    adapter = load_file(out / "model" / "adapter" / "adapter_model.safetensors")
    config = json.loads((out / "model" / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["modules_to_save"] == ["score"] and config["r"] == 4
    base, merged = (
        load_file(tiny_decoder_dir / "model.safetensors"),
        load_file(out / "model" / "model.safetensors"),
    )
    for name, value in base.items():
        if "_proj.weight" in name and "mlp" not in name:  # adapted: W + (A·B·scale)ᵀ
            stem = f"base_model.model.{name.removesuffix('.weight')}"
            a, b = adapter[f"{stem}.lora_A.weight"], adapter[f"{stem}.lora_B.weight"]
            assert np.abs(b).max() > 0, name  # trained away from zero
            expected = value + (b @ a) * (16 / 4)
        else:
            expected = value
        assert np.abs(merged[name] - expected).max() <= 1e-5 * np.abs(expected).max(), name
    trained = sum(v.size for v in adapter.values())
    assert metrics["final"]["trainable_params"] == trained
    # AdamW's two float32 moments of what trains, and a few scalars (counts, hyperparameters);
    # the memory plan counts the same moments.
    measured = metrics["final"]["optimizer_state_bytes"]
    assert 8 * trained <= measured <= 8 * trained + 64
    cfg = TrainConfig(model=str(tiny_decoder_dir), data_dir="-", output_dir="-", peft="lora",
                      lora_rank=4, global_batch_size=16, max_length=64)  # fmt: skip
    planned = plan.plan_memory(cfg, weights.load_config(tiny_decoder_dir), 5, 1)
    assert planned.optimizer == 8 * trained and planned.grads == 4 * trained


@pytest.mark.parametrize("qtype", ["int8", "nf4"])
@pytest.mark.slow
def test_quantized_kernels_come_back_within_their_step(qtype):
    """Each value returns within half a step of its code: absmax/254 for int8, half the
    widest gap between NF4 levels (0.152 of the block's absmax) for nf4."""
    from kubejax.models.quantize import NF4, dequantize_kernel, quantize_kernel

    w = np.random.default_rng(0).normal(0, 0.02, (96, 40)).astype(np.float32)
    codes, scale = quantize_kernel(w, qtype)
    assert codes.shape == ((96, 40) if qtype == "int8" else (48, 40)) and scale.shape == (3, 40)
    back = np.asarray(dequantize_kernel(jnp.asarray(codes), jnp.asarray(scale), qtype))
    absmax = np.repeat(scale, 32, axis=0)
    step = 1 / 254 if qtype == "int8" else np.diff(NF4).max() / 2
    assert np.all(np.abs(back - w) <= step * absmax + 1e-7)
    if qtype == "nf4":  # each code is a nearest level (ties aside, in the last bit)
        normed, level = w / absmax, (back / absmax)[..., None]
        nearest = np.abs(normed[..., None] - NF4).min(-1, keepdims=True)
        assert np.all(np.abs(normed[..., None] - level) <= nearest + 1e-6)


@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_a_checkpoint_loads_its_projections_quantized(tiny_decoder_dir, qtype):
    """QLoRA's loader quantizes each projection as it is read (no float32 kernel left on a
    device): the codes and scales of quantizing the loaded float32 model, the rest as loaded."""
    cfg = weights.load_config(tiny_decoder_dir)
    direct, _ = weights.from_checkpoint(tiny_decoder_dir, cfg, "causal-lm", 2, jnp.float32,
                                        qtype=qtype)  # fmt: skip
    after, _ = weights.from_checkpoint(tiny_decoder_dir, cfg, "causal-lm", 2, jnp.float32)
    assert lora.quantize(after, qtype) == 7  # stacked: each kind's kernels of every layer
    assert lora.quantize(direct, qtype) == 0  # nothing left to quantize
    loaded, expected = lora.projections(direct), lora.projections(after)
    assert loaded.keys() == expected.keys()
    for path, layer in loaded.items():
        assert layer.kernel is None and layer.qtype == qtype, path
        np.testing.assert_array_equal(layer.qkernel[...], expected[path].qkernel[...])
        np.testing.assert_array_equal(layer.qscale[...], expected[path].qscale[...])
    for (path, ours), (_, theirs) in zip(
        nnx.to_flat_state(nnx.state(direct)), nnx.to_flat_state(nnx.state(after)), strict=True
    ):
        np.testing.assert_array_equal(ours[...], theirs[...], err_msg=str(path))


@pytest.mark.slow
def test_qlora_trains_like_lora_on_a_quantized_base(tiny_decoder_dir, prepared_decoder, tmp_path):
    """peft=qlora: the projections stored as int8 or nf4 codes (the frozen base's bytes, as
    measured and as planned, below LoRA's float32), the losses near LoRA's on the same run
    settings, and the merged (dequantized + adapters) model exported in float32."""
    settings = {"lora_rank": 4, "max_steps": 8, "global_batch_size": 16,
                "learning_rate": 3e-3, "save_final": True}  # fmt: skip
    runs = {"lora": {"peft": "lora"}, "int8": {"peft": "qlora", "weight_qtype": "int8"},
            "nf4": {"peft": "qlora", "weight_qtype": "nf4"}}  # fmt: skip
    finals, losses = {}, {}
    for name, peft in runs.items():
        out = tmp_path / name
        assert main(tiny_args(tiny_decoder_dir, prepared_decoder, out, **settings, **peft)) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        finals[name] = metrics["final"]
        losses[name] = np.array([row["loss"] for row in metrics["train"]])
        cfg = TrainConfig(model=str(tiny_decoder_dir), data_dir="-", output_dir="-",
                          lora_rank=4, global_batch_size=16, max_length=64, **peft)  # fmt: skip
        planned = plan.plan_memory(cfg, weights.load_config(tiny_decoder_dir), 5, 1)
        measured = finals[name]["frozen_params_bytes"] + 4 * finals[name]["trainable_params"]
        assert planned.params == measured, name
    frozen = {name: final["frozen_params_bytes"] for name, final in finals.items()}
    assert frozen["nf4"] < frozen["int8"] < frozen["lora"], frozen
    # The first step sees the quantization alone (every adapter starts at zero); the run then
    # follows LoRA's (the steps after differ as two trainings on nearby weights do).
    for name, first in (("int8", 2e-3), ("nf4", 2e-2)):
        assert abs(losses[name][0] / losses["lora"][0] - 1) <= first, (name, losses)
        assert abs(losses[name].mean() / losses["lora"].mean() - 1) <= 0.05, (name, losses)
    config = json.loads((tmp_path / "nf4" / "model" / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    assert (tmp_path / "nf4" / "model" / "adapter" / "adapter_model.safetensors").is_file()


def _adapted_bert(folder):
    """Our BERT classifier of `folder` with rank-4 adapters on every projection, B random and
    the head (classifier and pooler) moved, as after training."""
    cfg = weights.load_config(folder)
    model, _ = weights.from_checkpoint(folder, cfg, "classification", 5, jnp.float32)
    adapted = lora.apply(model, rank=4, alpha=8.0, targets="all", dropout=0.1)
    assert len(adapted) == 6 * cfg.num_hidden_layers
    for i, layer in enumerate(lora.adapters(model).values()):
        b = jax.random.normal(jax.random.key(i), layer.lora_b.shape) * 0.05
        layer.lora_b = nnx.LoRAParam(b)
    for head in (model.classifier, model.pooler):
        head.kernel = nnx.Param(head.kernel[...] + 0.3)
        head.bias = nnx.Param(head.bias[...] - 0.1)
    return model


@pytest.mark.slow
def test_peft_loads_our_bert_adapter_with_our_logits_and_the_merged_model_alone(
    tiny_model_dir, tmp_path
):
    """BERT's modules under Hugging Face's names (`attention.self.query`, `attention.output.
    dense`, ...), the classifier and pooler as `modules_to_save`; our last layer folds the
    adapted key and value weights into its [CLS] attention (`effective_weight`)."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    model = _adapted_bert(tiny_model_dir)
    lora.save_adapter(model, tmp_path / "adapter", str(tiny_model_dir))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["lora_dropout"] == 0.1
    assert config["modules_to_save"] == ["classifier", "pooler"]
    assert "bert.encoder.layer.1.output.dense" in config["target_modules"]
    assert len(config["target_modules"]) == 12
    ref = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=5)
    peft_model = PeftModel.from_pretrained(ref, str(tmp_path / "adapter"), adapter_name="first")
    result = peft_model.load_adapter(str(tmp_path / "adapter"), adapter_name="ours")
    assert result.unexpected_keys == []
    assert [k for k in result.missing_keys if "lora_" in k or "ours" in k] == []
    peft_model.set_adapter("ours")
    peft_model.eval()
    ids = np.random.default_rng(0).integers(1000, 2000, (3, 12))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    args = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    ours = np.asarray(compiled_call(model, ids, mask))
    with torch.no_grad():
        expected = peft_model(**args).logits.numpy()
    assert_close_to_scale(ours, expected, 1e-4, "bert with the adapter")

    lora.merge(model)
    weights.save_model_dir(model, tmp_path / "merged", list("abcde"), None, max_length=32)
    merged = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        alone = merged(**args).logits.numpy()
    assert_close_to_scale(alone, expected, 1e-4, "bert merged")


@pytest.mark.slow
def test_lora_dropout_masks_the_adapters_inputs_in_training_only(tmp_path):
    """Training forwards (not deterministic) drop the adapters' inputs, differently under each
    key; evaluation, and a rate of 0, compute the undropped adapter."""
    save_tiny("llama", tmp_path / "base", head="classification")
    model = _adapted(tmp_path / "base", "classification")
    ids = np.random.default_rng(1).integers(1, 300, (2, 10))
    mask = np.ones_like(ids)
    plain = np.asarray(model(ids, mask))
    for layer in lora.adapters(model).values():
        layer.lora_dropout = 0.5
    train = [np.asarray(model(ids, mask, deterministic=False, rngs=nnx.Rngs(dropout=k)))
             for k in (0, 1)]  # fmt: skip
    assert np.array_equal(np.asarray(model(ids, mask)), plain)
    assert np.abs(train[0] - plain).max() > 1e-3 and np.abs(train[0] - train[1]).max() > 1e-3
    for layer in lora.adapters(model).values():
        layer.lora_dropout = 0.0
    undropped = model(ids, mask, deterministic=False, rngs=nnx.Rngs(dropout=0))
    assert np.array_equal(np.asarray(undropped), plain)


@pytest.mark.slow
def test_trainer_runs_lora_and_qlora_on_bert(tiny_model_dir, prepared, tmp_path):
    """peft=lora on BERT with lora_dropout: the adapter names BERT's modules and trains them,
    the classifier and the pooler; the merged model is the base plus B·A·scale; the optimizer
    state is the adapters' and head's moments, as planned; peft=qlora stores BERT's
    projections in nf4, as planned."""
    from safetensors.numpy import load_file

    settings = {"lora_rank": 4, "lora_alpha": 16, "lora_targets": "all", "max_steps": 4,
                "global_batch_size": 16, "learning_rate": 3e-3}  # fmt: skip
    runs = {"lora": {"peft": "lora", "lora_dropout": 0.1}, "qlora": {"peft": "qlora"}}
    for name, peft in runs.items():
        out = tmp_path / name
        assert main(tiny_args(tiny_model_dir, prepared, out, **settings, **peft)) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        adapter = load_file(out / "model" / "adapter" / "adapter_model.safetensors")
        trained = sum(v.size for v in adapter.values())
        assert metrics["final"]["trainable_params"] == trained, name
        cfg = TrainConfig(model=str(tiny_model_dir), data_dir="-", output_dir="-",
                          global_batch_size=16, max_length=64,
                          **{k: v for k, v in settings.items() if k.startswith("lora_")},
                          **peft)  # fmt: skip
        planned = plan.plan_memory(cfg, weights.load_config(tiny_model_dir), 5, 1)
        assert planned.optimizer == 8 * trained, name
        measured = metrics["final"]["frozen_params_bytes"] + 4 * trained
        assert planned.params == measured, name
        if name == "lora":
            config = json.loads((out / "model" / "adapter" / "adapter_config.json").read_text())
            assert config["lora_dropout"] == 0.1 and config["r"] == 4
            # The merged output projection of the MLP: the base's plus its trained B·A·scale.
            stem = "bert.encoder.layer.1.output.dense"
            a, b = (adapter[f"base_model.model.{stem}.lora_{x}.weight"] for x in "AB")
            assert np.abs(b).max() > 0
            base = load_file(tiny_model_dir / "model.safetensors")[f"{stem}.weight"]
            merged = load_file(out / "model" / "model.safetensors")[f"{stem}.weight"]
            assert_close_to_scale(merged, base + (b @ a) * 4, 1e-5, "merged output.dense")
            assert "base_model.model.bert.pooler.dense.weight" in adapter
