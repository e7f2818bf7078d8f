"""Elementwise ops on activations: residual add, gates and activations, soft-cap, softmax."""

from __future__ import annotations

from mkdsl.dtypes import F32
from mkdsl.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.registry import (
    REQUIRED,
    Cost,
    OpDef,
    OpError,
    expect_float,
    numel,
    register,
)


def _same_shape(args, attrs):
    a, b = args
    expect_float(a, 0)
    expect_float(b, 1)
    if a.type.shape != b.type.shape:
        raise OpError(f"operand shapes differ: `{a.name}` is {a.type}, `{b.name}` is {b.type}", 1)
    return (TensorType(F32, a.type.shape),)


def _unary(args, attrs):
    expect_float(args[0], 0)
    return (TensorType(F32, args[0].type.shape),)


def _cost(flops_per_elem: int):
    def cost(ins, outs, attrs):
        return Cost(flops=flops_per_elem * numel(outs[0]))

    return cost


def situ(g, u, beta=4.0, linear_beta=25.0):
    """SiTU gated activation: beta·tanh(g/beta)·sigmoid(g) · lb·tanh(u/lb)."""
    g = g.astype(jnp.float32)
    u = u.astype(jnp.float32)
    return beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (linear_beta * jnp.tanh(u / linear_beta))


register(
    OpDef(
        "add",
        ("a", "b"),
        _same_shape,
        lambda a, b: (a.astype(jnp.float32) + b.astype(jnp.float32),),
        _cost(1),
        doc="a + b in f32 (the `+` operator).",
        kernel_expr="{a} + {b}",
        shard="sum",
    )
)

register(
    OpDef(
        "mul",
        ("a", "b"),
        _same_shape,
        lambda a, b: (a.astype(jnp.float32) * b.astype(jnp.float32),),
        _cost(1),
        doc="a * b in f32 (the `*` operator).",
        kernel_expr="{a} * {b}",
        shard="elementwise",
    )
)

register(
    OpDef(
        "sigmoid",
        ("x",),
        _unary,
        lambda x: (jax.nn.sigmoid(x.astype(jnp.float32)),),
        _cost(4),
        doc="Logistic sigmoid in f32.",
        kernel_expr="jax.nn.sigmoid({x})",
        shard="elementwise",
    )
)

register(
    OpDef(
        "silu",
        ("x",),
        _unary,
        lambda x: (jax.nn.silu(x.astype(jnp.float32)),),
        _cost(5),
        doc="x·sigmoid(x) in f32.",
        kernel_expr="jax.nn.silu({x})",
        shard="elementwise",
    )
)

register(
    OpDef(
        "swiglu",
        ("gate", "up"),
        _same_shape,
        lambda g, u: (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32),),
        _cost(6),
        doc="silu(gate)·up: the SwiGLU MLP's activation.",
        kernel_expr="jax.nn.silu({gate}) * {up}",
        shard="elementwise",
    )
)

register(
    OpDef(
        "situ",
        ("gate", "up"),
        _same_shape,
        lambda g, u, beta, linear_beta: (situ(g, u, beta, linear_beta),),
        _cost(12),
        attrs={"beta": 4.0, "linear_beta": 25.0},
        doc="SiTU: beta·tanh(gate/beta)·sigmoid(gate) · linear_beta·tanh(up/linear_beta).",
        kernel_expr="situ({gate}, {up}, {beta}, {linear_beta})",
        shard="elementwise",
    )
)

register(
    OpDef(
        "softcap",
        ("x",),
        _unary,
        lambda x, cap: (cap * jnp.tanh(x.astype(jnp.float32) / cap),),
        _cost(3),
        attrs={"cap": REQUIRED},
        doc="Logit soft-cap: cap·tanh(x/cap).",
        kernel_expr="{cap} * jnp.tanh({x} / {cap})",
        shard="elementwise",
    )
)

register(
    OpDef(
        "softmax",
        ("x",),
        _unary,
        lambda x: (jax.nn.softmax(x.astype(jnp.float32), axis=-1),),
        _cost(5),
        doc="Softmax over the last axis, in f32.",
        kernel_expr="jax.nn.softmax({x}, axis=-1)",
        shard="whole",
    )
)
