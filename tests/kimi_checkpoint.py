"""Kimi K3's published checkpoint layout (facts/kimi_k3.md, "Checkpoint tensor names"), written
from weights in the spec's layout, for the loader tests (tests/test_checkpoint.py): names under
`language_model.model.`, matrices `[out, in]` without the spec's zero padding, the routed experts
packed MXFP4 (`weight_packed` [out, in/2], the lower input in the low nibble, and `weight_scale`
[out, in/32] E8M0 bytes), each residual vector stored as a norm gain times a [1, H] projection.
Written from the format description, not from mkdsl's loader."""

from __future__ import annotations

import numpy as np

P = "language_model.model."
KDA = ("kda_dense", "kda_moe")
MOE = ("kda_moe", "mla_moe")


def _t(x) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(np.asarray(x), -1, -2))


def _slots(schedule, kinds) -> dict[int, int]:
    layers = [i for i, k in enumerate(schedule) if kinds is None or k in kinds]
    return {layer: s for s, layer in enumerate(layers)}


def _blocks(x: np.ndarray, groups: int, keep: int, axis: int = -1) -> np.ndarray:
    """The first `keep` entries of each of `groups` equal blocks along `axis` (the spec's padding dropped)."""
    parts = np.split(np.asarray(x), groups, axis=axis)
    return np.concatenate([np.take(p, np.arange(keep), axis=axis) for p in parts], axis=axis)


def _packed(codes: np.ndarray) -> np.ndarray:
    """mkdsl's mxfp4 words uint32 [K/8, N] -> packed bytes [N, K/2], input 2j low, 2j + 1 high."""
    words = np.asarray(codes, np.uint32)
    nib = np.stack([(words >> (4 * i)) & 15 for i in range(8)], axis=-2).reshape(words.shape[0] * 8, -1).T
    return np.ascontiguousarray((nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8))


