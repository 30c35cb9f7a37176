"""A language model's log-probabilities of given tokens through its vocabulary head, computed a
vocabulary chunk at a time: no [batch, tokens, vocabulary] float32 array is ever whole, in the
forward pass or the backward.

The head's logits of every token were the largest arrays of a causal-LM step: Qwen2.5-0.5B at
4 × 2,048 tokens through its 151,936 words holds 5 GB of float32 logits, and with their softmax
and gradient the step's 16.88 GiB of temporaries did not fit a 16 GiB TPU v5e in one batch
(bench/tpu-results.md, "lm-every-token"). Here the forward pass runs over chunks of the
vocabulary with an online log-sum-exp (as flash attention runs over keys), keeping per token
only the running maximum, sum, target logit and best word; the backward pass (a custom VJP)
computes each chunk's logits again from the hidden states and the head's rows, and with them
that chunk's share of both gradients. (MaxText's vocabulary tiling and Liger's fused linear
cross-entropy chunk the tokens instead; then every chunk adds a gradient of the whole
[vocabulary, hidden] table, which is 18 times the hidden states' size for that Qwen batch and
costs its read and write each chunk. Chunking the vocabulary gives each chunk's table gradient
its own rows and adds only into the hidden states' gradient, kept in float32.)

Chunks take every `n`-th word (chunk j: words j, n + j, 2n + j, ...), so that a table sharded by
rows over the mesh's `tensor` axis (the `vocab` rule, `kubejax.models.partitioning`) stays
sharded the same way in every chunk: the loop gathers nothing.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from kubejax.models.kernels import product
from kubejax.models.partitioning import constrain, ways

#: Most bytes of one chunk's float32 logits on one device. The backward pass holds about three
#: such arrays at once (the logits, their probabilities, their gradient), so ~0.75 GiB at the
#: peak, against 5 GB for each whole array of the Qwen2.5-0.5B batch above; and a chunk is wide
#: enough that adding its product into the hidden states' float32 gradient is cheap beside the
#: product itself (at 4 × 2,048 tokens: 8,064 words a chunk, 19 chunks; a v5e reads and writes
#: that gradient in ~1 % of the product's time).
CHUNK_BYTES = 2**28
#: A TPU's vector lanes: chunks of several are as wide as a multiple of this.
LANES = 128


def chunk_columns(rows: int, tokens: int, vocab: int) -> int:
    """Words a chunk for `rows` × `tokens` hidden states over `vocab` words: the fewest chunks
    whose float32 logits stay within `CHUNK_BYTES` on each device of the trace's mesh (its
    batch and vocabulary shards, `partitioning.ways`), as even as lanes allow."""
    split = ways("vocab", vocab)
    per_device = max(1, rows // ways("batch", rows) * tokens)
    most = max(LANES, CHUNK_BYTES // (4 * per_device)) * split
    n = -(-vocab // most)
    align = split * (LANES if n > 1 else 1)
    even = -(-vocab // n)
    return -(-even // align) * align


def log_probs(
    hidden: jax.Array,
    table: jax.Array,
    targets: jax.Array,
    softcap: float | None = None,
    columns: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each target's log-probability [batch, tokens] (float32) under the head `table` (its
    weights [vocab, hidden], a row a word, as a tied embedding holds them) of `hidden` [batch,
    tokens, hidden], and whether the target is the most likely word (ties: the lowest id, as
    `argmax`). The logits are `hidden @ table.T` in the hidden states' dtype summed in float32
    (`kernels.product`), then `softcap · tanh(logits / softcap)` where set (Gemma 2's
    `final_logit_softcapping`). `columns`: words a chunk (default `chunk_columns`).

    Targets outside the vocabulary (a padded position's, whatever its id) give a finite score
    that the caller's weights leave out; they take no gradient from a zero weight."""
    columns = columns or chunk_columns(hidden.shape[0], hidden.shape[1], table.shape[0])
    return _log_probs(softcap, columns, hidden, table, targets)


