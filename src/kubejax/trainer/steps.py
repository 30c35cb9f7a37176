"""The compiled steps: the loss, one optimizer step (with gradient accumulation inside), and one
evaluation step. Training, evaluation and the served model all use these."""

from __future__ import annotations

import math
from functools import partial, wraps

import jax
import jax.flatten_util
import jax.numpy as jnp
import optax
from flax import nnx

from kubejax.models.kernels import matrices_in
from kubejax.trainer import distributed


def loss_fn(graphdef, params, batch, key, deterministic: bool, frozen=None, totals=None):
    """Cross-entropy with the accuracy and the logits: of the labels for a classifier; of the
    answers' tokens for a language model (`targets`, read at `target_at`; logits None, never
    held whole), a review counted correct when every token of its answer is the most likely
    one. `frozen`: the parameters that do not train (LoRA's base), beside `params`.

    Rows hold one review each, or several (packed: `attention_mask` holds segment ids,
    `positions` each review's own, `weights` 1 for each review slot that holds one). Loss and
    accuracy are sums over the reviews (the answer tokens for a language model's loss) divided
    by `totals` (`step_totals`, of this batch by default): a step in pieces passes its whole
    batch's, so that its pieces' losses and gradients add up to the step's mean over reviews,
    however many each piece holds."""
    model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)
    rngs = None if deterministic else nnx.Rngs(dropout=key)
    packed = {"positions": batch["positions"]} if "weights" in batch else {}
    if "targets" in batch:
        at = batch["target_at"]
        hidden = model.hidden(
            batch["input_ids"],
            batch["attention_mask"],
            **packed,
            at=at.reshape(at.shape[0], -1),
            deterministic=deterministic,
            rngs=rngs,
        )
        # Through the head a vocabulary chunk at a time: the targets' whole logits are never
        # held (every token of a long answer, `DecoderLM.target_log_probs`).
        logp, top = model.target_log_probs(hidden, batch["targets"].reshape(at.shape[0], -1))
        w = batch["target_weights"]
        ce = -logp.reshape(at.shape)
        wrong = ~top.reshape(at.shape) & (w > 0)
        correct = 1.0 - wrong.any(-1).astype(jnp.float32)
        loss_sum = (ce * w).sum()
        logits = None
    else:
        if packed:
            packed["starts"] = batch["starts"]
        logits = model(
            batch["input_ids"],
            batch["attention_mask"],
            **packed,
            deterministic=deterministic,
            rngs=rngs,
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
        loss_sum = (ce * batch["weights"]).sum() if packed else ce.sum()
    if packed:
        correct = correct * batch["weights"]
    loss_total, reviews = step_totals(batch) if totals is None else totals
    return loss_sum / loss_total, (correct.sum() / reviews, logits)


def step_totals(batch) -> tuple[jax.Array, jax.Array]:
    """What a batch's loss and accuracy are means over: the answer tokens (a language model)
    or the reviews for the loss, and the reviews for the accuracy (a packed batch's filled
    slots, `weights`); each at least 1."""
    loss_total, reviews = _counts(batch)
    return jnp.maximum(loss_total, 1.0), jnp.maximum(reviews, 1.0)


def _counts(batch) -> tuple[jax.Array, jax.Array]:
    if "weights" in batch:
        reviews = batch["weights"].sum()
    else:
        per_review = batch["targets"].shape[:-1] if "targets" in batch else batch["labels"].shape
        reviews = jnp.asarray(math.prod(per_review), jnp.float32)
    return batch["target_weights"].sum() if "targets" in batch else reviews, reviews


#: On CPU, each device's batch goes through the model in pieces of at most this many (padded)
#: tokens: the train step sums the pieces' gradients, the evaluation step maps over them. The
#: step's temporaries shrink with the piece (MiniLM, 32 rows of 128 tokens: 1.19 GB -> 0.36 GB),
#: and the runtime maps them afresh every step, so a large block costs page faults each step;
#: the pieces' working set also stays nearer the caches. Measured on 2 cores: train step 2.06 ->
#: 1.67 s at 32 x 128 and 5.13 -> 4.33 s at 16 x 512 (smaller pieces were slower); for the
#: evaluation step the gain was within the machine's noise, the memory bound is not (64 rows of
#: 512 tokens hold 0.8 GB of attention scores a layer). bench/NOTES.md, attempt 26.
#: Accelerators take the whole batch.
CPU_PIECE_TOKENS = 1024


def piece_rows(rows: int, length: int, budget: int) -> int:
    """The most rows, dividing `rows`, whose pieces of `length` tokens fit `budget` tokens (at
    least 1); `rows` itself when `budget` is 0."""
    if budget <= 0:
        return rows
    return max(d for d in range(1, rows + 1) if rows % d == 0 and (d == 1 or d * length <= budget))


def _piece_budget(mesh) -> int:
    # On a named mesh (sharded parameters) the partitioner places the whole micro-batch; the
    # memory bound there is grad_accum_steps.
    if mesh.axis_names != (distributed.DATA_AXIS,):
        return 0
    return CPU_PIECE_TOKENS if mesh.devices.flat[0].platform == "cpu" else 0


def make_train_step(
    graphdef, tx, mesh, seed: int, sparse_embedding: str | None = None, shardings=None,
    frozen=None,
):  # fmt: skip
    """One optimizer step over a global batch [accum, micro, length] at the given learning rate;
    state is donated. `sparse_embedding`: the path of an embedding table whose gradient has
    rows only at the batch's tokens (the model's `sparse_embedding`), exchanged as those rows
    between data-parallel devices; None: every gradient exchanged whole.

    `shardings` (parameters', optimizer state's) on a named mesh (`kubejax.trainer.sharding`):
    the state stays in those shards and the partitioner (GSPMD) gathers and reduces what each
    product needs (FSDP, tensor parallelism); without, state is replicated and gradients are
    averaged over the `data` axis by hand.

    `frozen`: parameters that take no gradient and no optimizer state (LoRA's base model), an
    input of every step beside `params`."""
    rep = distributed.replicated(mesh)
    base_key = jax.random.key(seed)
    budget = _piece_budget(mesh)
    params_sh, opt_sh = shardings if shardings is not None else (rep, rep)

    @partial(jax.jit, donate_argnums=(0, 1), out_shardings=(params_sh, opt_sh, rep))
    @on_mesh(mesh if shardings is not None else None)
    def train_step(params, opt_state, batch, step, learning_rate, frozen=None):
        key = jax.random.fold_in(base_key, step)
        # Dropout masks are a deterministic function of seed, step and (data-parallel) device.
        if mesh.size == 1 or shardings is not None:
            loss, acc, grads = _gradients(graphdef, params, batch, key, budget, frozen)
        else:
            loss, acc, grads = _data_parallel_gradients(
                graphdef, mesh, params, batch, key, budget, sparse_embedding, frozen
            )
        hyperparams = {**opt_state.hyperparams, "learning_rate": learning_rate}
        opt_state = opt_state._replace(hyperparams=hyperparams)
        params, opt_state = _update(tx, params, grads, opt_state)
        metrics = {
            "loss": loss,
            "accuracy": acc,
            "grad_norm": optax.tree.norm(grads),
            # Real tokens (packed rows hold segment ids) and reviews.
            "tokens": (batch["attention_mask"] > 0).sum(),
            "examples": step_totals(batch)[1],
        }
        return params, opt_state, metrics

    return train_step if frozen is None else partial(train_step, frozen=frozen)


def on_mesh(mesh):
    """Trace the decorated function with `mesh` as the abstract mesh in context, where the
    models pin their activations (`kubejax.models.partitioning.constrain`); None: as is."""

    def wrap(fn):
        if mesh is None:
            return fn

        @wraps(fn)
        def traced(*args, **kwargs):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args, **kwargs)

        return traced

    return wrap


