"""Synthetic checkpoints for the loader tests, written the way the real converters write them:
Hugging Face safetensors (matrices `[out, in]`, Llama names) and GGUF (llama.cpp names, q/k rows
permuted as llama.cpp's converter does, Q8_0 / Q4_1 blocks), from weights in the spec's layout.
Independent of mkdsl's loader: the names, the permutation and a numpy Q4_1/Q8_0 decoder are
written out here from the format descriptions, not taken from mkdsl."""

from __future__ import annotations

import numpy as np
from kimi_checkpoint import dspark_header, kimi_expected, kimi_header, kimi_tensors

# spec weight -> (Hugging Face name, GGUF name, is a matrix); `{l}` the layer index.
LLAMA_NAMES = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight", False),
    "attn_norm": ("model.layers.{l}.input_layernorm.weight", "blk.{l}.attn_norm.weight", False),
    "wq": ("model.layers.{l}.self_attn.q_proj.weight", "blk.{l}.attn_q.weight", True),
    "wk": ("model.layers.{l}.self_attn.k_proj.weight", "blk.{l}.attn_k.weight", True),
    "wv": ("model.layers.{l}.self_attn.v_proj.weight", "blk.{l}.attn_v.weight", True),
    "wo": ("model.layers.{l}.self_attn.o_proj.weight", "blk.{l}.attn_output.weight", True),
    "mlp_norm": ("model.layers.{l}.post_attention_layernorm.weight", "blk.{l}.ffn_norm.weight", False),
    "w_gate": ("model.layers.{l}.mlp.gate_proj.weight", "blk.{l}.ffn_gate.weight", True),
    "w_up": ("model.layers.{l}.mlp.up_proj.weight", "blk.{l}.ffn_up.weight", True),
    "w_down": ("model.layers.{l}.mlp.down_proj.weight", "blk.{l}.ffn_down.weight", True),
    "final_norm": ("model.norm.weight", "output_norm.weight", False),
    "lm_head": ("lm_head.weight", "output.weight", True),
}


