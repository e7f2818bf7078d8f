"""Selection over the last axis: top-k (routing) and argmax (greedy sampling)."""

from __future__ import annotations

from mkdsl.lang.dtypes import F32, I32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.registry import (
    REQUIRED,
    Cost,
    OpDef,
    OpError,
    expect_float,
    expect_rank,
    register,
)


def _topk_infer(args, attrs):
    (x,) = args
    expect_rank(x, 2, 0, "the scores")
    expect_float(x, 0)
    k = attrs["k"]
    n = x.type.shape[1]
    if not isinstance(k, int) or k < 1 or (isinstance(n, int) and k > n):
        raise OpError(f"k must be an integer in 1..{n}, got {k}", "k")
    b = x.type.shape[0]
    return TensorType(F32, (b, k)), TensorType(I32, (b, k))


def topk(x, k):
    """The k largest values per row, descending; ties go to the lower index."""
    values, indices = jax.lax.top_k(x.astype(jnp.float32), k)
    return values, indices.astype(jnp.int32)


def _topk_runner_up(row: int, margin: float, flipped: list):
    """A `topk` reference that gives `row`'s k-th choice to the runner-up, once, where the two
    are closer than `margin` times the k-th value (relative: a softmax's values are ~1/E; a near
    tie rounding may tip, mkdsl/verify/); appends to `flipped` when it did."""

    def chosen(x, k):
        values, ids = topk(x, k + 1)
        if flipped or float(values[row, k - 1] - values[row, k]) >= margin * abs(float(values[row, k - 1])):
            return values[:, :k], ids[:, :k]
        flipped.append(True)
        return values[:, :k].at[row, k - 1].set(values[row, k]), ids[:, :k].at[row, k - 1].set(ids[row, k])

    return chosen


register(
    OpDef(
        "topk",
        ("x",),
        _topk_infer,
        topk,
        lambda ins, outs, a: Cost(flops=ins[0].shape[0] * ins[0].shape[1] * a["k"]),
        attrs={"k": REQUIRED},
        outputs=2,
        doc="(values, indices) of the k largest entries of each row; ties to the lower index.",
        shard="whole",
        near_tie=_topk_runner_up,
    )
)


def _argmax_infer(args, attrs):
    (x,) = args
    expect_rank(x, 2, 0, "the logits")
    expect_float(x, 0)
    return (TensorType(I32, (x.type.shape[0],)),)


def _argmax(x):
    """The first largest logit; a NaN logit is never chosen (it counts as -inf), the rule of the
    kernel's argmax and of `sample_tokens` (all NaN: token 0)."""
    x = x.astype(jnp.float32)
    return (jnp.argmax(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=-1).astype(jnp.int32),)


def _argmax_spmd(rows, arrays, attrs):
    """The argmax over the whole vocabulary: every device gathers the split logits."""
    if not attrs.get("shard_axes"):
        return None
    axes = tuple(attrs["shard_axes"])
    return _argmax(jax.lax.all_gather(arrays[0], axes, axis=arrays[0].ndim - 1, tiled=True))


register(
    OpDef(
        "argmax",
        ("x",),
        _argmax_infer,
        _argmax,
        lambda ins, outs, a: Cost(flops=ins[0].shape[0] * ins[0].shape[1]),
        doc="Index of each row's largest entry (the first on ties): greedy next token.",
        shard="pick",
        exchange="best",
        exchange_axes="shard_axes",
        spmd_prefill=_argmax_spmd,
    )
)
