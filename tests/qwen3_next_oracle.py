"""An independent Qwen3-Next-80B-A3B decode step in float64 numpy, written from the published
equations (facts/models.md section 3), not from mkdsl's ops: used by tests/test_qwen3_next.py.

It reads the weights and state in the layout of specs/qwen3_next_80b_a3b.mk (the math order the
spec declares; the header of the spec says how they map to the checkpoint) and keeps the one
numeric convention every implementation shares with mkdsl's reference: each matmul's input is
rounded to bf16 (the checkpoint's dtype) and new KV-cache entries are rounded to the cache's
dtype. Everything else is float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

EPS = 1e-6  # rms_norm_eps; also the GDN l2norm's epsilon


@dataclass(frozen=True)
class Sizes:
    hidden: int
    key_heads: int  # GDN
    value_heads: int
    head_k: int
    head_v: int
    heads: int  # full attention
    kv_heads: int
    head_dim: int
    rotary: int
    theta: float
    topk: int


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def f64(w) -> np.ndarray:
    return np.asarray(w).astype(np.float64)


def mm(x, w) -> np.ndarray:
    """x @ w with x rounded to bf16 (w is a bf16 weight), in float64."""
    return bf16(x) @ f64(w)


def rms(x, w, offset=0.0):
    """x * rsqrt(mean(x^2) + eps) * (offset + w) over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * (offset + f64(w))


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0.0)


def causal_conv(u, w, state):
    """Depthwise causal conv, kernel K: c = silu(sum_j w[j] u_{t-K+1+j}), w[K-1] on the current
    input u; state holds the previous K-1 inputs, oldest first. Returns (c, new state)."""
    window = np.concatenate([state, u[None, :]], axis=0)  # [K, C]
    return silu(np.sum(f64(w) * window, axis=0)), window[1:]


def l2norm(x):
    return x / np.sqrt(np.sum(x * x) + EPS)


def gated_deltanet(h, W, st, z: Sizes):
    """One row through a Gated DeltaNet mixer (facts §3, steps 1-5). `st` holds this row's
    recurrent state [Hv, dk, dv] and conv states; returns (output, new states)."""
    q_in, k_in, v_in = mm(h, W["gdn_wq"]), mm(h, W["gdn_wk"]), mm(h, W["gdn_wv"])
    zg = mm(h, W["gdn_wz"])
    nv, nk, dk, dv = z.value_heads, z.key_heads, z.head_k, z.head_v
    ba = mm(h, W["gdn_wba"])  # in_proj_ba regrouped: [b | a | zero padding]
    b, a = ba[:nv], ba[nv : 2 * nv]
    q, q_conv = causal_conv(q_in, W["gdn_conv_q"], st["gdn_q_conv"])
    k, k_conv = causal_conv(k_in, W["gdn_conv_k"], st["gdn_k_conv"])
    v, v_conv = causal_conv(v_in, W["gdn_conv_v"], st["gdn_v_conv"])
    beta = sigmoid(b)
    g = -np.exp(f64(W["gdn_a_log"])) * softplus(a + f64(W["gdn_dt_bias"]))
    S = st["gdn_state"].astype(np.float64).copy()
    y = np.empty(nv * dv)
    for hv in range(nv):
        g_key = hv // (nv // nk)  # value heads 2g, 2g+1 share key head g
        qh = l2norm(q[g_key * dk : (g_key + 1) * dk]) / math.sqrt(dk)
        kh = l2norm(k[g_key * dk : (g_key + 1) * dk])
        s = np.exp(g[hv]) * S[hv]  # decay before the read-out
        m = s.T @ kh
        d = beta[hv] * (v[hv * dv : (hv + 1) * dv] - m)
        s = s + np.outer(kh, d)
        S[hv] = s
        o = s.T @ qh
        y[hv * dv : (hv + 1) * dv] = rms(o, W["gdn_norm"]) * silu(zg[hv * dv : (hv + 1) * dv])
    new = {"gdn_state": S, "gdn_q_conv": q_conv, "gdn_k_conv": k_conv, "gdn_v_conv": v_conv}
    return mm(y, W["gdn_wo"]), new


def partial_rope(x, pos, z: Sizes):
    """The first `rotary` dims of a head rotate, half-split (pairs i, i + rotary/2)."""
    r = z.rotary
    half = r // 2
    inv = z.theta ** (-2.0 * np.arange(half) / r)
    ang = pos * inv
    x = x.copy()
    x1, x2 = x[:half].copy(), x[half:r].copy()
    x[:half] = x1 * np.cos(ang) - x2 * np.sin(ang)
    x[half:r] = x2 * np.cos(ang) + x1 * np.sin(ang)
    return x