def _factor(v: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(norm gain [H], projection [1, H]) whose product is `v` exactly: a power of two apart."""
    import ml_dtypes

    power = np.exp2(np.random.default_rng(seed).integers(-2, 3, size=v.shape)).astype(np.float32)
    norm = (np.asarray(v, np.float32) / power).astype(ml_dtypes.bfloat16)
    return norm, power.astype(ml_dtypes.bfloat16)[None]


# spec weight -> (name under P, layer kinds or None, stored transposed)
PLAIN = {
    "input_norm": ("layers.{l}.input_layernorm.weight", None, False),
    "post_norm": ("layers.{l}.post_attention_layernorm.weight", None, False),
    "kda_wq": ("layers.{l}.self_attn.q_proj.weight", KDA, True),
    "kda_wk": ("layers.{l}.self_attn.k_proj.weight", KDA, True),
    "kda_wv": ("layers.{l}.self_attn.v_proj.weight", KDA, True),
    "kda_wfa": ("layers.{l}.self_attn.f_a_proj.weight", KDA, True),
    "kda_wfb": ("layers.{l}.self_attn.f_b_proj.weight", KDA, True),
    "kda_a_log": ("layers.{l}.self_attn.A_log", KDA, False),
    "kda_dt_bias": ("layers.{l}.self_attn.dt_bias", KDA, False),
    "kda_wg": ("layers.{l}.self_attn.g_proj.weight", KDA, True),
    "kda_onorm": ("layers.{l}.self_attn.o_norm.weight", KDA, False),
    "kda_wo": ("layers.{l}.self_attn.o_proj.weight", KDA, True),
    "mla_wqa": ("layers.{l}.self_attn.q_a_proj.weight", ("mla_moe",), True),
    "mla_qnorm": ("layers.{l}.self_attn.q_a_layernorm.weight", ("mla_moe",), False),
    "mla_kvnorm": ("layers.{l}.self_attn.kv_a_layernorm.weight", ("mla_moe",), False),
    "mla_wkvb": ("layers.{l}.self_attn.kv_b_proj.weight", ("mla_moe",), True),
    "mla_wg": ("layers.{l}.self_attn.g_proj.weight", ("mla_moe",), True),
    "mla_wo": ("layers.{l}.self_attn.o_proj.weight", ("mla_moe",), True),
    "moe_bias": ("layers.{l}.block_sparse_moe.gate.e_score_correction_bias", MOE, False),
    "moe_rnorm": ("layers.{l}.block_sparse_moe.routed_expert_norm.weight", MOE, False),
    "moe_up": ("layers.{l}.block_sparse_moe.routed_expert_up_proj.weight", MOE, True),
}
# spec weight -> (name under P, layer kinds, (groups, kept per group) of its padded output columns)
PADDED = {
    "kda_wb": ("layers.{l}.self_attn.b_proj.weight", KDA, (lambda c: c["DEV"], lambda c: c["HD"])),
    "mla_wqb": ("layers.{l}.self_attn.q_b_proj.weight", ("mla_moe",), (lambda c: c["DEV"], lambda c: c["QH"])),
    "mla_wkva": ("layers.{l}.self_attn.kv_a_proj_with_mqa.weight", ("mla_moe",), (1, lambda c: c["KVR"] + c["XK"])),
    "dense_gate": ("layers.{l}.mlp.gate_proj.weight", ("kda_dense",), (1, lambda c: c["FD"])),
    "dense_up": ("layers.{l}.mlp.up_proj.weight", ("kda_dense",), (1, lambda c: c["FD"])),
    "moe_router": ("layers.{l}.block_sparse_moe.gate.weight", MOE, (1, lambda c: c["E"])),
    "moe_down": (
        "layers.{l}.block_sparse_moe.routed_expert_down_proj.weight",
        MOE,
        (lambda c: c["TPN"], lambda c: c["LAT"] // c["TPN"]),
    ),
    "shared_gate": ("layers.{l}.block_sparse_moe.shared_experts.gate_proj.weight", MOE, (1, lambda c: c["FS"])),
    "shared_up": ("layers.{l}.block_sparse_moe.shared_experts.up_proj.weight", MOE, (1, lambda c: c["FS"])),
}
PADDED_ROWS = {  # [padded, H] matrices: the padding is rows
    "dense_down": ("layers.{l}.mlp.down_proj.weight", ("kda_dense",), lambda c: c["FD"]),
    "shared_down": ("layers.{l}.block_sparse_moe.shared_experts.down_proj.weight", MOE, lambda c: c["FS"]),
}


def _size(c: dict, expr) -> int:
    return expr if isinstance(expr, int) else int(expr(c))


def kimi_tensors(weights: dict, schedule, c: dict) -> dict:
    out = {
        P + "embed_tokens.weight": np.asarray(weights["embed"]),
        "language_model.lm_head.weight": _t(weights["lm_head"]),
    }
    out[P + "norm.weight"] = np.asarray(weights["final_norm"])
    out[P + "output_attn_res_norm.weight"], out[P + "output_attn_res_proj.weight"] = _factor(weights["out_res"], 0)
    for layer in range(len(schedule)):
        for w, part in (("attn_res", "self_attention_res"), ("mlp_res", "mlp_res")):
            norm, proj = _factor(weights[w][layer], layer + 1)
            out[f"{P}layers.{layer}.{part}_norm.weight"], out[f"{P}layers.{layer}.{part}_proj.weight"] = norm, proj
    for w, (name, kinds, matrix) in PLAIN.items():
        for layer, s in _slots(schedule, kinds).items():
            out[P + name.format(l=layer)] = _t(weights[w][s]) if matrix else np.ascontiguousarray(weights[w][s])
    for w, (name, kinds, (groups, keep)) in PADDED.items():
        for layer, s in _slots(schedule, kinds).items():
            out[P + name.format(l=layer)] = _t(_blocks(weights[w][s], _size(c, groups), _size(c, keep)))
    for w, (name, kinds, keep) in PADDED_ROWS.items():
        for layer, s in _slots(schedule, kinds).items():
            out[P + name.format(l=layer)] = _t(np.asarray(weights[w][s])[: _size(c, keep)])
    for layer, s in _slots(schedule, KDA).items():
        for x in "qkv":
            out[f"{P}layers.{layer}.self_attn.{x}_conv1d.weight"] = np.ascontiguousarray(
                _t(weights[f"kda_conv_{x}"][s])[:, None, :]
            )
    for layer, s in _slots(schedule, MOE).items():
        for w in ("w1", "w2", "w3"):
            q = weights[f"moe_{w}"]
            for e in range(q.codes.shape[1]):
                name = f"{P}layers.{layer}.block_sparse_moe.experts.{e}.{w}."
                out[name + "weight_packed"] = _packed(q.codes[s, e])
                out[name + "weight_scale"] = _t(q.scales[s, e])
    return out


def kimi_expected(weights: dict, c: dict) -> dict:
    """What loading the layout gives: the weights with their padding zero (the checkpoint has none)."""
    out = dict(weights)
    for w, (_, _, (groups, keep)) in PADDED.items():
        x = np.array(weights[w])
        for block in np.split(np.arange(x.shape[-1]), _size(c, groups)):
            x[..., block[_size(c, keep) :]] = 0
        out[w] = x
    for w, (_, _, keep) in PADDED_ROWS.items():
        x = np.array(weights[w])
        x[:, _size(c, keep) :] = 0
        out[w] = x
    return out


BF, F32, U8 = "BF16", "F32", "U8"


def kimi_header(schedule) -> dict:
    """Tensor name -> (shape, stored type) of the full-size checkpoint (facts/kimi_k3.md)."""
    h, v, nd, lat, fe = 7168, 163840, 96 * 128, 3584, 3072
    t = {P + "embed_tokens.weight": ((v, h), BF), "language_model.lm_head.weight": ((v, h), BF)}
    t |= {P + "norm.weight": ((h,), BF), P + "output_attn_res_norm.weight": ((h,), BF)}
    t |= {P + "output_attn_res_proj.weight": ((1, h), BF)}
    for i, kind in enumerate(schedule):
        p = f"{P}layers.{i}."
        t |= {p + n + ".weight": ((h,), BF) for n in ("input_layernorm", "post_attention_layernorm")}
        t |= {p + n + "_norm.weight": ((h,), BF) for n in ("self_attention_res", "mlp_res")}
        t |= {p + n + "_proj.weight": ((1, h), BF) for n in ("self_attention_res", "mlp_res")}
        a = p + "self_attn."
        if kind in KDA:
            t |= {a + f"{x}_proj.weight": ((nd, h), BF) for x in "qkvg"}
            t |= {a + f"{x}_conv1d.weight": ((nd, 1, 4), BF) for x in "qkv"}
            t |= {a + "b_proj.weight": ((96, h), BF), a + "f_a_proj.weight": ((128, h), BF)}
            t |= {a + "f_b_proj.weight": ((nd, 128), BF), a + "o_proj.weight": ((h, nd), BF)}
            t |= {a + "A_log": ((96,), F32), a + "dt_bias": ((nd,), F32), a + "o_norm.weight": ((128,), BF)}
        else:
            t |= {a + "q_a_proj.weight": ((1536, h), BF), a + "q_a_layernorm.weight": ((1536,), BF)}
            t |= {a + "q_b_proj.weight": ((96 * 192, 1536), BF), a + "kv_a_proj_with_mqa.weight": ((576, h), BF)}
            t |= {a + "kv_a_layernorm.weight": ((512,), BF), a + "kv_b_proj.weight": ((96 * 256, 512), BF)}
            t |= {a + "g_proj.weight": ((nd, h), BF), a + "o_proj.weight": ((h, nd), BF)}
        if kind == "kda_dense":
            t |= {p + f"mlp.{x}_proj.weight": ((33792, h), BF) for x in ("gate", "up")}
            t |= {p + "mlp.down_proj.weight": ((h, 33792), BF)}
            continue
        m = p + "block_sparse_moe."
        t |= {m + "gate.weight": ((896, h), BF), m + "gate.e_score_correction_bias": ((896,), F32)}
        t |= {m + "routed_expert_down_proj.weight": ((lat, h), BF), m + "routed_expert_up_proj.weight": ((h, lat), BF)}
        t |= {m + "routed_expert_norm.weight": ((lat,), BF)}
        t |= {m + f"shared_experts.{x}_proj.weight": ((6144, h), BF) for x in ("gate", "up")}
        t |= {m + "shared_experts.down_proj.weight": ((h, 6144), BF)}
        for e in range(896):
            for w, (o, i) in (("w1", (fe, lat)), ("w3", (fe, lat)), ("w2", (lat, fe))):
                x = f"{m}experts.{e}.{w}."
                t |= {x + "weight_packed": ((o, i // 2), U8), x + "weight_scale": ((o, i // 32), U8)}
    return t


# ---- the DSpark drafter (specs/kimi_k3_dspark.mk): a Qwen3-style layer's names, no prefix
DSPARK = {
    "embed": ("embed_tokens.weight", False),
    "fc": ("fc.weight", True),
    "hidden_norm": ("hidden_norm.weight", False),
    "attn_norm": ("layers.{l}.input_layernorm.weight", False),
    "wq": ("layers.{l}.self_attn.q_proj.weight", True),
    "q_norm": ("layers.{l}.self_attn.q_norm.weight", False),
    "k_norm": ("layers.{l}.self_attn.k_norm.weight", False),
    "wo": ("layers.{l}.self_attn.o_proj.weight", True),
    "mlp_norm": ("layers.{l}.post_attention_layernorm.weight", False),
    "w_gate": ("layers.{l}.mlp.gate_proj.weight", True),
    "w_up": ("layers.{l}.mlp.up_proj.weight", True),
    "w_down": ("layers.{l}.mlp.down_proj.weight", True),
    "final_norm": ("norm.weight", False),
    "lm_head": ("lm_head.weight", True),
    "markov_w1": ("markov_w1.weight", False),
    "markov_w2": ("markov_w2.weight", False),
}


def dspark_tensors(weights: dict, layers: int, c: dict) -> dict:
    """The drafter's checkpoint; k and v keep one copy of each repeated head (the spec's `wk` holds
    each of the NKV heads REP times in a row)."""
    out = {}
    for w, (name, matrix) in DSPARK.items():
        for layer in range(layers) if "{l}" in name else [None]:
            x = np.asarray(weights[w] if layer is None else weights[w][layer])
            out[name.format(l=layer)] = _t(x) if matrix else np.ascontiguousarray(x)
    d, rep = c["D"], c["REP"]
    for layer in range(layers):
        for w, proj in (("wk", "k_proj"), ("wv", "v_proj")):
            heads = np.split(np.asarray(weights[w][layer]), c["NKVR"], axis=-1)
            out[f"layers.{layer}.self_attn.{proj}.weight"] = _t(np.concatenate(heads[::rep], axis=-1))
            assert heads[0].shape[-1] == d
    return out


def dspark_expected(weights: dict, c: dict) -> dict:
    """Loading repeats each stored head: every copy equals the first of its group."""
    out = dict(weights)
    for w in ("wk", "wv"):
        x = np.asarray(weights[w])
        heads = np.split(x, c["NKVR"], axis=-1)
        out[w] = np.concatenate([heads[h - h % c["REP"]] for h in range(len(heads))], axis=-1)
    return out


def dspark_header(layers: int) -> dict:
    """The full-size drafter checkpoint's header (facts/kimi_k3.md, "The DSpark drafter")."""
    h, v, f, q, kv = 7168, 163840, 14336, 96 * 64, 16 * 64
    t = {"embed_tokens.weight": ((v, h), BF), "lm_head.weight": ((v, h), BF), "norm.weight": ((h,), BF)}
    t |= {"fc.weight": ((h, 5 * h), BF), "hidden_norm.weight": ((h,), BF)}
    t |= {"markov_w1.weight": ((v, 256), BF), "markov_w2.weight": ((v, 256), BF)}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {p + n: ((h,), BF) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        t |= {p + "self_attn.q_proj.weight": ((q, h), BF), p + "self_attn.o_proj.weight": ((h, q), BF)}
        t |= {p + f"self_attn.{x}_proj.weight": ((kv, h), BF) for x in "kv"}
        t |= {p + f"self_attn.{x}_norm.weight": ((64,), BF) for x in "qk"}
        t |= {p + f"mlp.{x}_proj.weight": ((f, h), BF) for x in ("gate", "up")} | {
            p + "mlp.down_proj.weight": ((h, f), BF)
        }
    return t
