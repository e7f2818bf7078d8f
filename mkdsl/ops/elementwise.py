"""Elementwise ops on activations: arithmetic with broadcasting, scalar forms of the operators,
activations, soft-cap, softmax; an integer per-row input as an f32 scalar (`to_f32`).

Binary arithmetic broadcasts in three explicit ways only (see `broadcast_shape`); per-head
scalars are widened first with `repeat`, so every broadcast a spec makes is visible in it.
"""

from __future__ import annotations

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.registry import (
    REQUIRED,
    Cost,
    OpDef,
    OpError,
    expect_dtype,
    expect_float,
    expect_rank,
    numel,
    register,
)

BROADCASTS = "operands broadcast as equal shapes, [B, N] with [N] (per column) or [B, N] with [B, 1] (per row)"


def _same_shape(args, attrs):
    a, b = args
    expect_float(a, 0)
    expect_float(b, 1)
    if a.type.shape != b.type.shape:
        raise OpError(f"operand shapes differ: `{a.name}` is {a.type}, `{b.name}` is {b.type}", 1)
    return (TensorType(F32, a.type.shape),)


def broadcast_shape(sa: tuple, sb: tuple) -> tuple | None:
    """The result shape of a broadcasting binary op, or None: equal shapes, a `[B, N]` with a
    per-column `[N]`, or a `[B, N]` with a per-row `[B, 1]` (either side)."""
    if sa == sb:
        return sa
    for full, other in ((sa, sb), (sb, sa)):
        if len(full) == 2 and (other == (full[1],) or other == (full[0], 1)):
            return full
    return None


def _broadcast(args, attrs):
    a, b = args
    expect_float(a, 0)
    expect_float(b, 1)
    shape = broadcast_shape(a.type.shape, b.type.shape)
    if shape is None:
        blame = 1 if len(b.type.shape) <= len(a.type.shape) else 0
        raise OpError(
            f"operand shapes do not broadcast: `{a.name}` is {a.type}, `{b.name}` is {b.type}",
            blame,
            BROADCASTS + "; widen per-head scalars with `repeat(s, each=D)`",
        )
    return (TensorType(F32, shape),)


def _unary(args, attrs):
    expect_float(args[0], 0)
    return (TensorType(F32, args[0].type.shape),)


def _scalar(args, attrs):
    s = attrs["s"]
    if isinstance(s, bool):
        raise OpError("a tensor combines with numbers, not true/false", "s")
    return _unary(args, attrs)


def _divisor(args, attrs):
    if attrs["s"] == 0:
        raise OpError("division by zero", "s")
    return _scalar(args, attrs)


def _clamp(args, attrs):
    if attrs["lo"] is None and attrs["hi"] is None:
        raise OpError("clamp needs `lo=`, `hi=` or both", None)
    if attrs["lo"] is not None and attrs["hi"] is not None and attrs["lo"] > attrs["hi"]:
        raise OpError(f"clamp's `lo` ({attrs['lo']}) is above its `hi` ({attrs['hi']})", "lo")
    return _unary(args, attrs)


def _repeat(args, attrs):
    """[B, NH] per-row per-head scalars, or a declared per-head weight [NH]: each column `each` times."""
    (s,) = args
    expect_float(s, 0)
    if not (len(s.type.shape) == 1 and s.kind == "tensor" and not s.is_state):  # else a weight [NH]
        expect_rank(s, 2, 0, "repeat's operand ([B, heads], or a declared weight [heads])")
    each = attrs["each"]
    if not isinstance(each, int) or isinstance(each, bool) or each < 1:
        raise OpError(f"`each` must be an integer of at least 1, got {each!r}", "each")
    n = s.type.shape[-1]
    return (TensorType(F32, (*s.type.shape[:-1], n * each if isinstance(n, int) else n)),)


def _rowsum(args, attrs):
    (x,) = args
    expect_float(x, 0)
    expect_rank(x, 2, 0, "rowsum's operand")
    return (TensorType(F32, (x.type.shape[0], 1)),)


def _cost(flops_per_elem: int):
    def cost(ins, outs, attrs):
        return Cost(flops=flops_per_elem * numel(outs[0]))

    return cost


def _f(x):
    return x.astype(jnp.float32)


def situ(g, u, beta=4.0, linear_beta=25.0):
    """SiTU gated activation: beta·tanh(g/beta)·sigmoid(g) · lb·tanh(u/lb)."""
    g = g.astype(jnp.float32)
    u = u.astype(jnp.float32)
    return beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (linear_beta * jnp.tanh(u / linear_beta))