def _chunks(table: jax.Array, columns: int, dtype) -> jax.Array:
    """The table's rows as [chunks, columns, hidden] in the compute dtype, chunk j holding
    words j, n + j, ...; padded with zero rows to chunks × columns."""
    vocab, size = table.shape
    n = -(-vocab // columns)
    padded = jnp.pad(table.astype(dtype), ((0, n * columns - vocab), (0, 0)))
    return constrain(padded.reshape(columns, n, size).swapaxes(0, 1), None, "vocab", None)


def _logits(softcap, vocab: int, n: int, hidden, rows, j):
    """Chunk j's logits [batch, tokens, columns] (float32, padding at -inf), their values
    before the soft cap, and the chunk's word ids [columns]."""
    raw = product(hidden, rows.T).astype(jnp.float32)
    z = raw if softcap is None else jnp.tanh(raw / softcap) * softcap
    ids = jnp.arange(rows.shape[0]) * n + j
    z = jnp.where(ids < vocab, z, -jnp.inf)
    return constrain(z, "batch", None, "vocab"), raw, ids


def _loop(body, carry, xs, n: int):
    """`jax.lax.scan(body, carry, xs)`, or body's one call where there is one chunk."""
    if n > 1:
        return jax.lax.scan(body, carry, xs)
    carry, y = body(carry, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda x: x[None], y)


def _forward(softcap, columns, hidden, table, targets):
    """(log-probabilities, most likely) and the log-sum-exp [batch, tokens] of every token."""
    vocab = table.shape[0]
    chunks = _chunks(table, columns, hidden.dtype)
    n = chunks.shape[0]
    hidden = constrain(hidden, "batch", None, None)
    shape = targets.shape

    def body(carry, xs):
        top, total, picked, best, best_id = carry
        rows, j = xs
        z, _, ids = _logits(softcap, vocab, n, hidden, rows, j)
        chunk_top = z.max(-1)
        new_top = jnp.maximum(top, chunk_top)
        total = total * jnp.exp(top - new_top) + jnp.exp(z - new_top[..., None]).sum(-1)
        picked = picked + jnp.where(ids == targets[..., None], z, 0.0).sum(-1)
        chunk_id = jnp.argmax(z, -1).astype(jnp.int32) * n + j
        better = (chunk_top > best) | ((chunk_top == best) & (chunk_id < best_id))
        best, best_id = jnp.where(better, chunk_top, best), jnp.where(better, chunk_id, best_id)
        return (new_top, total, picked, best, best_id), None

    start = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.int32),
    )
    (top, total, picked, _, best_id), _ = _loop(body, start, (chunks, jnp.arange(n)), n)
    lse = top + jnp.log(total)
    return (picked - lse, best_id == targets), lse


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _log_probs(softcap, columns, hidden, table, targets):
    return _forward(softcap, columns, hidden, table, targets)[0]


def _log_probs_fwd(softcap, columns, hidden, table, targets):
    out, lse = _forward(softcap, columns, hidden.value, table.value, targets.value)
    # Which gradients the backward pass computes: a frozen table (LoRA's base, a tied
    # embedding that does not train) takes none, a third of the head's backward work.
    wanted = (() if hidden.perturbed else None, () if table.perturbed else None)
    return out, (hidden.value, table.value, targets.value, lse, wanted)


def _log_probs_bwd(softcap, columns, residuals, cotangents):
    hidden, table, targets, lse, (want_hidden, want_table) = residuals
    g = cotangents[0]  # the most likely word's flags take none
    if isinstance(g, SymbolicZero):
        g = jnp.zeros(targets.shape, jnp.float32)
    vocab, size = table.shape
    chunks = _chunks(table, columns, hidden.dtype)
    n = chunks.shape[0]
    hidden = constrain(hidden, "batch", None, None)

    def body(d_hidden, xs):
        rows, j = xs
        z, raw, ids = _logits(softcap, vocab, n, hidden, rows, j)
        p = jnp.where(ids < vocab, jnp.exp(z - lse[..., None]), 0.0)
        dz = g[..., None] * ((ids == targets[..., None]).astype(jnp.float32) - p)
        if softcap is not None:
            dz = dz * (1.0 - jnp.square(jnp.tanh(raw / softcap)))
        dz = constrain(dz.astype(hidden.dtype), "batch", None, "vocab")
        if want_hidden is not None:
            d_hidden = d_hidden + jnp.matmul(dz, rows, preferred_element_type=jnp.float32)
        d_rows = None
        if want_table is not None:
            d_rows = jnp.einsum("btc,bth->ch", dz, hidden, preferred_element_type=jnp.float32)
            d_rows = constrain(d_rows.astype(table.dtype), "vocab", None)
        return d_hidden, d_rows

    start = jnp.zeros(hidden.shape if want_hidden is not None else (), jnp.float32)
    d_hidden, d_rows = _loop(body, start, (chunks, jnp.arange(n)), n)
    d_table = None
    if want_table is not None:
        d_table = d_rows.swapaxes(0, 1).reshape(n * columns, size)[:vocab]
    d_hidden = None if want_hidden is None else d_hidden.astype(hidden.dtype)
    return d_hidden, d_table, None


_log_probs.defvjp(_log_probs_fwd, _log_probs_bwd, symbolic_zeros=True)


def whole_log_probs(hidden, table, targets, softcap=None) -> tuple[jax.Array, jax.Array]:
    """`log_probs` with the whole [batch, tokens, vocab] logits at once: what the chunks must
    equal (the tests), and plain autodiff's memory to compare with."""
    logits = product(hidden, table.astype(hidden.dtype).T).astype(jnp.float32)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logp = jax.nn.log_softmax(logits, -1)
    picked = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return picked, jnp.argmax(logits, -1) == targets
