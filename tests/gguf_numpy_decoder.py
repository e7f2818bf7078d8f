"""An independent decoder of a Llama-architecture GGUF in plain numpy (f32), written from the
format description, not from mkdsl: tensors decoded from their Q8_0/Q4_1 blocks in llama.cpp's
own layout (q/k rows left permuted, so rope rotates adjacent pairs (2i, 2i+1), as llama.cpp
does), sizes from the GGUF's metadata, the output head tied to token_embd when the file has no
output.weight."""

from __future__ import annotations

import numpy as np
from checkpoint_writers import decode_blocks


class GGUFDecoder:
    def __init__(self, path, seq_len: int):
        import gguf

        r = gguf.GGUFReader(str(path))
        meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
        arch = meta["general.architecture"]
        self.layers = int(meta[f"{arch}.block_count"])
        self.heads = int(meta[f"{arch}.attention.head_count"])
        self.kv_heads = int(meta[f"{arch}.attention.head_count_kv"])
        self.eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
        self.theta = float(meta[f"{arch}.rope.freq_base"])
        self.w = {t.name: _decode(t) for t in r.tensors}
        self.head = self.w.get("output.weight", self.w["token_embd.weight"])
        self.d = self.w["blk.0.attn_q.weight"].shape[0] // self.heads
        kv = (self.layers, self.kv_heads, seq_len, self.d)
        self.k, self.v = np.zeros(kv, np.float32), np.zeros(kv, np.float32)

    def _rms(self, x, name):
        return x / np.sqrt(np.mean(x * x) + self.eps) * self.w[name]

    def _rope(self, x, pos):
        """Adjacent pairs (2i, 2i+1) of each head rotate by pos * theta^(-2i/d)."""
        x = x.reshape(-1, self.d // 2, 2)
        ang = pos * self.theta ** (-np.arange(0, self.d, 2, dtype=np.float64) / self.d)
        c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        a, b = x[..., 0], x[..., 1]
        return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(-1, self.d)

    def step(self, token: int, pos: int) -> np.ndarray:
        """One token through every layer at `pos` (caches updated); the logits."""
        x = self.w["token_embd.weight"][token].astype(np.float32)
        group = self.heads // self.kv_heads
        for i in range(self.layers):
            b = f"blk.{i}."
            h = self._rms(x, b + "attn_norm.weight")
            q = self._rope(self.w[b + "attn_q.weight"] @ h, pos)
            self.k[i, :, pos] = self._rope(self.w[b + "attn_k.weight"] @ h, pos)
            self.v[i, :, pos] = (self.w[b + "attn_v.weight"] @ h).reshape(self.kv_heads, self.d)
            out = np.empty_like(q)
            for hd in range(self.heads):
                keys, values = self.k[i, hd // group, : pos + 1], self.v[i, hd // group, : pos + 1]
                s = keys @ q[hd] / np.sqrt(self.d)
                p = np.exp(s - s.max())
                out[hd] = (p / p.sum()) @ values
            x = x + self.w[b + "attn_output.weight"] @ out.reshape(-1)
            h = self._rms(x, b + "ffn_norm.weight")
            g, u = self.w[b + "ffn_gate.weight"] @ h, self.w[b + "ffn_up.weight"] @ h
            x = x + self.w[b + "ffn_down.weight"] @ (g / (1 + np.exp(-g)) * u)
        return self.head @ self._rms(x, "output_norm.weight")


def _decode(t) -> np.ndarray:
    shape = tuple(int(n) for n in reversed(t.shape))
    kind = t.tensor_type.name
    if kind == "F32":
        return np.asarray(t.data, np.float32).reshape(shape)
    return decode_blocks(t.data, kind, shape)
