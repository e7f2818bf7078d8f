"""Routing steps that compose with `topk` (mkdsl/ops/select.py) into any published MoE router.

Qwen3: `p, ids = topk(softmax(linear(h, router)), k=8)` and `p / rowsum(p)`; gpt-oss: `topk`
of the logits plus the router bias, then `softmax` of the chosen ones; DeepSeek-V3: `group_topk`
of the sigmoid scores plus the correction bias selects, `take` reads the unbiased scores at the
chosen ids, and `w / rowsum(w) * 2.5` renormalises and scales them.
"""

from __future__ import annotations

from mkdsl.lang.dtypes import F32, I32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.registry import REQUIRED, Cost, OpDef, OpError, expect_dtype, expect_float, expect_rank, register
from mkdsl.ops.select import topk


def _group_topk_infer(args, attrs):
    (x,) = args
    expect_rank(x, 2, 0, "the selection scores")
    expect_float(x, 0)
    b, n = x.type.shape
    groups, keep, k = attrs["groups"], attrs["topk_groups"], attrs["k"]
    if not isinstance(groups, int) or groups < 1 or (isinstance(n, int) and n % groups):
        raise OpError(f"groups must divide the {n} experts, got {groups}", "groups")
    if not isinstance(keep, int) or not 1 <= keep <= groups:
        raise OpError(f"topk_groups must be an integer in 1..{groups}, got {keep}", "topk_groups")
    size = n // groups if isinstance(n, int) else None
    if size is not None and size < 2:
        raise OpError(f"each group needs at least 2 experts (its score is the sum of its top 2), got {size}", "groups")
    if not isinstance(k, int) or k < 1 or (size is not None and k > keep * size):
        raise OpError(f"k must be an integer in 1..{keep * (size or 1)} (the experts of the kept groups), got {k}", "k")
    return TensorType(F32, (b, k)), TensorType(I32, (b, k))


def group_topk(x, k, groups, topk_groups):
    """Top k of x among the `topk_groups` groups (of `groups` equal column groups) with the
    largest sum of their two best entries; group ties to the lower group, entry ties to the
    lower index. The other groups' entries are never chosen."""
    x = x.astype(jnp.float32)
    b, n = x.shape
    top2 = jax.lax.top_k(x.reshape(b, groups, n // groups), 2)[0].sum(-1)
    _, kept = jax.lax.top_k(top2, topk_groups)
    mask = jnp.zeros((b, groups), bool).at[jnp.arange(b)[:, None], kept].set(True)
    masked = jnp.where(jnp.repeat(mask, n // groups, axis=1), x, -jnp.inf)
    return topk(masked, k)


register(
    OpDef(
        "group_topk",
        ("x",),
        _group_topk_infer,
        group_topk,
        lambda ins, outs, a: Cost(flops=ins[0].shape[0] * ins[0].shape[1] * (a["k"] + 3)),
        attrs={"k": REQUIRED, "groups": REQUIRED, "topk_groups": REQUIRED},
        outputs=2,
        doc="(values, indices): top-k within the topk_groups groups whose two best entries sum highest.",
        shard="whole",
    )
)


def _take_infer(args, attrs):
    x, ids = args
    expect_rank(x, 2, 0, "the scores")
    expect_float(x, 0)
    expect_rank(ids, 2, 1, "the ids")
    expect_dtype(ids, ("i32",), 1)
    if ids.type.shape[0] != x.type.shape[0]:
        raise OpError(f"`{ids.name}` has {ids.type.shape[0]} rows, `{x.name}` has {x.type.shape[0]}", 1)
    return (TensorType(F32, ids.type.shape),)


register(
    OpDef(
        "take",
        ("x", "ids"),
        _take_infer,
        lambda x, ids: (jnp.take_along_axis(x.astype(jnp.float32), ids, axis=-1),),
        lambda ins, outs, a: Cost(flops=ins[0].shape[0] * ins[0].shape[1] * ins[1].shape[1]),
        doc="x[b, ids[b, i]] per row: the weight scores at the experts another score selected.",
        shard="whole",
    )
)
