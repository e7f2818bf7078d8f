"""Kimi Delta Attention (KDA): short causal conv, per-head L2 norm, decay gate, the recurrent-state family.

One decode step of a KDA layer, per row (see facts/kimi_k3.md):

    q = l2norm(short_conv(x·Wq, wq_conv, q_conv_state), heads=h, scale=d^-0.5)
    k = l2norm(short_conv(x·Wk, wk_conv, k_conv_state), heads=h)
    v = short_conv(x·Wv, wv_conv, v_conv_state)
    g = kda_gate(x·Wfa·Wfb, a_log, dt_bias, heads=h)
    beta = sigmoid(x·Wb)
    o = recurrent(q, k, v, state, g, beta, heads=h)     # rule="delta"

Everything is computed in f32; weights are upcast. The conv state and the recurrent state
are updated in place.

Gated DeltaNet (Qwen3-Next, facts/models.md section 3) uses the same ops: its decay is one
scalar per value head (g [B, heads], composed in the spec from elementwise ops) and several
value heads share a key head (`recurrent(..., key_heads=n)`); its gated output norm is
`rmsnorm(o, w, heads=h) * silu(z)`.

`recurrent` is the family of linear recurrences over a [dk, dv] state per head: the delta rule
above, and the plain gated outer product `S = exp(g)·S + k (beta·v)ᵀ` (`rule="outer"`) of Mamba2
(g = dt·A per head, beta = dt, k = B, q = C, v = x) and GLA / RetNet (g per key channel or a
constant per head, no beta).
"""

from __future__ import annotations

import math

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.prefill import device_index, scan_rule
from mkdsl.ops.registry import (
    Cost,
    OpDef,
    OpError,
    expect_divides,
    expect_dtype,
    expect_float,
    expect_rank,
    nbytes,
    numel,
    register,
)


def _expect_weight(w, i: int, rank: int, what: str) -> None:
    """A declared, unquantised floating-point weight of the given rank."""
    if w.kind != "tensor" or w.is_state:
        raise OpError(f"{what} must be a declared weight, not `{w.name}`", i)
    expect_rank(w, rank, i, what)
    expect_float(w, i)
    if w.type.dtype.quantised:
        raise OpError(f"{what} `{w.name}` must not be quantised, but it is {w.type}", i)


def _expect_state(s, i: int, rank: int, what: str) -> None:
    if not s.is_state:
        raise OpError(f"{what} must be a state tensor, not `{s.name}`", i)
    expect_rank(s, rank, i, what)


def _expect_act(x, i: int, what: str) -> None:
    expect_rank(x, 2, i, what)
    expect_float(x, i)


def _expect_shape(x, i: int, want: tuple, what: str) -> None:
    if tuple(x.type.shape) != tuple(want):
        shown = ", ".join(str(d) for d in want)
        raise OpError(f"{what} `{x.name}` is {x.type}, expected shape [{shown}]", i)


def _heads(attrs) -> int:
    heads = attrs["heads"]
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise OpError(f"heads must be a positive integer, got {heads!r}", "heads")
    return heads


# ---------------------------------------------------------------- short causal conv


CONV_ACTS = ("silu", "none")  # short_conv's activation; "none": the spec applies its own after it


def short_conv(x, w, state, bias=None, act="silu"):
    """Depthwise causal conv over the previous K-1 inputs (the state, oldest first) and x, plus
    an optional per-channel bias, then `act` (SiLU, or none). Returns (act(y), new state =
    [state[:, 1:], x] in the state's dtype)."""
    xf = x.astype(jnp.float32)
    wf = w.astype(jnp.float32)
    y = jnp.sum(state.astype(jnp.float32) * wf[None, :-1, :], axis=1) + wf[-1][None, :] * xf
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    new_state = jnp.concatenate([state[:, 1:], xf[:, None, :].astype(state.dtype)], axis=1)
    return (jax.nn.silu(y) if act == "silu" else y), new_state


