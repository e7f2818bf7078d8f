"""Kimi K3's DSpark drafter for `verify --against transformers`: transformers has no drafter class,
so `KimiK3DSparkForCausalLM` (the spec's `architecture`) is built here from transformers' Qwen3
modules, which are the drafter's layers: `Qwen3DecoderLayer` whole (pre-norm `Qwen3Attention` with
its per-head q and k `Qwen3RMSNorm`s and rotate-half RoPE, pre-norm `Qwen3MLP`, residual adds),
`Qwen3RotaryEmbedding`, `Qwen3RMSNorm` for the final norm and `hidden_norm`, an embedding and an
output head. Only what no transformers model has is mkdsl's glue (said in the report, `NOTES`):

* the context: `fc` (a linear map of the target's concatenated hidden states) then `hidden_norm`;
* each layer's context keys and values, from that layer's own modules (`k_proj`, `k_norm`,
  transformers' `apply_rotary_pos_emb` at the context rows' positions; `v_proj`), kept per layer
  with their positions (`ContextCache`, which the attention reads as its `cache`: the context's
  keys and values before the block's own, which it never keeps);
* the mask: context positions below the anchor's and within the window, causal in the block;
* the Markov bias `markov_w2(markov_w1[previous token])` and the left-to-right argmax.

The attention itself is transformers' `eager_attention_forward`, registered under `ATTENTION` with
three identity modules around it (`roped_q`, `roped_k`, `attended`): the oracle's trace records
module outputs only, and so it also sees the rotated queries, the block's rotated keys and the
attention's output, which the spec computes as values of their own (`rope`, `block_attention`): a
spec that differs there is named at that op, not at the nearest value transformers happens to show.

Its parameter names are the spec's mapping's (the published drafter checkpoint's), so the save is
its state dict as it is. The drafter's step is a block reading a context, not a prefill and
decode steps: `compare` (mkdsl/verify/draft_step.py) compares it step by step.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np

from mkdsl.lang.ir import Model

BASE = "transformers' Qwen3 decoder layers with the DSpark drafter's glue (mkdsl/verify/dspark.py)"

NOTES = (
    "transformers' modules: Qwen3DecoderLayer (Qwen3Attention with its q/k norms, Qwen3MLP, "
    "Qwen3RMSNorm), Qwen3RotaryEmbedding, the embedding and output head",
    "mkdsl's glue (no transformers form): fc and hidden_norm over the target's hidden states, each "
    "layer's context keys/values (its own k_proj, k_norm and RoPE at the context positions, v_proj) "
    "cached before the block's own, the window and causal mask, the Markov bias and its "
    "left-to-right argmax",
)

ATTENTION = "mkdsl_dspark_eager"  # transformers' eager attention with the traced identities
_DRAFTER_FIELDS = ("aux_hidden_state_layer_ids", "sliding_window", "markov_rank", "mask_token_id")


def _context_cache():
    """The context cache class (defined here so that mkdsl imports without torch)."""
    import torch
    from transformers.models.qwen3 import modeling_qwen3 as q3

    class ContextCache:
        """Per layer, the context rows' keys and values [1, kv_heads, n, d] and positions [n];
        `update` (the attention's cache call) puts them before the block's keys and values."""

        def __init__(self, layers: int):
            self.k, self.v = [None] * layers, [None] * layers
            self.pos = [torch.zeros(0, dtype=torch.long) for _ in range(layers)]

        def write(self, i, attn, c, positions, rotary) -> None:
            if not len(positions):
                return
            shape = (1, len(positions), -1, attn.head_dim)
            k = attn.k_norm(attn.k_proj(c).view(shape)).transpose(1, 2)
            v = attn.v_proj(c).view(shape).transpose(1, 2)
            cos, sin = rotary(c, positions[None])
            _, k = q3.apply_rotary_pos_emb(k, k, cos, sin)
            self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], dim=2)
            self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], dim=2)
            self.pos[i] = torch.cat([self.pos[i], positions])

        def update(self, k, v, layer_idx, **_):
            if self.k[layer_idx] is None:
                return k, v
            return torch.cat([self.k[layer_idx], k], dim=2), torch.cat([self.v[layer_idx], v], dim=2)

        def mask(self, i, positions, window: int):
            """Additive [1, 1, B, n + B]: context positions in (anchor - window, anchor), then causal."""
            anchor, rows = positions[0], len(positions)
            seen = (self.pos[i] < anchor) & (self.pos[i] > anchor - window)
            allowed = torch.cat([seen[None].expand(rows, -1), torch.ones(rows, rows, dtype=torch.bool).tril()], dim=1)
            blocked = torch.full(allowed.shape, torch.finfo(torch.float32).min)
            return torch.where(allowed, 0.0, blocked)[None, None]

    return ContextCache


def _traced_eager(module, query, key, value, attention_mask, **kwargs):
    """transformers' eager attention, its rotated queries, the block's rotated keys (the last rows)
    and its output passed through the attention's identity modules, [1, B, heads, d] each."""
    from transformers.models.qwen3 import modeling_qwen3 as q3

    rows = query.shape[2]
    module.roped_q(query.transpose(1, 2))
    module.roped_k(key[:, :, -rows:].transpose(1, 2))
    out, weights = q3.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return module.attended(out), weights


def _drafter():
    """The stand-in's module class (defined here so that mkdsl imports without torch)."""
    import torch
    from torch import nn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3 import modeling_qwen3 as q3

    ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _traced_eager)
    context_cache = _context_cache()

    class DSparkDrafter(nn.Module):
        """The drafter (module docstring); `forward` runs one step and keeps the context cache."""

        def __init__(self, config, window: int, rank: int, context_layers: int):
            super().__init__()
            h, vocab, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
            self.config, self.window = config, window
            self.embed_tokens = nn.Embedding(vocab, h)
            self.fc = nn.Linear(context_layers * h, h, bias=False)
            self.hidden_norm = q3.Qwen3RMSNorm(h, eps)
            self.layers = nn.ModuleList(q3.Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
            for layer in self.layers:
                attn = layer.self_attn
                attn.roped_q, attn.roped_k, attn.attended = nn.Identity(), nn.Identity(), nn.Identity()
            self.norm = q3.Qwen3RMSNorm(h, eps)
            self.rotary_emb = q3.Qwen3RotaryEmbedding(config)
            self.lm_head = nn.Linear(h, vocab, bias=False)
            self.markov_w1 = nn.Embedding(vocab, rank)
            self.markov_w2 = nn.Linear(rank, vocab, bias=False)
            self.reset()

        def reset(self) -> None:
            self.cache = context_cache(len(self.layers))

        def forward(self, input_ids, position_ids, context, context_positions, use_cache=False):
            """One step: input_ids, position_ids [1, B] (the anchor, then mask tokens), context
            [1, B, NC * H] and context_positions [B] (-1: no row). Returns logits [1, B, V] and
            drafts [B]."""
            c = self.hidden_norm(self.fc(context))
            keep = context_positions >= 0
            rows = c[:, keep]
            rotary = self.rotary_emb(c, position_ids)
            x = self.embed_tokens(input_ids)
            for i, layer in enumerate(self.layers):
                self.cache.write(i, layer.self_attn, rows, context_positions[keep], self.rotary_emb)
                mask = self.cache.mask(i, position_ids[0], self.window)
                x = layer(x, attention_mask=mask, position_embeddings=rotary, cache=self.cache)
            logits = self.lm_head(self.norm(x))
            return types.SimpleNamespace(logits=logits, drafts=self.draft(logits[0], int(input_ids[0, 0])))

        def markov_scores(self, logits, previous):
            """Each row's logits plus the Markov bias of its previous token: [B, V]."""
            return logits + self.markov_w2(self.markov_w1(previous))

        def draft(self, logits, anchor: int) -> list[int]:
            """Left to right: draft r the argmax of row r's biased scores, the previous token
            the anchor before row 0 and draft r - 1 after it."""
            out, previous = [], anchor
            for row in logits:
                scores = self.markov_scores(row[None], torch.tensor([previous]))[0]
                previous = int(scores.argmax())
                out.append(previous)
            return out

    return DSparkDrafter


def build(model: Model, fields: dict):
    """The stand-in (module docstring), f32, parameters as initialised."""
    import torch
    from transformers import Qwen3Config

    from mkdsl.verify.transformers import OracleError

    fields = dict(fields)
    layer = fields.pop("transformer_layer_config", None)
    drafter = {k: fields.pop(k, None) for k in _DRAFTER_FIELDS}
    missing = [k for k, v in drafter.items() if v is None] + (["transformer_layer_config"] if layer is None else [])
    if missing or fields:
        what = f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(sorted(fields))}"
        raise OracleError(f"KimiK3DSparkForCausalLM's config: {what}")
    layers = layer["num_hidden_layers"]
    config = Qwen3Config(**layer, layer_types=["full_attention"] * layers)
    drafter_cls = _drafter()
    config._attn_implementation = ATTENTION
    context_layers = len(drafter["aux_hidden_state_layer_ids"])
    hf = drafter_cls(config, drafter["sliding_window"], drafter["markov_rank"], context_layers)
    return hf.eval().to(torch.float32)


def save(hf, directory: Path) -> None:
    """The stand-in's weights as the drafter's checkpoint (bf16, the state dict's names)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    tensors = {n: np.ascontiguousarray(p.detach().float().numpy().astype(ml_dtypes.bfloat16)) for n, p in _params(hf)}
    save_file(tensors, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})


def reload(hf, directory: Path):
    """`hf` with its weights read back from the save."""
    import torch
    from safetensors.numpy import load_file

    stored = {n: x for f in sorted(Path(directory).glob("*.safetensors")) for n, x in load_file(str(f)).items()}
    with torch.no_grad():
        for name, p in _params(hf):
            p.copy_(torch.from_numpy(stored[name].astype(np.float32)))
    return hf


def _params(hf):
    return sorted(hf.state_dict(keep_vars=True).items())


def compare(report, model: Model, weights, hf, ids: np.ndarray, steps: int, progress) -> None:
    """The drafter's steps against the stand-in's (mkdsl/verify/draft_step.py)."""
    from mkdsl.verify.draft_step import compare_draft_steps

    compare_draft_steps(report, model, weights, hf, ids, steps)