def softplus(x):
    """log(1 + e^x), in the form that neither overflows nor loses small results."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def gelu_erf(x):
    return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def clamp(x, lo, hi):
    return jnp.clip(x, lo, hi)  # a bound of None is no bound


def _binary(name, fn, kernel, flops, doc, shard, broadcasts=True):
    register(
        OpDef(
            name,
            ("a", "b"),
            _broadcast if broadcasts else _same_shape,
            lambda a, b: (fn(_f(a), _f(b)),),
            _cost(flops),
            doc=doc,
            kernel_expr=kernel,
            shard=shard,
        )
    )


def _unary_op(name, fn, kernel, flops, doc, attrs=None, infer=_unary, shard="elementwise", internal=False):
    register(
        OpDef(
            name,
            ("x",),
            infer,
            lambda x, **a: (fn(_f(x), **a),),
            _cost(flops),
            attrs=attrs or {},
            doc=doc,
            kernel_expr=kernel,
            shard=shard,
            internal=internal,
        )
    )


# ---------------------------------------------------------------- arithmetic (the operators)
_binary(
    "add", lambda a, b: jnp.add(a, b), "{a} + {b}", 1, "a + b in f32 (the `+` operator), broadcasting.", "broadcast_sum"
)
_binary(
    "sub",
    lambda a, b: jnp.subtract(a, b),
    "{a} - {b}",
    1,
    "a - b in f32 (the `-` operator), broadcasting.",
    "broadcast_sum",
)
_binary(
    "mul",
    lambda a, b: jnp.multiply(a, b),
    "{a} * {b}",
    1,
    "a * b in f32 (the `*` operator), broadcasting.",
    "broadcast",
)
_binary(
    "div", lambda a, b: jnp.divide(a, b), "{a} / {b}", 1, "a / b in f32 (the `/` operator), broadcasting.", "broadcast"
)
_binary(
    "minimum",
    lambda a, b: jnp.minimum(a, b),
    "jnp.minimum({a}, {b})",
    1,
    "Elementwise minimum, broadcasting.",
    "broadcast",
)
_binary(
    "maximum",
    lambda a, b: jnp.maximum(a, b),
    "jnp.maximum({a}, {b})",
    1,
    "Elementwise maximum, broadcasting.",
    "broadcast",
)

# A tensor with a scalar: `x * 2.5`, `1.0 + w`, `x - EPS`, `-x`. The scalar is the attribute `s`,
# folded at compile time (a float literal in the kernel); the elaborator picks the op from the
# operator and the side the scalar is on. Scaling keeps partial sums partial ("sum"); adding does not.
_S = {"s": REQUIRED}
_unary_op(
    "add_scalar",
    lambda x, s: x + s,
    "{x} + ({s})",
    1,
    "x + s (`x + 2.0`, `2.0 + x`).",
    _S,
    infer=_scalar,
    internal=True,
)
_unary_op("sub_scalar", lambda x, s: x - s, "{x} - ({s})", 1, "x - s (`x - 2.0`).", _S, infer=_scalar, internal=True)
_unary_op("rsub_scalar", lambda x, s: s - x, "({s}) - {x}", 1, "s - x (`1.0 - x`).", _S, infer=_scalar, internal=True)
_unary_op(
    "mul_scalar",
    lambda x, s: x * s,
    "{x} * ({s})",
    1,
    "x * s (`x * 2.5`, `2.5 * x`).",
    _S,
    infer=_scalar,
    shard="sum",
    internal=True,
)
_unary_op(
    "div_scalar",
    lambda x, s: x / s,
    "{x} / ({s})",
    1,
    "x / s (`x / 2.0`).",
    _S,
    infer=_divisor,
    shard="sum",
    internal=True,
)
_unary_op("rdiv_scalar", lambda x, s: s / x, "({s}) / {x}", 1, "s / x (`1.0 / x`).", _S, infer=_scalar, internal=True)
_unary_op("pow_scalar", lambda x, s: x**s, "{x} ** ({s})", 2, "x ** s (`x ** 2`).", _S, infer=_scalar, internal=True)
_unary_op(
    "minimum_scalar",
    lambda x, s: jnp.minimum(x, s),
    "jnp.minimum({x}, {s})",
    1,
    "minimum(x, s).",
    _S,
    infer=_scalar,
    internal=True,
)
_unary_op(
    "maximum_scalar",
    lambda x, s: jnp.maximum(x, s),
    "jnp.maximum({x}, {s})",
    1,
    "maximum(x, s).",
    _S,
    infer=_scalar,
    internal=True,
)

# ---------------------------------------------------------------- unary math
_unary_op("neg", lambda x: jnp.negative(x), "-{x}", 1, "-x (the prefix `-`).", shard="sum")
_unary_op("abs", lambda x: jnp.abs(x), "jnp.abs({x})", 1, "|x|.")
_unary_op("square", lambda x: jnp.square(x), "{x} * {x}", 1, "x * x.")
_unary_op("exp", lambda x: jnp.exp(x), "jnp.exp({x})", 4, "e^x.")
_unary_op("log", lambda x: jnp.log(x), "jnp.log({x})", 4, "Natural logarithm (-inf at 0, NaN below).")
_unary_op("floor", lambda x: jnp.floor(x), "jnp.floor({x})", 1, "The largest integer <= x, as f32.")
_unary_op("sqrt", lambda x: jnp.sqrt(x), "jnp.sqrt({x})", 4, "Square root.")
_unary_op("rsqrt", lambda x: jax.lax.rsqrt(x), "jax.lax.rsqrt({x})", 4, "1 / sqrt(x).")
_unary_op("tanh", lambda x: jnp.tanh(x), "jnp.tanh({x})", 4, "Hyperbolic tangent.")
_unary_op("relu", lambda x: jnp.maximum(x, 0.0), "jnp.maximum({x}, 0.0)", 1, "max(x, 0).")
_unary_op(
    "softplus",
    softplus,
    "jnp.maximum({x}, 0.0) + jnp.log1p(jnp.exp(-jnp.abs({x})))",
    6,
    "log(1 + e^x), stable for large |x|.",
)
_unary_op(
    "gelu",
    gelu_erf,
    "0.5 * {x} * (1.0 + jax.lax.erf({x} * 0.7071067811865476))",
    8,
    "GELU, erf form: x/2 * (1 + erf(x/sqrt 2)).",
)
_unary_op(
    "gelu_tanh",
    gelu_tanh,
    "0.5 * {x} * (1.0 + jnp.tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))",
    10,
    "GELU, tanh form: x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).",
)
_unary_op(
    "clamp",
    clamp,
    "jnp.clip({x}, {lo}, {hi})",
    2,
    "x limited to [lo, hi]; either bound may be left out.",
    {"lo": None, "hi": None},
    infer=_clamp,
)
_unary_op(
    "repeat",
    lambda x, each: jnp.repeat(x, each, axis=-1),
    "repeat_cols({x}, {each})",
    1,
    "Each column repeated `each` times: per-head scalars [B, NH] to [B, NH*each], a per-head weight [NH] to [NH*each].",
    {"each": REQUIRED},
    infer=_repeat,
)
_unary_op(
    "rowsum",
    lambda x: jnp.sum(x, axis=-1, keepdims=True),
    "jnp.sum({x}, axis=-1, keepdims=True)",
    1,
    "Sum of each row: [B, N] to [B, 1] (a per-row scalar).",
    infer=_rowsum,
    shard="row_sum",
)


def _to_f32(args, attrs):
    (x,) = args
    expect_dtype(x, ("i32",), 0)
    expect_rank(x, 1, 0, "an integer per-row input [B] (the step's positions)")
    return (TensorType(F32, (x.type.shape[0], 1)),)


# Position-dependent scalars: an integer per-row input (the step's positions) as an f32 per-row
# scalar [B, 1], which `floor`, `log` and the operators then combine and broadcast over a row
# (Llama 4's query temperature `1 + beta·log(floor((pos + 1) / F) + 1)`).
register(
    OpDef(
        "to_f32",
        ("x",),
        _to_f32,
        lambda x: (x.astype(jnp.float32)[:, None],),
        _cost(1),
        doc="An i32 per-row input [B] (e.g. positions) as an f32 per-row scalar [B, 1] (exact below 2^24).",
        shard="whole",
    )
)

# ---------------------------------------------------------------- activations
_unary_op("sigmoid", lambda x: jax.nn.sigmoid(x), "jax.nn.sigmoid({x})", 4, "Logistic sigmoid in f32.")
_unary_op("silu", lambda x: jax.nn.silu(x), "jax.nn.silu({x})", 5, "x·sigmoid(x) in f32.")

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
