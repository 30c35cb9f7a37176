"""A BERT-family encoder with a sequence-classification head, in Flax NNX.

transformers 5.x ships no Flax models, so the model is ours, with its config read from a
checkpoint's `config.json` (transformers itself is not imported: with torch beside it, importing
it cost every sweep trial over 2 s); `kubejax.models.weights` maps Hugging Face checkpoints onto
it. Shardings are not hard-coded here: the train step decides them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from kubejax.models.kernels import dense, matmul, operand
from kubejax.models.partitioning import constrain
from kubejax.models.projection import Projection, keep_mask

#: The hidden activations `_activation` computes (BertConfig's `hidden_act`).
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
#: BertConfig's dropout probabilities.
DROPOUT_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")


@dataclasses.dataclass
class BertConfig:
    """The fields of a Hugging Face BERT `config.json` the model reads (transformers' defaults,
    bert-base); `extra` keeps the rest, written back on export."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    classifier_dropout: float | None = None
    model_type: str = "bert"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, values: dict, *, strict: bool = False) -> BertConfig:
        """Checked fields from a config dict; unknown keys go to `extra` (refused if `strict`).
        Raises ValueError naming the field and what it must be."""
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        unknown = sorted(set(values) - set(known))
        if strict and unknown:
            raise ValueError(f"{unknown[0]}: not a BERT config field (known: {', '.join(known)})")
        cfg = cls(**{k: v for k, v in values.items() if k in known})
        cfg.extra = {k: values[k] for k in unknown}
        for name, field in known.items():
            value = getattr(cfg, name)
            if field.type == "int" and (type(value) is not int or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
            if field.type.startswith("float") and not (
                (value is None and "None" in field.type)
                or (isinstance(value, int | float) and not isinstance(value, bool) and value >= 0)
            ):
                raise ValueError(f"{name}: must be a non-negative number, got {value!r}")
            if field.type == "str" and not isinstance(value, str):
                raise ValueError(f"{name}: must be a string, got {value!r}")
            # A rate of 1 or more would scale kept elements by 1/(1 - rate): inf or negative.
            if name in DROPOUT_FIELDS and value is not None and not value < 1:
                raise ValueError(f"{name}: must be in [0, 1), got {value!r}")
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act: {cfg.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})"
            )
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(
                f"hidden_size: {cfg.hidden_size} is not a multiple of num_attention_heads "
                f"({cfg.num_attention_heads})"
            )
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        """A checkpoint's config.json; ValueError names the file and the field."""
        try:
            values = json.loads(Path(path).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        if not isinstance(values, dict):
            raise ValueError(f"{path}: not a JSON object")
        try:
            return cls.from_dict(values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """The config.json contents: the extra keys, then every field."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields.pop("extra"), **fields}

    def label_names(self) -> list[str]:
        """id2label in id order (transformers' LABEL_i names when absent)."""
        id2label = self.extra.get("id2label")
        if id2label:
            return [id2label[k] for k in sorted(id2label, key=int)]
        return [f"LABEL_{i}" for i in range(int(self.extra.get("num_labels", 2)))]


class Dense(Projection):
    """A dense layer through `dense`, its `kernel` [in, out] and `bias` named as nnx.Linear's;
    with a LoRA adapter (`Projection.adapt`), whose dropout draws from `rngs`."""

    def __init__(self, n_in: int, n_out: int, init, dtype, rngs: nnx.Rngs):
        super().__init__(n_in, n_out, True, dtype, init, rngs)

    def __call__(self, x: jax.Array, rngs=None) -> jax.Array:
        x = x.astype(self.dtype)
        y = dense(x, self.weight(), self.bias[...])
        if self.lora_a is None:
            return y
        key = rngs.dropout() if rngs is not None and self.lora_dropout > 0.0 else None
        return self.adapt(x, y, key)


def _dense(n_in: int, n_out: int, cfg: BertConfig, dtype, rngs: nnx.Rngs) -> Dense:
    return Dense(n_in, n_out, nnx.initializers.normal(cfg.initializer_range), dtype, rngs)


def _norm(cfg: BertConfig, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        cfg.hidden_size, epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
    )


def _gelu(x):
    # The exact GELU through erf, as torch computes it: jax.nn.gelu's erfc form costs an exp
    # and several selects more per element on CPU.
    return 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _activation(name: str):
    # Functions of the module, not lambdas made per layer: two models of one config then have
    # equal graphs (the trainer takes a step compiled ahead for an equal one: `trainer.ahead`).
    if name == "gelu":
        return _gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return _gelu_tanh
    if name == "relu":
        return jax.nn.relu
    raise ValueError(f"hidden_act: {name!r} is not supported ({', '.join(ACTIVATIONS)})")


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def softmax_dropout(scores: jax.Array, bias: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """`Dropout(rate)` (the mask of `key`) of softmax(scores + bias) over the last axis, computed
    in float32 and returned in the scores' dtype; `bias` (the attention mask's) gets no gradient.

    JAX's own softmax keeps its float32 output for the backward pass: for bert-base's attention
    at sequence 512, batch 64, a float32 [64, 12, 512, 512] tensor a layer (0.8 GB) written,
    cast and read again, on an H200 (bench/NOTES.md, attempt 36). This keeps each row's max and
    sum only and recomputes the probabilities and the mask in the backward pass, elementwise
    work that XLA's GPU backend fuses into the passes that read the scores anyway.
    """
    return _softmax_dropout_fwd(scores, bias, key, rate)[0]


def _softmax_dropout_fwd(scores, bias, key, rate):
    s = scores.astype(jnp.float32) + bias
    top = s.max(-1, keepdims=True)
    exp = jnp.exp(s - top)
    total = exp.sum(-1, keepdims=True)
    keep, scale = keep_mask(key, scores.shape, rate)
    probs = exp * (scale / total)
    return jnp.where(keep, probs, 0.0).astype(scores.dtype), (scores, bias, key, top, total)


def _softmax_dropout_bwd(rate, residuals, g):
    scores, bias, key, top, total = residuals
    probs = jnp.exp(scores.astype(jnp.float32) + bias - top) / total
    keep, scale = keep_mask(key, scores.shape, rate)
    g_probs = jnp.where(keep, g.astype(jnp.float32) * scale, 0.0)
    grad = probs * (g_probs - (g_probs * probs).sum(-1, keepdims=True))
    return grad.astype(scores.dtype), None, None


softmax_dropout.defvjp(_softmax_dropout_fwd, _softmax_dropout_bwd)


class Dropout(nnx.Module):
    """Inverted dropout whose mask compares 16 random bits per element (`dropout_bits`) with the
    rate; the drop probability is the rate rounded to a multiple of 1/65536."""

    def __init__(self, rate: float):
        self.rate = float(rate)

    def __call__(self, x, *, deterministic: bool, rngs) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        keep, scale = keep_mask(rngs.dropout(), x.shape, self.rate)
        return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


class Embeddings(nnx.Module):
    """Word, position and token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, cfg: BertConfig, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.initializer_range)
        kw = dict(embedding_init=init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.word = nnx.Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        self.position = nnx.Embed(cfg.max_position_embeddings, cfg.hidden_size, **kw)
        self.token_type = nnx.Embed(cfg.type_vocab_size, cfg.hidden_size, **kw)
        self.norm = _norm(cfg, dtype, rngs)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def __call__(self, input_ids, *, positions=None, deterministic: bool, rngs) -> jax.Array:
        """`positions` [batch, length]: each token's position (default: 0, 1, ... a row)."""
        if positions is None:
            position = _rows(self.position, jnp.arange(input_ids.shape[1]))[None]
        else:
            position = _rows(self.position, positions)
        # Single-segment classification: token type 0 everywhere.
        x = (
            _rows(self.word, input_ids)
            + position
            + _rows(self.token_type, jnp.zeros((1, 1), jnp.int32))
        )
        return self.dropout(self.norm(x), deterministic=deterministic, rngs=rngs)


def _rows(embed: nnx.Embed, ids: jax.Array) -> jax.Array:
    """`embed(ids)`, the rows taken from the float32 table and then cast to the compute dtype.

    nnx.Embed casts the whole table first: in a bfloat16 MiniLM train step a convert of the
    30,522 × 384 word table every step, and a gradient scattered into a zeroed table of its
    own for every piece of the batch rather than into the summed gradient (bench/NOTES.md,
    attempt 38). The values are the same: the cast is elementwise.
    """
    return jnp.take(embed.embedding[...], ids, axis=0).astype(embed.dtype)


class Layer(nnx.Module):
    """One post-LayerNorm transformer block, as in BERT."""

    def __init__(self, cfg: BertConfig, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.query = _dense(h, h, cfg, dtype, rngs)
        self.key = _dense(h, h, cfg, dtype, rngs)
        self.value = _dense(h, h, cfg, dtype, rngs)
        self.attn_out = _dense(h, h, cfg, dtype, rngs)
        self.attn_norm = _norm(cfg, dtype, rngs)
        self.intermediate = _dense(h, cfg.intermediate_size, cfg, dtype, rngs)
        self.output = _dense(cfg.intermediate_size, h, cfg, dtype, rngs)
        self.out_norm = _norm(cfg, dtype, rngs)
        self.attn_dropout = Dropout(cfg.attention_probs_dropout_prob)
        self.dropout = Dropout(cfg.hidden_dropout_prob)
        self.act = _activation(cfg.hidden_act)

    def __call__(
        self, x, bias, *, queries: int | jax.Array | None, deterministic: bool, rngs
    ) -> jax.Array:
        """`queries`: compute outputs for the first `queries` positions only, or for the
        positions in an array [batch, n] of them (None: all).

        Their attention still covers every position, so the outputs for those positions are
        the full layer's up to rounding.
        """
        head_dim = x.shape[-1] // self.num_heads
        if queries is None:
            q_in = x
        elif isinstance(queries, int):
            q_in = x[:, :queries]
        else:
            q_in = jnp.take_along_axis(x, queries[..., None], axis=1)
        # Queries scaled before the product: on scores four times their size, XLA's CPU
        # fusion materialized the scale as a full [batch, heads, q, k] constant.
        # LoRA's dropout draws from `rngs` in training only.
        lora_rngs = None if deterministic else rngs
        q = self.query(q_in, lora_rngs) * (1.0 / math.sqrt(head_dim))
        attend = self._attention if queries is None else self._folded_attention
        ctx = attend(x, q, bias, deterministic=deterministic, rngs=rngs)
        attn = self.attn_out(ctx, lora_rngs)
        attn = self.dropout(attn, deterministic=deterministic, rngs=rngs)
        x = self.attn_norm(q_in + attn)
        # The activation in float32, cast back once: in bfloat16, XLA's CPU backend rounded
        # each of the exact GELU's intermediates and of its gradient's to bfloat16 and back
        # (bench/NOTES.md, attempt 40).
        h = self.intermediate(x, lora_rngs)
        ff = self.output(self.act(h.astype(jnp.float32)).astype(h.dtype), lora_rngs)
        ff = self.dropout(ff, deterministic=deterministic, rngs=rngs)
        return self.out_norm(x + ff)

    def _probs(self, scores, bias, *, deterministic: bool, rngs) -> jax.Array:
        rate = self.attn_dropout.rate
        if not deterministic and rate > 0.0 and jax.default_backend() != "cpu":
            return softmax_dropout(scores, bias, rngs.dropout(), rate)
        # Softmax in float32 keeps bfloat16 runs stable. (On CPU `softmax_dropout` is not used:
        # the train steps measured there, in bench/NOTES.md, run this form.)
        probs = jax.nn.softmax(scores.astype(jnp.float32) + bias, axis=-1).astype(scores.dtype)
        return self.attn_dropout(probs, deterministic=deterministic, rngs=rngs)

    def _attention(self, x, q, bias, *, deterministic: bool, rngs) -> jax.Array:
        """Multi-head attention of the (scaled) queries `q` [batch, q, hidden] over `x`."""
        b, nq, h = q.shape
        heads = self.num_heads
        lora_rngs = None if deterministic else rngs
        k, v = self.key(x, lora_rngs), self.value(x, lora_rngs)
        # Head-major [batch, heads, tokens, head_dim] before the products: from the token-major
        # layout XLA's CPU backend computed the probability-value product transposed, more
        # slowly, and copied it back (bench/NOTES.md, attempt 16).
        q, v = (
            operand(t.reshape(b, t.shape[1], heads, h // heads).transpose(0, 2, 1, 3))
            for t in (q, v)
        )
        # The keys straight to [batch, heads, head_dim, tokens]: one copy in bfloat16, not two.
        keys = operand(k.reshape(b, k.shape[1], heads, h // heads).transpose(0, 2, 3, 1))
        scores = matmul(q, keys)
        probs = self._probs(scores, bias, deterministic=deterministic, rngs=rngs)
        return matmul(probs, v).transpose(0, 2, 1, 3).reshape(b, nq, h)

    def _folded_attention(self, x, q, bias, *, deterministic: bool, rngs) -> jax.Array:
        """`_attention` for a few queries, without the keys and values of every position.

        A query's score against position j is q·(x_j·Wk + bk) = x_j·(Wk·q) + q·bk: each head's
        query folded into its key weights once (Wk·q, a hidden-size vector) scores the inputs
        themselves, and q·bk, the same at every position, leaves the softmax unchanged.
        Likewise Σ_j p_j·(x_j·Wv + bv) = (Σ_j p_j·x_j)·Wv + (Σ_j p_j)·bv. For the [CLS] query
        this replaces the key and value products over every position (4·length·hidden² FLOPs
        a sequence) by 4·length·hidden·heads. A LoRA adapter on the key or value is folded into
        its weight first (`Projection.effective_weight`), without its dropout: the fold reads
        the inputs, not the products a dropout would mask.
        """
        b, nq, h = q.shape
        heads, head_dim = self.num_heads, h // self.num_heads
        wk, wv = (
            d.effective_weight().astype(x.dtype).reshape(h, heads, head_dim)
            for d in (self.key, self.value)
        )
        folded = jnp.einsum("bqnd,hnd->bnqh", q.reshape(b, nq, heads, head_dim), wk)
        scores = jnp.einsum("bnqh,bkh->bnqk", folded, x)
        probs = self._probs(scores, bias, deterministic=deterministic, rngs=rngs)
        mixed = jnp.einsum("bnqk,bkh->bqnh", probs, x)
        # Dropout leaves the probabilities' sum near, not at, one.
        weight = probs.sum(-1).transpose(0, 2, 1)[..., None]
        value_bias = self.value.bias[...].astype(x.dtype).reshape(heads, head_dim)
        ctx = jnp.einsum("bqnh,hnd->bqnd", mixed, wv) + weight * value_bias
        return ctx.reshape(b, nq, h)


class BertEncoder(nnx.Module):
    """Embeddings and the stack of layers; returns the last hidden state."""

    def __init__(self, cfg: BertConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.embeddings = Embeddings(cfg, dtype, rngs)
        self.layers = nnx.List([Layer(cfg, dtype, rngs) for _ in range(cfg.num_hidden_layers)])

    def __call__(
        self,
        input_ids,
        attention_mask,
        *,
        positions=None,
        starts=None,
        cls_only: bool = False,
        deterministic: bool = True,
        rngs=None,
    ) -> jax.Array:
        """Last hidden state [batch, length, hidden]; [batch, 1, hidden] when `cls_only`.

        With `cls_only` the last layer computes its attention and feed-forward for the [CLS]
        position alone, the only one a sequence classifier reads, without every position's keys
        and values (`Layer._folded_attention`): the same result, fewer FLOPs.

        Packed rows (several sequences a row): `attention_mask` holds each token's sequence
        (1, 2, ..., 0 for padding), `positions` each token's position in its own sequence and
        `starts` [batch, n] where each sequence's [CLS] is; a token attends to its own sequence
        alone, and with `cls_only` the result is [batch, n, hidden], one [CLS] state a sequence.
        """
        x = self.embeddings(input_ids, positions=positions, deterministic=deterministic, rngs=rngs)
        lowest = jnp.finfo(jnp.float32).min
        if starts is None or starts.shape[1] == 1:
            # Additive mask as in transformers: the dtype's minimum on padded keys (with one
            # sequence a row, its segment ids are this mask).
            bias = (1.0 - attention_mask[:, None, None, :].astype(jnp.float32)) * lowest
            cls_bias, cls_queries = bias, (1 if starts is None else starts)
        else:
            keys = attention_mask[:, None, :]
            same = (attention_mask[:, :, None] == keys) & (keys > 0)
            bias = jnp.where(same, 0.0, lowest)[:, None]  # [batch, 1, query, key]
            cls_bias = jnp.take_along_axis(bias, starts[:, None, :, None], axis=2)
            cls_queries = starts
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = constrain(x, "batch", None, None)
            if cls_only and i == last:
                x = layer(x, cls_bias, queries=cls_queries, deterministic=deterministic, rngs=rngs)
            else:
                x = layer(x, bias, queries=None, deterministic=deterministic, rngs=rngs)
        return x


class BertClassifier(nnx.Module):
    """BertForSequenceClassification: encoder, tanh pooler over [CLS], dropout, linear head."""

    task = "classification"
    #: The word-embedding table's path in the parameters: only looked up, so its gradient
    #: has rows at the batch's tokens alone (exchanged as such, `steps.make_train_step`).
    sparse_embedding = "['bert']['embeddings']['word']['embedding']"

    def __init__(self, cfg: BertConfig, num_labels: int, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.config = cfg
        self.num_labels = num_labels
        self.dtype = dtype
        self.bert = BertEncoder(cfg, dtype, rngs=rngs)
        self.pooler = _dense(cfg.hidden_size, cfg.hidden_size, cfg, dtype, rngs)
        drop = cfg.classifier_dropout
        self.dropout = Dropout(cfg.hidden_dropout_prob if drop is None else drop)
        self.classifier = _dense(cfg.hidden_size, num_labels, cfg, dtype, rngs)

    def init_fresh(self, names: list[str], rngs: nnx.Rngs) -> None:
        """Initialise the parts a checkpoint did not provide ("pooler.dense", "classifier")."""
        h = self.config.hidden_size
        if "pooler.dense" in names:
            self.pooler = _dense(h, h, self.config, self.dtype, rngs)
        if "classifier" in names:
            self.classifier = _dense(h, self.num_labels, self.config, self.dtype, rngs)

    def __call__(
        self,
        input_ids,
        attention_mask,
        *,
        positions=None,
        starts=None,
        deterministic: bool = True,
        rngs=None,
    ):
        """Logits [batch, num_labels], in float32; for packed rows (`BertEncoder`), [batch, n,
        num_labels], a sequence's in its slot of `starts`."""
        hidden = self.bert(
            input_ids,
            attention_mask,
            positions=positions,
            starts=starts,
            cls_only=True,
            deterministic=deterministic,
            rngs=rngs,
        )
        pooled = jnp.tanh(self.pooler(hidden[:, 0] if starts is None else hidden))
        pooled = self.dropout(pooled, deterministic=deterministic, rngs=rngs)
        return self.classifier(pooled).astype(jnp.float32)
