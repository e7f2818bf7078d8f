"""Kimi Delta Attention (KDA): short causal conv, per-head L2 norm, decay gate, gated delta rule.

One decode step of a KDA layer, per row (see facts/kimi_k3.md):

    q = l2norm(short_conv(x·Wq, wq_conv, q_conv_state), heads=h, scale=d^-0.5)
    k = l2norm(short_conv(x·Wk, wk_conv, k_conv_state), heads=h)
    v = short_conv(x·Wv, wv_conv, v_conv_state)
    g = kda_gate(x·Wfa·Wfb, a_log, dt_bias, heads=h)
    beta = sigmoid(x·Wb)
    o = delta_rule(q, k, v, g, beta, state, heads=h)

Everything is computed in f32; weights are upcast. The conv state and the recurrent state
are updated in place.

Gated DeltaNet (Qwen3-Next, facts/models.md section 3) uses the same ops: its decay is one
scalar per value head (g [B, heads], composed in the spec from elementwise ops) and several
value heads share a key head (`delta_rule(..., key_heads=n)`); its gated output norm is
`rmsnorm(o, w, heads=h) * silu(z)`.
"""

from __future__ import annotations

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.prefill import scan_rule
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


def short_conv(x, w, state):
    """Depthwise causal conv over the previous K-1 inputs (the state, oldest first) and x, then
    SiLU. Returns (silu(y), new state = [state[:, 1:], x] in the state's dtype)."""
    xf = x.astype(jnp.float32)
    wf = w.astype(jnp.float32)
    y = jnp.sum(state.astype(jnp.float32) * wf[None, :-1, :], axis=1) + wf[-1][None, :] * xf
    new_state = jnp.concatenate([state[:, 1:], xf[:, None, :].astype(state.dtype)], axis=1)
    return jax.nn.silu(y), new_state


def _short_conv_infer(args, attrs):
    x, w, s = args
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
    x, w, s = ins
    taps = w.shape[0]
    return Cost(weight_bytes=nbytes(w), state_bytes=2 * nbytes(s), flops=(2 * taps + 5) * numel(outs[0]))


register(
    OpDef(
        "short_conv",
        ("x", "weight", "conv_state"),
        _short_conv_infer,
        short_conv,
        _short_conv_cost,
        inout=("conv_state",),
        doc="Depthwise causal conv of x with the previous K-1 inputs (state, oldest first) then SiLU; "
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


# ---------------------------------------------------------------- gated delta rule


def _key_heads(attrs, heads: int) -> int:
    """The key heads (`key_heads=`, default: one per value head); value head h reads key head
    h // (heads / key_heads), as in grouped-query attention."""
    kh = attrs.get("key_heads")
    if kh is None:
        return heads
    if not isinstance(kh, int) or isinstance(kh, bool) or kh < 1:
        raise OpError(f"key_heads must be a positive integer, got {kh!r}", "key_heads")
    if heads % kh:
        raise OpError(f"heads={heads} is not a multiple of key_heads={kh}", "key_heads")
    return kh


def delta_rule(q, k, v, g, beta, state, heads=1, key_heads=None):
    """One step of the gated delta rule per row and value head, S [dk, dv] in f32:
    S' = exp(g)·S (g per key channel, or one scalar per head); S = S' + k ⊗ (beta·(v - S'ᵀk));
    o = Sᵀq. Value head h reads q and k of key head h // (heads / key_heads)."""
    b = q.shape[0]
    dk, dv = state.shape[2], state.shape[3]
    group = heads // (key_heads or heads)
    qh = jnp.repeat(q.astype(jnp.float32).reshape(b, -1, dk), group, axis=1)
    kh = jnp.repeat(k.astype(jnp.float32).reshape(b, -1, dk), group, axis=1)
    gf = g.astype(jnp.float32)
    decay = jnp.exp(gf)[..., None, None] if gf.shape[1] == heads else jnp.exp(gf.reshape(b, heads, dk))[..., None]
    vh = v.astype(jnp.float32).reshape(b, heads, dv)
    bh = beta.astype(jnp.float32)
    s = decay * state.astype(jnp.float32)
    read = jnp.einsum("bhk,bhkv->bhv", kh, s, precision="highest")
    u = bh[..., None] * (vh - read)
    s = s + kh[..., :, None] * u[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", qh, s, precision="highest")
    return o.reshape(b, heads * dv), s.astype(state.dtype)


def _delta_rule_infer(args, attrs):
    q, k, v, g, beta, s = args
    heads = _heads(attrs)
    kheads = _key_heads(attrs, heads)
    for i, a in enumerate((q, k, v, g, beta)):
        _expect_act(a, i, "q, k, v, g and beta")
    _expect_state(s, 5, 4, "the KDA state [B, heads, dk, dv]")
    expect_dtype(s, ("f32",), 5)
    b, sh, dk, dv = s.type.shape
    if sh != heads:
        raise OpError(f"the state `{s.name}` is {s.type}, but heads={heads}: dimension 2 must be {heads}", 5)
    gw = g.type.shape[1]
    for i, a, want, what in (
        (0, q, kheads * dk, "q"),
        (1, k, kheads * dk, "k"),
        (2, v, heads * dv, "v"),
        (3, g, gw if gw == heads else heads * dk, "g"),
        (4, beta, heads, "beta"),
    ):
        if a.type.shape[0] != b:
            raise OpError(f"{what} `{a.name}` has {a.type.shape[0]} rows, the state has {b}", i)
        if a.type.shape[1] != want:
            extra = f" (or {heads}, one decay per head)" if what == "g" else ""
            kh = f"{kheads} key heads, " if kheads != heads else ""
            raise OpError(
                f"{what} `{a.name}` has {a.type.shape[1]} columns, expected {want}{extra} "
                f"for {kh}{heads} heads and state {s.type}",
                i,
            )
    return (TensorType(F32, (b, heads * dv)),)


def _delta_rule_cost(ins, outs, attrs):
    s = ins[5]
    # per state element: decay 1, S'ᵀk 2, rank-1 update 2, read-out Sᵀq 2
    return Cost(state_bytes=2 * nbytes(s), flops=7 * numel(s))


register(
    OpDef(
        "delta_rule",
        ("q", "k", "v", "g", "beta", "state"),
        _delta_rule_infer,
        delta_rule,
        _delta_rule_cost,
        attrs={"heads": 1, "key_heads": None},
        inout=("state",),
        doc="Gated delta rule, one token: S' = exp(g)·S (g [B, heads·dk] per key channel, or [B, heads] "
        "per head); S = S' + k⊗(beta·(v - S'ᵀk)); o = Sᵀq. q, k [B, key_heads·dk] (value head h reads "
        "key head h // (heads/key_heads)); state [B, heads, dk, dv] f32, updated in place.",
        shard="key_heads",
        attends=True,
        data_dependent=True,
        prefill=scan_rule(delta_rule, tokens=(0, 1, 2, 3, 4), state=5),  # the recurrence, token by token
    )
)
