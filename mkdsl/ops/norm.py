"""Normalisation: RMSNorm (with or without a weight) and LayerNorm (with or without a bias), over
the whole row or per head."""

from __future__ import annotations

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import Node, Ref, TensorType, Value
from mkdsl.lazy import jax, jnp
from mkdsl.ops.registry import (
    Cost,
    OpDef,
    OpError,
    expect_divides,
    expect_float,
    expect_rank,
    nbytes,
    numel,
    register,
)


def _infer(args, attrs):
    x = args[0]
    expect_rank(x, 2, 0, "the input")
    expect_float(x, 0)
    heads = attrs["heads"]
    width = expect_divides(x.type.shape[1], heads, "row width per head", "heads")
    if len(args) == 1:  # weightless (Llama 4's QK norm): no offset to add to
        if attrs["offset"] != 0.0:
            raise OpError("`offset` shifts a norm weight, and this rmsnorm has none", "offset")
        return (TensorType(F32, x.type.shape),)
    w = args[1]
    expect_rank(w, 1, 1, "the norm weight")
    if w.type.shape[0] != width and (heads == 1 or w.type.shape[0] != x.type.shape[1]):
        raise OpError(
            f"norm weight `{w.name}` has {w.type.shape[0]} elements but each "
            f"{'head' if heads > 1 else 'row'} of `{x.name}` has {width}"
            + (f" (or one per channel of the row, {x.type.shape[1]})" if heads > 1 else ""),
            1,
        )
    return (TensorType(F32, x.type.shape),)


def rmsnorm(x, w, eps, heads=1, offset=0.0):
    """x·rsqrt(mean(x²)+eps)·(offset + w) in f32; with heads > 1 each head's slice is normalised
    alone, scaled by one head's weight or, with a weight as wide as the row, by each channel's own
    (Mamba2's grouped gated norm). `offset=1.0` is the `(1 + w)` form (Gemma, Qwen3-Next), whose
    weights are stored as w. `w=None` is the weightless norm (x·rsqrt(mean(x²)+eps) alone: Llama
    4's QK norm)."""
    x = x.astype(jnp.float32)
    b, n = x.shape
    xh = x.reshape(b, heads, n // heads)
    y = xh * jax.lax.rsqrt(jnp.mean(xh * xh, axis=-1, keepdims=True) + eps)
    if w is None:
        return y.reshape(b, n)
    return (y * (offset + w.astype(jnp.float32).reshape(-1 if w.shape[0] == n else 1, n // heads))).reshape(b, n)


def rmsnorm_row_split(node: Node) -> list[Node]:
    """`rmsnorm(x, w)` over whole rows as `x * rsqrt(rowsum(x * x) * (1/N) + eps) * (offset + w)`,
    so that a row split over devices is normalised by the sum of every device's squares."""
    x, w = node.inputs[0], node.opt_arg("weight")
    (out,) = node.outputs
    b, n = out.type.shape
    a = node.attr
    chain: list[Node] = []

    def step(op: str, inputs: tuple[Ref, ...], shape: tuple, name: str | None = None, **attrs) -> Ref:
        value = Value(name or f"{out.name}__{op}{len(chain)}", TensorType(F32, shape), node.span)
        chain.append(Node(op, inputs, tuple(attrs.items()), (value,), (), node.span, node.block))
        return Ref("value", value.name)

    ss = step("rowsum", (step("mul", (x, x), (b, n)),), (b, 1))
    r = step(
        "rsqrt", (step("add_scalar", (step("mul_scalar", (ss,), (b, 1), s=1.0 / n),), (b, 1), s=a["eps"]),), (b, 1)
    )
    if w is None:
        step("mul", (x, r), (b, n), name=out.name)
        return chain
    if a["offset"] != 0.0:
        w = step("add_scalar", (w,), (n,), s=a["offset"])
    step("mul", (step("mul", (x, r), (b, n)), w), (b, n), name=out.name)
    return chain


register(
    OpDef(
        "rmsnorm",
        ("x", "weight"),
        _infer,
        lambda x, w=None, eps=1e-5, heads=1, offset=0.0: (rmsnorm(x, w, eps, heads, offset),),
        lambda ins, outs, a: Cost(weight_bytes=sum(nbytes(w) for w in ins[1:]), flops=4 * numel(outs[0])),
        attrs={"eps": 1e-5, "heads": 1, "offset": 0.0},
        optional=1,
        doc="RMSNorm: x·rsqrt(mean(x²)+eps)·(offset + weight), f32 (no weight: x·rsqrt(mean(x²)+eps)); "
        "`heads=n` normalises n equal slices (the weight one slice wide, or one per channel of the row).",
        shard="norm",
        row_split=lambda node: rmsnorm_row_split(node) if node.attr["heads"] == 1 else None,
    )
)


def _layernorm_infer(args, attrs):
    x, w = args[:2]
    expect_rank(x, 2, 0, "the input")
    expect_float(x, 0)
    width = expect_divides(x.type.shape[1], attrs["heads"], "row width per head", "heads")
    for i, t in enumerate(args[1:], 1):
        what = "norm weight" if i == 1 else "norm bias"
        expect_rank(t, 1, i, f"the {what}")
        if t.type.shape[0] != width:
            raise OpError(
                f"{what} `{t.name}` has {t.type.shape[0]} elements but each slice of `{x.name}` has {width}", i
            )
    return (TensorType(F32, x.type.shape),)


def layernorm(x, w, b=None, *, eps, heads=1):
    """(x - mean(x))·rsqrt(var(x) + eps)·w + b in f32 (the biased variance, mean((x - mean)²), as
    torch's LayerNorm); with heads > 1 each head's slice alone; `b=None` is LayerNorm without bias."""
    x = x.astype(jnp.float32)
    rows, n = x.shape
    xh = x.reshape(rows, heads, n // heads)
    c = xh - jnp.mean(xh, axis=-1, keepdims=True)
    y = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)
    return (y if b is None else y + b.astype(jnp.float32)).reshape(rows, n)


register(
    OpDef(
        "layernorm",
        ("x", "weight", "bias"),
        _layernorm_infer,
        lambda x, w, b=None, eps=1e-5, heads=1: (layernorm(x, w, b, eps=eps, heads=heads),),
        lambda ins, outs, a: Cost(weight_bytes=sum(nbytes(t) for t in ins[1:]), flops=7 * numel(outs[0])),
        attrs={"eps": 1e-5, "heads": 1},
        optional=1,
        doc="LayerNorm: (x - mean)·rsqrt(var + eps)·weight (+ bias), f32; `heads=n` normalises n equal slices.",
        shard="norm",
    )
)