def gated_attention(h, W, st, pos: int, z: Sizes):
    """One row through the gated full-attention mixer (facts §3): per-head (1 + w) q/k norms,
    partial RoPE, GQA over tokens 0..pos, output times sigmoid(gate)."""
    nh, nkv, d = z.heads, z.kv_heads, z.head_dim
    q, gate = mm(h, W["attn_wq"]), mm(h, W["attn_wg"])
    k, v = mm(h, W["attn_wk"]), mm(h, W["attn_wv"])
    kc, vc = st["k_cache"].copy(), st["v_cache"].copy()  # [nkv, S, d], bf16
    for j in range(nkv):
        kj = partial_rope(rms(k[j * d : (j + 1) * d], W["attn_knorm"], 1.0), pos, z)
        kc[j, pos] = kj.astype(kc.dtype)
        vc[j, pos] = v[j * d : (j + 1) * d].astype(vc.dtype)
    out = np.empty(nh * d)
    for i in range(nh):
        qi = partial_rope(rms(q[i * d : (i + 1) * d], W["attn_qnorm"], 1.0), pos, z)
        j = i // (nh // nkv)
        keys, vals = f64(kc[j, : pos + 1]), f64(vc[j, : pos + 1])
        # bf16 MXU dots against the bf16 cache: q and exp(s - max) rounded to bf16 (the contract)
        s = keys @ bf16(qi) / math.sqrt(d)
        p = np.exp(s - s.max())
        out[i * d : (i + 1) * d] = bf16(p) @ vals / p.sum()
    o = out * sigmoid(gate)
    return mm(o, W["attn_wo"]), {"k_cache": kc, "v_cache": vc}


def moe(h, W, z: Sizes):
    """Softmax over the experts, top-k renormalised, SwiGLU experts; plus the shared SwiGLU
    expert scaled by sigmoid(shared_expert_gate . h). Also returns the relative gap between the
    k-th choice and the runner-up (a near tie may go either way under rounding)."""
    p = np.exp(mm(h, W["moe_router"]) - mm(h, W["moe_router"]).max())
    p = p / p.sum()
    order = np.argsort(-p, kind="stable")
    top = order[: z.topk]
    margin = (p[order[z.topk - 1]] - p[order[z.topk]]) / p[order[z.topk - 1]]  # k-th vs runner-up
    weights = p[top] / p[top].sum()
    y = np.zeros(z.hidden)
    for e, we in zip(top, weights):
        act = silu(mm(h, W["moe_w1"][e])) * mm(h, W["moe_w3"][e])
        y += we * mm(act, W["moe_w2"][e])
    shared = mm(silu(mm(h, W["shared_gate"])) * mm(h, W["shared_up"]), W["shared_down"])
    return y + sigmoid(h @ f64(W["shared_egate"])) * shared, margin


def layer_weights(model, weights: dict, layer: int) -> dict:
    """Each weight's slice for this layer (a stacked tensor's slot), or the whole global tensor."""
    out = {}
    for t in model.weights:
        if not t.stacked:
            out[t.name] = weights[t.name]
        elif t.slots[layer] >= 0:
            out[t.name] = weights[t.name][t.slots[layer]]
    return out


def decode(model, z: Sizes, weights: dict, state: dict, tokens, positions):
    """One greedy decode step for every row: (logits [B, V], next tokens, new state, each row's
    smallest routing margin over its layers)."""
    new_state = {k: np.array(v, copy=True) for k, v in state.items()}
    kinds = model.schedule
    logits, margins = [], []
    for b, (tok, pos) in enumerate(zip(tokens, positions)):
        x = f64(weights["embed"][tok])
        margins.append(np.inf)
        for layer, kind in enumerate(kinds):
            W = layer_weights(model, weights, layer)
            st = {t.name: new_state[t.name][t.slots[layer], b] for t in model.states if t.slots[layer] >= 0}
            h = rms(x, W["input_norm"], 1.0)
            mixer = gated_attention(h, W, st, int(pos), z) if kind == "full_attn" else gated_deltanet(h, W, st, z)
            out, upd = mixer
            x = x + out
            for name, v in upd.items():
                slot = model.tensor(name).slots[layer]
                new_state[name][slot, b] = v.astype(new_state[name].dtype)
            y, margin = moe(rms(x, W["post_norm"], 1.0), W, z)
            margins[-1] = min(margins[-1], margin)
            x = x + y
        logits.append(mm(rms(x, weights["final_norm"], 1.0), weights["lm_head"]))
    logits = np.stack(logits)
    return logits, np.argmax(logits, axis=1), new_state, np.array(margins)