def hf_tensors(weights: dict, layers: int) -> dict[str, np.ndarray]:
    """Spec-layout weights ([in, out] matrices, stacked over layers) as Hugging Face tensors."""
    out = {}
    for name, (hf, _, matrix) in LLAMA_NAMES.items():
        if name not in weights:
            continue  # a tied head: no lm_head weight
        w = np.asarray(weights[name])
        for layer in range(layers) if "{l}" in hf else [None]:
            x = w[layer] if layer is not None else w
            out[hf.format(l=layer)] = np.ascontiguousarray(x.T if matrix else x)
    return out


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: within each head, row s*d/2 + j goes to 2j + s."""
    out = np.empty_like(w)
    d = w.shape[0] // heads
    for h in range(heads):
        for s in range(2):
            for j in range(d // 2):
                out[h * d + 2 * j + s] = w[h * d + s * (d // 2) + j]
    return out


def gguf_tensors(weights: dict, layers: int, heads: int, kv_heads: int) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (f32 values in GGUF row order, GGUF type): matrices Q4_1, the embedding Q8_0
    (as in the SmolLM2 GGUF), norms F32; q/k permuted."""
    out = {}
    perm = {"wq": heads, "wk": kv_heads}
    for name, (_, gg, matrix) in LLAMA_NAMES.items():
        if name not in weights:
            continue  # a tied head: no output.weight (as in SmolLM2's GGUF)
        w = np.asarray(weights[name]).astype(np.float32)
        for layer in range(layers) if "{l}" in gg else [None]:
            x = w[layer] if layer is not None else w
            x = x.T if matrix else x
            if name in perm:
                x = llama_cpp_permute(x, perm[name])
            kind = "Q8_0" if name == "embed" else "Q4_1" if x.ndim == 2 else "F32"
            out[gg.format(l=layer)] = (np.ascontiguousarray(x), kind)
    return out


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, str]], block_count: int) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    for name, (x, kind) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        data = x if kind == "F32" else gguf.quants.quantize(x, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def decode_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> np.ndarray:
    """Q8_0 (f16 d, 32 int8 q: d*q) or Q4_1 (f16 d, f16 m, 16 bytes of nibbles: element j low,
    j+16 high; d*q + m) blocks of 32 along each row, decoded in f32."""
    rows, cols = shape
    b = np.asarray(raw, np.uint8).reshape(rows, cols // 32, -1)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return (d * b[..., 2:].view(np.int8).astype(np.float32)).reshape(shape)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(shape)


# ---------------------------------------------------------------------------- published HF layouts
# From spec-layout weights (random at a mini profile) to the tensors each model's published Hugging
# Face checkpoint holds, named and laid out as shared/facts/models.md describes them. Written out
# here, not derived from the specs' mappings: the loader must invert exactly these.


def slots(schedule, kind: str | None) -> dict[int, int]:
    """Layer -> slice of a weight stacked over the layers of `kind` (None: every layer)."""
    layers = [i for i, k in enumerate(schedule) if kind is None or k == kind]
    return {layer: s for s, layer in enumerate(layers)}


def _t(x) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(np.asarray(x), -1, -2))


def _plain(out: dict, weights: dict, schedule, names: dict) -> None:
    """`names`: spec weight -> (name pattern, kind or None, stored [out, in] i.e. transposed)."""
    for w, (pattern, kind, matrix) in names.items():
        if "{l}" not in pattern:
            out[pattern] = _t(weights[w]) if matrix else np.asarray(weights[w])
            continue
        for layer, s in slots(schedule, kind).items():
            x = weights[w][s]
            if "{e}" in pattern:
                for e in range(x.shape[0]):
                    out[pattern.format(l=layer, e=e)] = _t(x[e]) if matrix else x[e]
            else:
                out[pattern.format(l=layer)] = _t(x) if matrix else np.ascontiguousarray(x)


QWEN3_NAMES = {
    "embed": ("model.embed_tokens.weight", None, False),
    "attn_norm": ("model.layers.{l}.input_layernorm.weight", None, False),
    "wq": ("model.layers.{l}.self_attn.q_proj.weight", None, True),
    "wk": ("model.layers.{l}.self_attn.k_proj.weight", None, True),
    "wv": ("model.layers.{l}.self_attn.v_proj.weight", None, True),
    "q_norm": ("model.layers.{l}.self_attn.q_norm.weight", None, False),
    "k_norm": ("model.layers.{l}.self_attn.k_norm.weight", None, False),
    "wo": ("model.layers.{l}.self_attn.o_proj.weight", None, True),
    "mlp_norm": ("model.layers.{l}.post_attention_layernorm.weight", None, False),
    "router": ("model.layers.{l}.mlp.gate.weight", None, True),
    "w_gate": ("model.layers.{l}.mlp.experts.{e}.gate_proj.weight", None, True),
    "w_up": ("model.layers.{l}.mlp.experts.{e}.up_proj.weight", None, True),
    "w_down": ("model.layers.{l}.mlp.experts.{e}.down_proj.weight", None, True),
    "final_norm": ("model.norm.weight", None, False),
    "lm_head": ("lm_head.weight", None, True),
}


def qwen3_tensors(weights: dict, schedule, c: dict) -> dict:
    out = {}
    _plain(out, weights, schedule, QWEN3_NAMES)
    return out


# ---- DeepSeek-V3: fp8 e4m3 `.weight` [out, in] with f32 `.weight_scale_inv` [ceil(out/128), ceil(in/128)]

DSV3_PLAIN = {
    "embed": ("model.embed_tokens.weight", None, False),
    "attn_norm": ("model.layers.{l}.input_layernorm.weight", None, False),
    "mlp_norm": ("model.layers.{l}.post_attention_layernorm.weight", None, False),
    "final_norm": ("model.norm.weight", None, False),
    "lm_head": ("lm_head.weight", None, True),
    "q_norm": ("model.layers.{l}.self_attn.q_a_layernorm.weight", None, False),
    "kv_norm": ("model.layers.{l}.self_attn.kv_a_layernorm.weight", None, False),
    "router": ("model.layers.{l}.mlp.gate.weight", "moe", True),
    "router_bias": ("model.layers.{l}.mlp.gate.e_score_correction_bias", "moe", False),
}
DSV3_FP8 = {
    "wq_a": ("model.layers.{l}.self_attn.q_a_proj", None),
    "wq_b": ("model.layers.{l}.self_attn.q_b_proj", None),
    "wkv_a": ("model.layers.{l}.self_attn.kv_a_proj_with_mqa", None),
    "wo": ("model.layers.{l}.self_attn.o_proj", None),
    "dense_gate": ("model.layers.{l}.mlp.gate_proj", "dense"),
    "dense_up": ("model.layers.{l}.mlp.up_proj", "dense"),
    "dense_down": ("model.layers.{l}.mlp.down_proj", "dense"),
    "w_gate": ("model.layers.{l}.mlp.experts.{e}.gate_proj", "moe"),
    "w_up": ("model.layers.{l}.mlp.experts.{e}.up_proj", "moe"),
    "w_down": ("model.layers.{l}.mlp.experts.{e}.down_proj", "moe"),
    "shared_gate": ("model.layers.{l}.mlp.shared_experts.gate_proj", "moe"),
    "shared_up": ("model.layers.{l}.mlp.shared_experts.up_proj", "moe"),
    "shared_down": ("model.layers.{l}.mlp.shared_experts.down_proj", "moe"),
}


def fp8_blocks(w: np.ndarray, b: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """A [out, in] matrix as DeepSeek ships it: e4m3 codes and one f32 scale per [b, b] square
    (the edge squares zero-padded to find their largest entry), value = code * scale."""
    import ml_dtypes

    n, k = w.shape
    pad = np.zeros((-(-n // b) * b, -(-k // b) * b), np.float32)
    pad[:n, :k] = w
    amax = np.abs(pad.reshape(pad.shape[0] // b, b, pad.shape[1] // b, b)).max(axis=(1, 3))
    scales = (np.maximum(amax, 1e-30) / 448.0).astype(np.float32)
    full = np.repeat(np.repeat(scales, b, 0), b, 1)[:n, :k]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scales


def fp8_decode(codes: np.ndarray, scales: np.ndarray, b: int = 128) -> np.ndarray:
    n, k = codes.shape
    return codes.astype(np.float32) * np.repeat(np.repeat(scales, b, 0), b, 1)[:n, :k]


MTP = "model.layers.61."  # DeepSeek-V3's MTP head is stored as layer 61
DSV3_MTP_PLAIN = {
    "mtp_enorm": (MTP + "enorm.weight", False),
    "mtp_hnorm": (MTP + "hnorm.weight", False),
    "mtp_eh_proj": (MTP + "eh_proj.weight", True),
    "mtp_head_norm": (MTP + "shared_head.norm.weight", False),
    "mtp_attn_norm": (MTP + "input_layernorm.weight", False),
    "mtp_mlp_norm": (MTP + "post_attention_layernorm.weight", False),
    "mtp_q_norm": (MTP + "self_attn.q_a_layernorm.weight", False),
    "mtp_kv_norm": (MTP + "self_attn.kv_a_layernorm.weight", False),
    "mtp_router": (MTP + "mlp.gate.weight", True),
    "mtp_router_bias": (MTP + "mlp.gate.e_score_correction_bias", False),
}


def _deepseek_mtp(weights: dict) -> dict:
    """The MTP head's tensors (`mtp_*`): its norms and projection, and a MoE layer's tensors."""
    out = {name: _t(weights[w]) if matrix else np.asarray(weights[w]) for w, (name, matrix) in DSV3_MTP_PLAIN.items()}
    for w, (prefix, kind) in (DSV3_FP8 | {"wkv_b": ("model.layers.{l}.self_attn.kv_b_proj", None)}).items():
        if kind == "dense":
            continue
        q, prefix = weights["mtp_" + w], prefix.replace("model.layers.{l}.", MTP)
        for e in range(q.codes.shape[0]) if "{e}" in prefix else [None]:
            index = () if e is None else (e,)
            out[prefix.format(e=e) + ".weight"] = _t(q.codes[index])
            out[prefix.format(e=e) + ".weight_scale_inv"] = _t(q.scales[index])
    return out


def deepseek_tensors(weights: dict, schedule, c: dict) -> dict:
    """wkv_b, if bf16 in the spec, is stored as the checkpoint stores kv_b_proj: fp8 blocks."""
    from mkdsl.lang.quant import QTensor

    out = {}
    _plain(out, weights, schedule, DSV3_PLAIN)
    fp8 = dict(DSV3_FP8)
    if isinstance(weights["wkv_b"], QTensor):
        fp8["wkv_b"] = ("model.layers.{l}.self_attn.kv_b_proj", None)
    for w, (prefix, kind) in fp8.items():
        q = weights[w]
        for layer, s in slots(schedule, kind).items():
            for e in range(q.codes.shape[1]) if "{e}" in prefix else [None]:
                index = (s,) if e is None else (s, e)
                name = prefix.format(l=layer, e=e)
                out[name + ".weight"] = _t(q.codes[index])
                out[name + ".weight_scale_inv"] = _t(q.scales[index])
    for layer in range(len(schedule)) if "wkv_b" not in fp8 else ():
        name = f"model.layers.{layer}.self_attn.kv_b_proj"
        out[name + ".weight"], out[name + ".weight_scale_inv"] = fp8_blocks(
            _t(weights["wkv_b"][layer]).astype(np.float32)
        )
    if "mtp_enorm" in weights:
        out |= _deepseek_mtp(weights)
    return out


# ---- gpt-oss: experts fused per layer, MXFP4 `*_blocks` uint8 [E, out, in/32, 16] (byte b of
# block g: input 32g+2b low nibble, 32g+2b+1 high) and `*_scales` uint8 [E, out, in/32]; gate_up
# rows interleave gate (even) and up (odd)

OSS_PLAIN = {
    "embed": ("model.embed_tokens.weight", None, False),
    "attn_norm": ("model.layers.{l}.input_layernorm.weight", None, False),
    "wq": ("model.layers.{l}.self_attn.q_proj.weight", None, True),
    "bq": ("model.layers.{l}.self_attn.q_proj.bias", None, False),
    "wk": ("model.layers.{l}.self_attn.k_proj.weight", None, True),
    "bk": ("model.layers.{l}.self_attn.k_proj.bias", None, False),
    "wv": ("model.layers.{l}.self_attn.v_proj.weight", None, True),
    "bv": ("model.layers.{l}.self_attn.v_proj.bias", None, False),
    "sinks": ("model.layers.{l}.self_attn.sinks", None, False),
    "wo": ("model.layers.{l}.self_attn.o_proj.weight", None, True),
    "bo": ("model.layers.{l}.self_attn.o_proj.bias", None, False),
    "mlp_norm": ("model.layers.{l}.post_attention_layernorm.weight", None, False),
    "router": ("model.layers.{l}.mlp.router.weight", None, True),
    "router_b": ("model.layers.{l}.mlp.router.bias", None, False),
    "b2": ("model.layers.{l}.mlp.experts.down_proj_bias", None, False),
    "final_norm": ("model.norm.weight", None, False),
    "lm_head": ("lm_head.weight", None, True),
}


def mxfp4_nibbles(codes: np.ndarray) -> np.ndarray:
    """mkdsl's mxfp4 codes, uint32 [..., K/8, N] (8 nibbles a word, the lowest input first), as
    nibbles [..., K, N]."""
    words = np.asarray(codes, np.uint32)
    nib = np.stack([(words >> (4 * i)) & 15 for i in range(8)], axis=-2)  # [..., K/8, 8, N]
    return nib.reshape(*words.shape[:-2], words.shape[-2] * 8, words.shape[-1]).astype(np.uint8)


def openai_blocks(nib: np.ndarray) -> np.ndarray:
    """Nibbles [..., out, in] -> OpenAI's blocks uint8 [..., out, in/32, 16]."""
    pairs = nib.reshape(*nib.shape[:-1], nib.shape[-1] // 32, 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def _interleave(gate: np.ndarray, up: np.ndarray, axis: int) -> np.ndarray:
    return np.stack([gate, up], axis=axis + 1).reshape(*gate.shape[:axis], -1, *gate.shape[axis + 1 :])


def oss_tensors(weights: dict, schedule, c: dict) -> dict:
    out = {}
    _plain(out, weights, schedule, OSS_PLAIN)
    for layer in range(len(schedule)):
        p = f"model.layers.{layer}.mlp.experts."
        g, u, d = (weights[w] for w in ("w1", "w3", "w2"))
        nib_gu = _interleave(_t(mxfp4_nibbles(g.codes[layer])), _t(mxfp4_nibbles(u.codes[layer])), 1)
        out[p + "gate_up_proj_blocks"] = openai_blocks(nib_gu)
        out[p + "gate_up_proj_scales"] = _interleave(_t(g.scales[layer]), _t(u.scales[layer]), 1)
        out[p + "gate_up_proj_bias"] = _interleave(weights["b1"][layer], weights["b3"][layer], 1)
        out[p + "down_proj_blocks"] = openai_blocks(_t(mxfp4_nibbles(d.codes[layer])))
        out[p + "down_proj_scales"] = _t(d.scales[layer])
    return out


# ---- Qwen3-Next: in_proj_qkvz / in_proj_ba grouped per key head, conv1d over [q | k | v]

QNEXT_PLAIN = {
    "embed": ("model.embed_tokens.weight", None, False),
    "lm_head": ("lm_head.weight", None, True),
    "final_norm": ("model.norm.weight", None, False),
    "input_norm": ("model.layers.{l}.input_layernorm.weight", None, False),
    "post_norm": ("model.layers.{l}.post_attention_layernorm.weight", None, False),
    "gdn_a_log": ("model.layers.{l}.linear_attn.A_log", "gdn", False),
    "gdn_dt_bias": ("model.layers.{l}.linear_attn.dt_bias", "gdn", False),
    "gdn_norm": ("model.layers.{l}.linear_attn.norm.weight", "gdn", False),
    "gdn_wo": ("model.layers.{l}.linear_attn.out_proj.weight", "gdn", True),
    "attn_wk": ("model.layers.{l}.self_attn.k_proj.weight", "full_attn", True),
    "attn_wv": ("model.layers.{l}.self_attn.v_proj.weight", "full_attn", True),
    "attn_qnorm": ("model.layers.{l}.self_attn.q_norm.weight", "full_attn", False),
    "attn_knorm": ("model.layers.{l}.self_attn.k_norm.weight", "full_attn", False),
    "attn_wo": ("model.layers.{l}.self_attn.o_proj.weight", "full_attn", True),
    "moe_router": ("model.layers.{l}.mlp.gate.weight", None, True),
    "moe_w1": ("model.layers.{l}.mlp.experts.{e}.gate_proj.weight", None, True),
    "moe_w3": ("model.layers.{l}.mlp.experts.{e}.up_proj.weight", None, True),
    "moe_w2": ("model.layers.{l}.mlp.experts.{e}.down_proj.weight", None, True),
    "shared_gate": ("model.layers.{l}.mlp.shared_expert.gate_proj.weight", None, True),
    "shared_up": ("model.layers.{l}.mlp.shared_expert.up_proj.weight", None, True),
    "shared_down": ("model.layers.{l}.mlp.shared_expert.down_proj.weight", None, True),
}


def qwen3_next_tensors(weights: dict, schedule, c: dict) -> dict:
    """Per key head g: in_proj_qkvz rows [q_g | k_g | v_2g, v_2g+1 | z_2g, z_2g+1], in_proj_ba
    rows [b_2g, b_2g+1, a_2g, a_2g+1]; per attention head h, q_proj rows [query_h | gate_h]."""
    out = {}
    _plain(out, weights, schedule, QNEXT_PLAIN)
    nk, nv, dk, dv, nh, hd = c["NK"], c["NV"], c["DK"], c["DV"], c["NH"], c["HD"]
    r = nv // nk  # value heads per key head
    for layer, s in slots(schedule, "gdn").items():
        p = f"model.layers.{layer}.linear_attn."
        q, k, v, z = (_t(weights[w][s]) for w in ("gdn_wq", "gdn_wk", "gdn_wv", "gdn_wz"))
        groups = [
            (
                q[g * dk : (g + 1) * dk],
                k[g * dk : (g + 1) * dk],
                v[g * r * dv : (g + 1) * r * dv],
                z[g * r * dv : (g + 1) * r * dv],
            )
            for g in range(nk)
        ]
        out[p + "in_proj_qkvz.weight"] = np.concatenate([x for grp in groups for x in grp])
        ba = _t(weights["gdn_wba"][s])  # rows: b_0 .. b_{nv-1}, a_0 .. a_{nv-1}, zero padding
        out[p + "in_proj_ba.weight"] = np.concatenate(
            [np.concatenate([ba[g * r : (g + 1) * r], ba[nv + g * r : nv + (g + 1) * r]]) for g in range(nk)]
        )
        conv = np.concatenate([_t(weights[w][s]) for w in ("gdn_conv_q", "gdn_conv_k", "gdn_conv_v")])
        out[p + "conv1d.weight"] = np.ascontiguousarray(conv[:, None, :])
    for layer, s in slots(schedule, "full_attn").items():
        wq, wg = _t(weights["attn_wq"][s]), _t(weights["attn_wg"][s])
        heads = [x for h in range(nh) for x in (wq[h * hd : (h + 1) * hd], wg[h * hd : (h + 1) * hd])]
        out[f"model.layers.{layer}.self_attn.q_proj.weight"] = np.concatenate(heads)
    for layer in range(len(schedule)):
        out[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] = np.asarray(weights["shared_egate"][layer])[None]
    return out


PUBLISHED = {
    "kimi_k3": kimi_tensors,
    "qwen3_30b_a3b": qwen3_tensors,
    "deepseek_v3": deepseek_tensors,
    "gpt_oss_120b": oss_tensors,
    "qwen3_next_80b_a3b": qwen3_next_tensors,
}


def expected_weights(spec_name: str, weights: dict, tensors: dict, c: dict) -> dict:
    """What loading the published layout must give: the weights themselves, except where the
    checkpoint holds something else (DeepSeek's kv_b_proj: fp8, decoded into bf16; Qwen3-Next's
    [beta | a] padding columns, which the checkpoint lacks: zeros)."""
    import ml_dtypes

    from mkdsl.lang.quant import QTensor

    out = dict(weights) if spec_name != "kimi_k3" else kimi_expected(weights, c)
    if spec_name == "deepseek_v3" and not isinstance(weights["wkv_b"], QTensor):
        rows = []
        for layer in range(weights["wkv_b"].shape[0]):
            name = f"model.layers.{layer}.self_attn.kv_b_proj"
            rows.append(fp8_decode(tensors[name + ".weight"], tensors[name + ".weight_scale_inv"]).T)
        out["wkv_b"] = np.stack(rows).astype(ml_dtypes.bfloat16)
    if spec_name == "qwen3_next_80b_a3b":
        ba = np.array(weights["gdn_wba"])
        ba[..., 2 * c["NV"] :] = 0
        out["gdn_wba"] = ba
    return out


def write_sharded(root, base, extra: dict, in_base: set) -> object:
    """A sharded checkpoint in `root`: `base` (a safetensors file of the tensors `in_base`, linked,
    not copied) and the `extra` tensors in a second file, with the index naming each one's file."""
    import json

    from safetensors.numpy import save_file

    (root / "model-00001-of-00002.safetensors").symlink_to(base)
    save_file(extra, str(root / "model-00002-of-00002.safetensors"))
    index = {n: "model-00001-of-00002.safetensors" for n in in_base}
    index |= {n: "model-00002-of-00002.safetensors" for n in extra}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return root


def same_weight(got, want) -> bool:
    """Equal dtype, shape and bytes (so fp8 codes and NaNs compare too); a QTensor part by part."""
    from mkdsl.lang.quant import QTensor

    if isinstance(want, QTensor):
        return (
            isinstance(got, QTensor)
            and (got.fmt, got.group) == (want.fmt, want.group)
            and same_weight(got.codes, want.codes)
            and same_weight(got.scales, want.scales)
        )
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def through_checkpoint(model, weights: dict, root) -> dict:
    """`weights` (spec layout) written as the model's published Hugging Face checkpoint in `root`
    and loaded back by the spec's mapping (host arrays): what a kernel test then runs on. They
    equal `weights` bit for bit but where the checkpoint holds something else (`expected_weights`)."""
    from pathlib import Path

    from safetensors.numpy import save_file

    import mkdsl

    tensors = PUBLISHED[model.name](weights, model.schedule, model.const)
    save_file(tensors, str(Path(root) / "model.safetensors"))
    loaded, _ = mkdsl.load_weights(model, root, host=True, progress=False)
    want = expected_weights(model.name, weights, tensors, model.const)
    bad = [n for n in want if not same_weight(loaded[n], want[n])]
    assert not bad, f"{model.name}: loaded differently from the checkpoint's tensors: {bad}"
    return loaded


def demo_tensors(weights: dict, c: dict) -> dict:
    """docs/language.md's `checkpoint_demo`, as its prose says the checkpoint stores it."""
    out = {"embed.weight": np.asarray(weights["embed"]), "lm_head.weight": _t(weights["lm_head"])}
    nh, d, f = c["NH"], c["D"], c["F"]
    for layer in range(c["L"]):
        p = f"layers.{layer}."
        out[p + "norm.weight"] = np.asarray(weights["norm"][layer])[None]
        q, k = _t(weights["wq"][layer]), _t(weights["wk"][layer])
        out[p + "qk.weight"] = np.concatenate(
            [x for h in range(nh) for x in (q[h * d : (h + 1) * d], k[h * d : (h + 1) * d])]
        )
        g, u = weights["w_gate"], weights["w_up"]
        nib = _interleave(_t(mxfp4_nibbles(g.codes[layer])), _t(mxfp4_nibbles(u.codes[layer])), 0)
        assert nib.shape[0] == 2 * f
        out[p + "gate_up.blocks"] = openai_blocks(nib)
        out[p + "gate_up.scales"] = _interleave(_t(g.scales[layer]), _t(u.scales[layer]), 0)
        out[p + "down.weight"] = _t(weights["w_down"].codes[layer])
        out[p + "down.weight_scale_inv"] = _t(weights["w_down"].scales[layer])
    return out


# ---------------------------------------------------------------------------- published headers
# The full-size checkpoints' tensor names, shapes and stored types, as shared/facts/models.md
# tabulates them (per layer kind where the layers differ), for a header-only plan of each spec.

BF, F8, F32, U8 = "BF16", "F8_E4M3", "F32", "U8"


def _fp8(name: str, out: int, inp: int) -> dict:
    return {name + ".weight": ((out, inp), F8), name + ".weight_scale_inv": ((-(-out // 128), -(-inp // 128)), F32)}


def _dsv3_layer(p: str, kind: str) -> dict:
    t = {p + "input_layernorm.weight": ((7168,), BF), p + "post_attention_layernorm.weight": ((7168,), BF)}
    t |= _fp8(p + "self_attn.q_a_proj", 1536, 7168) | {p + "self_attn.q_a_layernorm.weight": ((1536,), BF)}
    t |= _fp8(p + "self_attn.q_b_proj", 24576, 1536) | _fp8(p + "self_attn.kv_a_proj_with_mqa", 576, 7168)
    t |= {p + "self_attn.kv_a_layernorm.weight": ((512,), BF)} | _fp8(p + "self_attn.kv_b_proj", 32768, 512)
    t |= _fp8(p + "self_attn.o_proj", 7168, 16384)
    if kind == "dense":
        return (
            t
            | _fp8(p + "mlp.gate_proj", 18432, 7168)
            | _fp8(p + "mlp.up_proj", 18432, 7168)
            | _fp8(p + "mlp.down_proj", 7168, 18432)
        )
    t |= {p + "mlp.gate.weight": ((256, 7168), BF), p + "mlp.gate.e_score_correction_bias": ((256,), F32)}
    for e in [f"experts.{i}" for i in range(256)] + ["shared_experts"]:
        t |= _fp8(f"{p}mlp.{e}.gate_proj", 2048, 7168) | _fp8(f"{p}mlp.{e}.up_proj", 2048, 7168)
        t |= _fp8(f"{p}mlp.{e}.down_proj", 7168, 2048)
    return t


def _oss_layer(p: str, kind: str) -> dict:
    t = {p + "input_layernorm.weight": ((2880,), BF), p + "post_attention_layernorm.weight": ((2880,), BF)}
    for proj, out in (("q_proj", 4096), ("k_proj", 512), ("v_proj", 512)):
        t |= {f"{p}self_attn.{proj}.weight": ((out, 2880), BF), f"{p}self_attn.{proj}.bias": ((out,), BF)}
    t |= {p + "self_attn.o_proj.weight": ((2880, 4096), BF), p + "self_attn.o_proj.bias": ((2880,), BF)}
    t |= {
        p + "self_attn.sinks": ((64,), BF),
        p + "mlp.router.weight": ((128, 2880), BF),
        p + "mlp.router.bias": ((128,), BF),
    }
    for proj, out in (("gate_up_proj", 5760), ("down_proj", 2880)):
        x = f"{p}mlp.experts.{proj}"
        t |= {
            x + "_blocks": ((128, out, 90, 16), U8),
            x + "_scales": ((128, out, 90), U8),
            x + "_bias": ((128, out), BF),
        }
    return t


def _qwen_moe(p: str, experts: int, width: int, shared: bool) -> dict:
    t = {p + "mlp.gate.weight": ((experts, 2048), BF)}
    for e in [f"experts.{i}" for i in range(experts)] + (["shared_expert"] if shared else []):
        t |= {f"{p}mlp.{e}.{g}_proj.weight": ((width, 2048), BF) for g in ("gate", "up")}
        t |= {f"{p}mlp.{e}.down_proj.weight": ((2048, width), BF)}
    return t | ({p + "mlp.shared_expert_gate.weight": ((1, 2048), BF)} if shared else {})


def _qnext_layer(p: str, kind: str) -> dict:
    t = {p + "input_layernorm.weight": ((2048,), BF), p + "post_attention_layernorm.weight": ((2048,), BF)}
    if kind == "gdn":
        a = p + "linear_attn."
        t |= {a + "in_proj_qkvz.weight": ((12288, 2048), BF), a + "in_proj_ba.weight": ((64, 2048), BF)}
        t |= {a + "conv1d.weight": ((8192, 1, 4), BF), a + "dt_bias": ((32,), BF), a + "A_log": ((32,), F32)}
        t |= {a + "norm.weight": ((128,), BF), a + "out_proj.weight": ((2048, 4096), BF)}
    else:
        a = p + "self_attn."
        t |= {a + "q_proj.weight": ((8192, 2048), BF), a + "k_proj.weight": ((512, 2048), BF)}
        t |= {a + "v_proj.weight": ((512, 2048), BF), a + "o_proj.weight": ((2048, 4096), BF)}
        t |= {a + "q_norm.weight": ((256,), BF), a + "k_norm.weight": ((256,), BF)}
    return t | _qwen_moe(p, 512, 512, True)


def _qwen3_layer(p: str, kind: str) -> dict:
    t = {p + "input_layernorm.weight": ((2048,), BF), p + "post_attention_layernorm.weight": ((2048,), BF)}
    a = p + "self_attn."
    t |= {a + "q_proj.weight": ((4096, 2048), BF), a + "k_proj.weight": ((512, 2048), BF)}
    t |= {a + "v_proj.weight": ((512, 2048), BF), a + "o_proj.weight": ((2048, 4096), BF)}
    t |= {a + "q_norm.weight": ((128,), BF), a + "k_norm.weight": ((128,), BF)}
    return t | _qwen_moe(p, 128, 768, False)


# model -> (globals (vocabulary, hidden), per-layer tensors)
HEADERS = {
    "deepseek_v3": ((129280, 7168), _dsv3_layer),
    "gpt_oss_120b": ((201088, 2880), _oss_layer),
    "qwen3_next_80b_a3b": ((151936, 2048), _qnext_layer),
    "qwen3_30b_a3b": ((151936, 2048), _qwen3_layer),
}


def published_header(name: str, schedule) -> dict:
    """Tensor name -> (shape, stored type) of the full-size published checkpoint."""
    if name == "kimi_k3":
        return kimi_header(schedule)
    if name == "kimi_k3_dspark":
        return dspark_header(len(schedule))
    (vocab, hidden), layer = HEADERS[name]
    out = {"model.embed_tokens.weight": ((vocab, hidden), BF), "lm_head.weight": ((vocab, hidden), BF)}
    out["model.norm.weight"] = ((hidden,), BF)
    for i, kind in enumerate(schedule):
        out |= layer(f"model.layers.{i}.", kind)
    if name == "deepseek_v3":  # the MTP head, layer 61: a MoE layer and its own norms and projection
        out |= _dsv3_layer("model.layers.61.", "moe") | {"model.layers.61.eh_proj.weight": ((7168, 14336), BF)}
        out |= {f"model.layers.61.{n}.weight": ((7168,), BF) for n in ("enorm", "hnorm", "shared_head.norm")}
    return out


# ---- dequantised saves (transformers' bf16 save of a quantised model): no scales, bf16 values


def _e2m1(nib: np.ndarray) -> np.ndarray:
    mag = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)[nib & 7]
    return np.where(nib & 8, -mag, mag)


def openai_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 blocks [..., out, in/32, 16] and E8M0 scales [..., out, in/32] -> f32 [..., out, in]."""
    nib = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = _e2m1(nib) * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return values.reshape(*values.shape[:-2], -1)


def dequantised_save(name: str, tensors: dict) -> dict:
    """The published tensors of `name` as a dequantised bf16 save stores them: DeepSeek-V3's fp8
    `.weight` decoded with its `.weight_scale_inv` (which goes); gpt-oss's experts as
    `gate_up_proj` [E, H, 2F] and `down_proj` [E, F, H] ([in, out], no blocks or scales)."""
    import ml_dtypes

    out = dict(tensors)
    for n in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        codes = out.pop(n[: -len("_scale_inv")])
        out[n[: -len("_scale_inv")]] = fp8_decode(codes, out.pop(n)).astype(ml_dtypes.bfloat16)
    for n in [n for n in tensors if n.endswith("_blocks")]:
        values = openai_decode(out.pop(n), out.pop(n[: -len("_blocks")] + "_scales"))
        out[n[: -len("_blocks")]] = np.ascontiguousarray(np.swapaxes(values, -1, -2)).astype(ml_dtypes.bfloat16)
    return out