def _update(tx, params, grads, opt_state):
    """The optimizer's step in float32: weights held in bfloat16 (`param_dtype`) are updated
    as float32 and rounded once, their moments kept in float32 (for float32 weights the casts
    are no-ops)."""
    full = matrices_in(params, jnp.float32)
    updates, opt_state = tx.update(matrices_in(grads, jnp.float32), opt_state, full)
    new = optax.apply_updates(full, updates)
    return jax.tree.map(lambda n, p: n.astype(p.dtype), new, params), opt_state


def _data_parallel_gradients(
    graphdef, mesh, params, batch, key, budget: int, sparse_embedding, frozen=None
):
    """Each device's gradients of its share of the batch, averaged over the devices in one
    all-reduce: every dense gradient as one flat buffer, and of the word-embedding table only
    the rows of the batch's tokens.

    Left to the partitioner, the gradients went into one all-reduce of MiniLM's 105 separate
    tensors; over gloo between two CPU processes that took 0.52 s a step against 0.17 s for the
    same 91 MB as one buffer (bench/NOTES.md). The embedding table is half of those bytes
    (30,522 × 384) while a batch of 16 × 128 touches at most 2,048 of its rows. Each device
    draws its own dropout masks.
    """
    spec = jax.sharding.PartitionSpec
    axis = distributed.DATA_AXIS
    batch_spec = {k: spec(None, axis) for k in batch}

    @partial(
        jax.shard_map, mesh=mesh, in_specs=(spec(), batch_spec, spec(), spec()), out_specs=spec()
    )
    def local(params, batch, key, frozen):
        key = jax.random.fold_in(key, jax.lax.axis_index(axis))
        # Differentiate each device's own copy of the parameters: for replicated ones JAX
        # would sum the gradients across devices by itself, tensor by tensor.
        params = jax.lax.pcast(params, axis, to="varying")
        # The frozen too: the products' backward rule (`kernels.linear`) gives every kernel a
        # cotangent typed like the varying activations, unused for these.
        frozen = jax.lax.pcast(frozen, axis, to="varying")
        # Where devices' shares may hold different numbers of reviews or answer tokens (packed
        # rows, answers), the step's totals over all of them, as each device's share: the mean
        # over devices (below) of its sums divided by them is the step's mean. Rows of one
        # review each count the same on every device: each divides by its own.
        totals = None
        if "weights" in batch or "targets" in batch:
            summed = jnp.maximum(jax.lax.psum(jnp.stack(_counts(batch)), axis), 1.0)
            totals = (summed[0] / mesh.shape[axis], summed[1] / mesh.shape[axis])
        loss, acc, grads = _gradients(graphdef, params, batch, key, budget, frozen, totals)
        if sparse_embedding is None:
            return jax.lax.pmean((loss, acc, grads), axis)
        paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
        names = [jax.tree_util.keystr(path).removesuffix(".value") for path, _ in paths]
        leaves = [leaf for _, leaf in paths]
        word = names.index(sparse_embedding)
        flat, unravel = jax.flatten_util.ravel_pytree(leaves[:word] + leaves[word + 1 :])
        # Every device's token ids; each device's gradient rows at all of them, summed: the
        # table's whole gradient, since rows of tokens outside every batch are zero everywhere.
        # (Gathered by a psum of each device's ids in its own slot: the result is known to be
        # the same on every device, which all_gather's is not.)
        mine = batch["input_ids"]
        slots = jnp.zeros((mesh.size, *mine.shape), mine.dtype)
        ids = jax.lax.psum(slots.at[jax.lax.axis_index(axis)].set(mine), axis).reshape(-1)
        rows = leaves[word][ids]
        loss, acc, flat, rows = jax.lax.pmean((loss, acc, flat, rows), axis)
        dense = unravel(flat)
        table = jnp.zeros(leaves[word].shape, leaves[word].dtype).at[ids].set(rows)
        return loss, acc, treedef.unflatten([*dense[:word], table, *dense[word:]])

    return local(params, batch, key, frozen)