def _short_conv_infer(args, attrs):
    x, w, s = args[:3]
    if attrs.get("act", "silu") not in CONV_ACTS:
        raise OpError(f"act must be one of {', '.join(map(repr, CONV_ACTS))}, got {attrs['act']!r}", "act")
    if len(args) > 3:
        _expect_weight(args[3], 3, 1, "the conv bias [C]")
        _expect_shape(args[3], 3, (x.type.shape[1],), f"the conv bias (one per channel of `{x.name}`)")
    _expect_act(x, 0, "the input")
    _expect_weight(w, 1, 2, "the conv weight [K, C]")
    _expect_state(s, 2, 3, "the conv state [B, K-1, C]")
    expect_dtype(s, ("f32", "bf16"), 2)
    b, c = x.type.shape
    taps = w.type.shape[0]
    if isinstance(taps, int) and taps < 2:
        raise OpError(f"the conv weight `{w.name}` needs at least 2 taps, got {w.type}", 1)
    if w.type.shape[1] != c:
        raise OpError(f"conv weight `{w.name}` is {w.type} but `{x.name}` has {c} channels", 1)
    prev = taps - 1 if isinstance(taps, int) else f"{taps}-1"
    if s.type.shape[0] != b or s.type.shape[2] != c or (isinstance(taps, int) and s.type.shape[1] != prev):
        raise OpError(
            f"conv state `{s.name}` is {s.type}, expected [{b}, {prev}, {c}]: "
            f"the previous {prev} inputs of `{x.name}` for a {taps}-tap weight",
            2,
        )
    return (TensorType(F32, (b, c)),)


def _short_conv_cost(ins, outs, attrs):
    x, w, s = ins[:3]
    taps = w.shape[0]
    bias = nbytes(ins[3]) if len(ins) > 3 else 0
    return Cost(weight_bytes=nbytes(w) + bias, state_bytes=2 * nbytes(s), flops=(2 * taps + 5) * numel(outs[0]))


register(
    OpDef(
        "short_conv",
        ("x", "weight", "conv_state", "bias"),
        _short_conv_infer,
        short_conv,
        _short_conv_cost,
        attrs={"act": "silu"},
        optional=1,
        inout=("conv_state",),
        doc="Depthwise causal conv of x with the previous K-1 inputs (state, oldest first), plus an optional "
        'bias [C], then `act` ("silu", or "none": an activation of the spec\'s own after it); '
        "weight [K, C], its last tap on x; the state shifts in x.",
        shard="channels",
        data_dependent=True,
        prefill=scan_rule(short_conv, tokens=(0,), state=2),  # the conv window slides token by token
    )
)


# ---------------------------------------------------------------- per-head L2 norm


