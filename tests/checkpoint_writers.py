"""Synthetic checkpoints for the loader tests, written the way the real converters write them:
Hugging Face safetensors (matrices `[out, in]`, Llama names) and GGUF (llama.cpp names, q/k rows
permuted as llama.cpp's converter does, Q8_0 / Q4_1 blocks), from weights in the spec's layout.
Independent of mkdsl's loader: the names, the permutation and a numpy Q4_1/Q8_0 decoder are
written out here from the format descriptions, not taken from mkdsl."""

from __future__ import annotations

import numpy as np

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