def _gradients(graphdef, params, batch, key, budget: int, frozen=None, totals=None):
    """Loss, accuracy and gradients of the step's mean over its reviews (`loss_fn`), from the
    micro-batches of [accum, micro, length], each micro-batch in pieces of at most `budget`
    tokens (0: whole); `frozen` takes none. `totals`: what the means divide by (`step_totals`;
    default: this batch's own)."""
    totals = step_totals(batch) if totals is None else totals
    accum, size, length = batch["input_ids"].shape
    rows = piece_rows(size, length, budget)
    accum = accum * size // rows
    batch = jax.tree.map(lambda x: x.reshape(accum, rows, *x.shape[2:]), batch)
    grad_fn = jax.value_and_grad(
        partial(loss_fn, graphdef, deterministic=False, frozen=frozen, totals=totals),
        has_aux=True,
    )
    if accum == 1:
        # No loop: a scan of one would still zero and add a copy of every gradient.
        (loss, (acc, _)), grads = grad_fn(params, jax.tree.map(lambda x: x[0], batch), key)
        return loss, acc, grads

    # Each piece's share of the step's mean: they add up. The losses and accuracies leave the
    # loop as its outputs, not in its carry: in a data-parallel step (shard_map) they vary by
    # device, which a zero carry would not.
    def micro(grads, xs):
        mb, i = xs
        (mb_loss, (mb_acc, _)), g = grad_fn(params, mb, jax.random.fold_in(key, i))
        return jax.tree.map(jnp.add, grads, g), (mb_loss, mb_acc)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (loss, acc) = jax.lax.scan(micro, zeros, (batch, jnp.arange(accum)))
    return loss.sum(), acc.sum(), grads