def l2norm(x, heads=1, scale=1.0, eps=1e-6):
    """Each head's slice x_h·rsqrt(sum(x_h²)+eps)·scale, in f32."""
    x = x.astype(jnp.float32)
    b, n = x.shape
    xh = x.reshape(b, heads, n // heads)
    y = xh * jax.lax.rsqrt(jnp.sum(xh * xh, axis=-1, keepdims=True) + eps) * scale
    return y.reshape(b, n)


def _l2norm_infer(args, attrs):
    (x,) = args
    _expect_act(x, 0, "the input")
    expect_divides(x.type.shape[1], _heads(attrs), "row width per head", "heads")
    return (TensorType(F32, x.type.shape),)


register(
    OpDef(
        "l2norm",
        ("x",),
        _l2norm_infer,
        lambda x, heads, scale, eps: (l2norm(x, heads, scale, eps),),
        lambda ins, outs, a: Cost(flops=4 * numel(outs[0])),
        attrs={"heads": 1, "scale": 1.0, "eps": 1e-6},
        doc="Per-head L2 norm: x_h·rsqrt(sum(x_h²)+eps)·scale, f32.",
        shard="norm",
    )
)


# ---------------------------------------------------------------- decay gate


def kda_gate(f, a_log, dt_bias, heads=1, lower=-5.0):
    """lower·sigmoid(exp(a_log[h])·(f + dt_bias)), a_log broadcast over head h's channels."""
    f = f.astype(jnp.float32)
    b, n = f.shape
    a = jnp.exp(a_log.astype(jnp.float32))[None, :, None]
    z = (f + dt_bias.astype(jnp.float32)[None, :]).reshape(b, heads, n // heads)
    return (lower * jax.nn.sigmoid(a * z)).reshape(b, n)


def _kda_gate_infer(args, attrs):
    f, a_log, dt_bias = args
    heads = _heads(attrs)
    _expect_act(f, 0, "the gate input")
    _expect_weight(a_log, 1, 1, "a_log [heads]")
    _expect_weight(dt_bias, 2, 1, "dt_bias [heads·d]")
    n = f.type.shape[1]
    expect_divides(n, heads, "gate width per head", "heads")
    _expect_shape(a_log, 1, (heads,), f"a_log (one per head, heads={heads})")
    _expect_shape(dt_bias, 2, (n,), f"dt_bias (one per channel of `{f.name}`)")
    return (TensorType(F32, f.type.shape),)


register(
    OpDef(
        "kda_gate",
        ("f", "a_log", "dt_bias"),
        _kda_gate_infer,
        lambda f, a, d, heads, lower: (kda_gate(f, a, d, heads, lower),),
        lambda ins, outs, a: Cost(weight_bytes=nbytes(ins[1]) + nbytes(ins[2]), flops=8 * numel(outs[0])),
        attrs={"heads": 1, "lower": -5.0},
        doc="KDA decay gate (log space): lower·sigmoid(exp(a_log[head])·(f + dt_bias)), per channel.",
        shard="heads",
    )
)


# ---------------------------------------------------------------- recurrent state updates

RULES = ("delta", "outer")  # the update rules of `recurrent`


def _key_heads(attrs, heads: int) -> int:
    """The key heads (`key_heads=`, default: one per value head); value head h reads key head
    h // (heads / key_heads), as in grouped-query attention. With `key_axes` (set by the shard
    pass: fewer key heads than devices) q and k stay whole and `key_heads` counts them all."""
    kh = attrs.get("key_heads")
    if kh is None:
        return heads
    if not isinstance(kh, int) or isinstance(kh, bool) or kh < 1:
        raise OpError(f"key_heads must be a positive integer, got {kh!r}", "key_heads")
    if heads % kh and not attrs.get("key_axes"):
        raise OpError(f"heads={heads} is not a multiple of key_heads={kh}", "key_heads")
    return kh


def _rule(attrs) -> str:
    rule = attrs.get("rule", "delta")
    if rule not in RULES:
        raise OpError(f"rule must be one of {', '.join(map(repr, RULES))}, got {rule!r}", "rule")
    return rule


def decay_of(g, b: int, heads: int, dk: int):
    """exp(g) shaped to scale states [B, heads, dk, dv]: none (g None), a constant per head
    (g [heads], a weight), a scalar per row and head (g [B, heads]) or one per key channel."""
    if g is None:
        return 1.0
    gf = g.astype(jnp.float32)
    if gf.ndim == 1:
        return jnp.exp(gf)[None, :, None, None]
    if gf.shape[1] == heads:
        return jnp.exp(gf)[..., None, None]
    return jnp.exp(gf.reshape(b, heads, dk))[..., None]


def recurrent(q, k, v, state, g=None, beta=None, heads=1, key_heads=None, rule="delta", key_axes=None):
    """One token of a linear recurrence per row and value head, S [dk, dv] in f32:
    S' = exp(g)·S; u = beta·(v - S'ᵀk) (rule "delta") or beta·v (rule "outer"); S = S' + k uᵀ;
    o = Sᵀq. Value head h reads q and k of key head h // (heads / key_heads); without g there is
    no decay, without beta it is 1. `key_axes` (a device's value heads share one key head of the
    whole q, k): that head is the device's index over the axes times key_heads // devices."""
    b = q.shape[0]
    dk, dv = state.shape[2], state.shape[3]
    qf, kf = q.astype(jnp.float32).reshape(b, -1, dk), k.astype(jnp.float32).reshape(b, -1, dk)
    if key_axes:
        ways = math.prod(jax.lax.axis_size(a) for a in key_axes)
        lo = device_index(key_axes) * qf.shape[1] // ways
        qf, kf = (jax.lax.dynamic_slice_in_dim(x, lo, 1, axis=1) for x in (qf, kf))
    group = heads // qf.shape[1]
    qh, kh = jnp.repeat(qf, group, axis=1), jnp.repeat(kf, group, axis=1)
    vh = v.astype(jnp.float32).reshape(b, heads, dv)
    s = decay_of(g, b, heads, dk) * state.astype(jnp.float32)
    u = vh
    if rule == "delta":
        u = vh - jnp.einsum("bhk,bhkv->bhv", kh, s, precision="highest")
    if beta is not None:
        u = beta.astype(jnp.float32)[..., None] * u
    s = s + kh[..., :, None] * u[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", qh, s, precision="highest")
    return o.reshape(b, heads * dv), s.astype(state.dtype)


def _check_decay(g, i: int, b, heads: int, dk) -> None:
    """g: a weight [heads] (a constant per head), or [B, heads] or [B, heads·dk] per row."""
    if len(g.type.shape) == 1:
        _expect_weight(g, i, 1, "a constant decay [heads]")
        _expect_shape(g, i, (heads,), f"the constant decay (one per head, heads={heads})")
        return
    _expect_act(g, i, "g")
    if g.type.shape[0] != b:
        raise OpError(f"g `{g.name}` has {g.type.shape[0]} rows, the state has {b}", i)
    if g.type.shape[1] not in (heads, heads * dk if isinstance(dk, int) else None):
        raise OpError(
            f"g `{g.name}` has {g.type.shape[1]} columns, expected {heads} (one decay per head) "
            f"or {heads * dk if isinstance(dk, int) else f'{heads}*{dk}'} (one per key channel)",
            i,
        )


def _recurrent_infer(args, attrs):
    q, k, v, s = args[:4]
    heads = _heads(attrs)
    kheads = _key_heads(attrs, heads)
    _rule(attrs)
    for i, a in enumerate((q, k, v)):
        _expect_act(a, i, "q, k and v")
    _expect_state(s, 3, 4, "the recurrent state [B, heads, dk, dv]")
    expect_dtype(s, ("f32",), 3)
    b, sh, dk, dv = s.type.shape
    if sh != heads:
        raise OpError(f"the state `{s.name}` is {s.type}, but heads={heads}: dimension 2 must be {heads}", 3)
    checks = [(0, q, kheads * dk, "q"), (1, k, kheads * dk, "k"), (2, v, heads * dv, "v")]
    if len(args) > 4:
        _check_decay(args[4], 4, b, heads, dk)
    if len(args) > 5:
        _expect_act(args[5], 5, "beta")
        checks.append((5, args[5], heads, "beta"))
    for i, a, want, what in checks:
        if a.type.shape[0] != b:
            raise OpError(f"{what} `{a.name}` has {a.type.shape[0]} rows, the state has {b}", i)
        if a.type.shape[1] != want:
            kh = f"{kheads} key heads, " if kheads != heads else ""
            raise OpError(
                f"{what} `{a.name}` has {a.type.shape[1]} columns, expected {want} for {kh}{heads} heads and state {s.type}",
                i,
            )
    return (TensorType(F32, (b, heads * dv)),)


def _recurrent_cost(ins, outs, attrs):
    s = ins[3]
    decay = nbytes(ins[4]) if len(ins) > 4 and len(ins[4].shape) == 1 else 0  # a constant decay is a weight
    # per state element: decay 1, S'ᵀk 2 (the delta rule), rank-1 update 2, read-out Sᵀq 2
    per = 7 if attrs.get("rule", "delta") == "delta" else 5
    return Cost(weight_bytes=decay, state_bytes=2 * nbytes(s), flops=per * numel(s))


def _recurrent_prefill(rows, *operands, **attrs):
    """The one-token update scanned over the prompt; a constant decay is not per token."""
    tokens = tuple(i for i in range(len(operands)) if i != 3 and operands[i].ndim == 2)
    return scan_rule(recurrent, tokens, state=3)(rows, *operands, **attrs)


register(
    OpDef(
        "recurrent",
        ("q", "k", "v", "state", "g", "beta"),
        _recurrent_infer,
        recurrent,
        _recurrent_cost,
        attrs={"heads": 1, "key_heads": None, "rule": "delta"},
        optional=2,
        inout=("state",),
        doc="Linear recurrence, one token: S' = exp(g)·S (g [B, heads·dk] per key channel, [B, heads] per head, "
        'a weight [heads] constant per head, or none); u = beta·(v - S\'ᵀk) (`rule="delta"`: KDA, Gated '
        'DeltaNet) or beta·v (`rule="outer"`: Mamba2, GLA, RetNet); S = S\' + k⊗u; o = Sᵀq. q, k '
        "[B, key_heads·dk] (value head h reads key head h // (heads/key_heads)); beta [B, heads] (none: 1); "
        "state [B, heads, dk, dv] f32, updated in place.",
        shard="key_heads",
        attends=True,
        data_dependent=True,
        prefill=_recurrent_prefill,  # the recurrence, token by token
        rows_in_series=True,  # verify rows: row r reads the state row r - 1 wrote (runtime/kda.py.jinja)
        state_unit=2,  # S += k uᵀ moves a head's whole [dk, dv] matrix (mkdsl/verify/kernel.py)
    )
)