def make_eval_step(graphdef, mesh, frozen=None):
    """Weighted loss and accuracy sums over a global batch of packed rows
    (`dataset.packed_eval_batches`), and the logits of every review slot; `frozen` as in
    `make_train_step`."""
    rep = distributed.replicated(mesh)
    budget = _piece_budget(mesh)

    # XLA's default CPU fusions, which hand YNNPACK the reductions (LayerNorm's, softmax's)
    # and the softmax around the attention products as well: asking for the products alone
    # measured 1 % slower in float32 and 7 % in bfloat16 (bench/NOTES.md, attempt 42).
    @partial(jax.jit, out_shardings=(rep, distributed.batch_sharding(mesh)))
    @on_mesh(mesh if mesh.axis_names != (distributed.DATA_AXIS,) else None)
    def eval_step(params, batch, frozen=None):
        model = nnx.merge(graphdef, params, *([] if frozen is None else [frozen]))
        devices = mesh.size // mesh.shape.get("tensor", 1)  # those the batch is split over
        logits = _logits_in_pieces(model, batch, devices, budget)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
        w = batch["weights"]
        sums = {"loss": (ce * w).sum(), "correct": (correct * w).sum(), "count": w.sum()}
        return sums, logits

    return eval_step if frozen is None else partial(eval_step, frozen=frozen)


def _logits_in_pieces(model, batch, devices: int, budget: int):
    """The model's logits [rows, slots, labels] for a batch of packed rows
    (`dataset.packed_eval_batches`) [rows, length] sharded over `devices`, computed in pieces
    of at most `budget` tokens per device (0: whole)."""
    size, length = batch["input_ids"].shape
    pieces = size // devices // piece_rows(size // devices, length, budget)
    if "score_at" in batch:  # a language model's scores of every label's answer
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "weights")}

        def logits_of(xs):
            return model.label_scores(**xs)
    else:
        inputs = {k: batch[k] for k in ("input_ids", "segments", "positions", "starts")}

        def logits_of(xs):
            return model(
                xs["input_ids"],
                xs["segments"],
                positions=xs["positions"],
                starts=xs["starts"],
                deterministic=True,
            )

    if pieces == 1:
        return logits_of(inputs)

    def split(x):
        # Piece j holds rows j, j + pieces, ...: each device's rows stay on it in every piece.
        return x.reshape(-1, pieces, *x.shape[1:]).swapaxes(0, 1)

    logits = jax.lax.map(logits_of, jax.tree.map(split, inputs))
    return logits.swapaxes(0, 1).reshape(size, *logits.shape[2:])
