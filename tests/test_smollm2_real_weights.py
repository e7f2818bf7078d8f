"""SmolLM2-135M-Instruct from its real Q4_1 GGUF (tests/smollm2_gguf.py): mkdsl's greedy tokens
against two float32 forwards on the same exactly-decoded weights.

- mkdsl: `specs/smollm2_135m.mk` retyped for the file (its matrices kept in Q4_1, as `mkdsl run`
  keeps them), the spec's reference step (XLA; the kernel equals it: tests/test_smollm2.py,
  tests/test_gguf_formats.py), 24 greedy tokens per prompt. The reference decodes each Q4_1 matrix
  exactly before its matmul, so it runs on the decoded matrices (decoded once, not every step).
- numpy: a batched causal forward written here from the Llama equations in llama.cpp's own layout
  (q/k rows as the file has them, rope on adjacent pairs), the blocks decoded by
  tests/checkpoint_writers.py (not mkdsl's decoder), teacher-forced on mkdsl's tokens.
- transformers: LlamaForCausalLM in float32 with the same decoded weights (q/k rows put back in
  Hugging Face's order), teacher-forced on mkdsl's tokens: its greedy choice at each position.

Where a forward's choice differs from mkdsl's, the test prints the position, both tokens and the
forward's top-2 margin, and checks that the margin is within what mkdsl's arithmetic can move a
logit (bf16 matmul inputs, a bf16 embedding and norms: `BOUND`); elsewhere the tokens are equal.
"""

from __future__ import annotations

import numpy as np
import pytest
from checkpoint_writers import decode_blocks
from smollm2_gguf import smollm2_gguf

import mkdsl

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
TOKENS = 24
SEQ = 64  # cache length: the longest prompt (9 tokens) and 24 more fit
# How far mkdsl's logits may sit from a float32 forward's. mkdsl rounds every matmul input to
# bf16 (relative 2^-9), and holds the embedding and the norm gains in bf16 (relative 2^-9): about
# 4 roundings per layer on the residual path, 30 layers, so the final hidden state carries a
# relative error of order sqrt(4 * 30) * 2^-9 = 2.1% (independent roundings add in quadrature);
# a logit inherits it relative to the largest logit (|logit| <= ~25 here): 0.021 * 25 = 0.54.
# Measured: at most 0.35 over every position of the three prompts (numpy f32).
BOUND = 0.54


@pytest.fixture(scope="module")
def gguf_file():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def mkdsl_greedy(gguf_file):
    """(prompt ids, mkdsl's tokens, its logits at each chosen token) per prompt."""
    import jax
    import jax.numpy as jnp

    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.tokenizer import load_codec
    from mkdsl.lang.quant import QTensor, dequantize, register_pytree
    from mkdsl.run.random_params import concrete_shape
    from mkdsl.run.reference import build_reference

    reader = open_checkpoint(gguf_file)
    spec = mkdsl.load(mkdsl.__path__[0] + "/../specs/smollm2_135m.mk", weights=reader)
    kept = {t.name for t in spec.model.weights if str(t.type.dtype) == "q4_1"}
    assert kept == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    weights, _ = mkdsl.load_weights(spec, reader, host=True, progress=False)
    register_pytree()
    decode = jax.jit(dequantize)
    weights = {n: decode(w) if isinstance(w, QTensor) else jnp.asarray(w) for n, w in weights.items()}
    codec = load_codec(reader)
    rows = [codec.encode(p) for p in PROMPTS]
    sizes = {spec.model.dims[0].name: len(rows), spec.model.dims[1].name: SEQ}
    state = {t.name: jnp.zeros(concrete_shape(t.full_shape, sizes), t.type.dtype.numpy) for t in spec.model.states}
    step = build_reference(spec.model)
    made: list[list[int]] = [[] for _ in rows]
    logits: list[list[np.ndarray]] = [[] for _ in rows]
    for pos in range(max(len(r) for r in rows) + TOKENS - 1):  # every row steps at the same position
        feed = [r[pos] if pos < len(r) else (m[-1] if m else 0) for r, m in zip(rows, made, strict=True)]
        out, chosen, state = step(weights, state, np.array(feed, np.int32), np.full(len(rows), pos, np.int32))
        out, chosen = np.asarray(out), np.asarray(chosen)
        for b, r in enumerate(rows):
            if len(r) - 1 <= pos and len(made[b]) < TOKENS:
                made[b].append(int(chosen[b]))
                logits[b].append(out[b])
    return rows, made, logits, codec


def _weights(path) -> tuple[dict, dict]:
    """The GGUF's tensors decoded to f32 (tests/checkpoint_writers.py), and its metadata."""
    import gguf

    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("llama.")}
    w = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        kind = t.tensor_type.name
        w[t.name] = (
            np.asarray(t.data, np.float32).reshape(shape) if kind == "F32" else decode_blocks(t.data, kind, shape)
        )
    return w, meta


def _numpy_logits(w: dict, meta: dict, seq: list[int]) -> np.ndarray:
    """Logits at every position of `seq`, one causal pass (llama.cpp's layout: rope on adjacent pairs)."""
    heads, kv = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
    eps, theta = float(meta["llama.attention.layer_norm_rms_epsilon"]), float(meta["llama.rope.freq_base"])
    t = len(seq)
    d = w["blk.0.attn_q.weight"].shape[0] // heads
    ang = np.arange(t)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(ang).astype(np.float32)[:, None], np.sin(ang).astype(np.float32)[:, None]

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def rope(x, n):
        x = x.reshape(t, n, d // 2, 2)
        a, b = x[..., 0], x[..., 1]
        return np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(t, n, d)

    mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
    x = w["token_embd.weight"][seq]
    for i in range(int(meta["llama.block_count"])):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope(h @ w[p + "attn_q.weight"].T, heads)
        k = np.repeat(rope(h @ w[p + "attn_k.weight"].T, kv), heads // kv, axis=1)
        v = np.repeat((h @ w[p + "attn_v.weight"].T).reshape(t, kv, d), heads // kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hqk,khd->qhd", a / a.sum(-1, keepdims=True), v).reshape(t, heads * d)
        x = x + o @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


def _parting(name: str, i: int, theirs: np.ndarray, ours: int, codec) -> float:
    """The margin of a forward's choice over mkdsl's token at a position where they part (printed)."""
    best = int(theirs.argmax())
    margin = float(theirs[best] - theirs[ours])
    print(
        f"\n{name} parts from mkdsl at token {i}: {codec.decode([best])!r} vs mkdsl's {codec.decode([ours])!r}, "
        f"{name}'s top-2 margin {margin:.3f} (bound {BOUND})"
    )
    return margin


@pytest.fixture(scope="module")
def decoded(gguf_file):
    return _weights(gguf_file)


@pytest.mark.slow
def test_mkdsl_greedy_equals_a_float32_forward_but_near_ties(decoded, mkdsl_greedy):
    rows, made, logits, codec = mkdsl_greedy
    w, meta = decoded
    assert codec.decode(made[0]).startswith(" Paris")
    worst = 0.0
    for prompt, tokens, ours in zip(rows, made, logits, strict=True):
        theirs = _numpy_logits(w, meta, prompt + tokens[:-1])[len(prompt) - 1 :]
        for i, (t, lt, lo) in enumerate(zip(tokens, theirs, ours, strict=True)):
            assert np.isfinite(lo).all() and np.isfinite(lt).all()
            worst = max(worst, float(np.abs(lt - lo).max()))
            if int(lt.argmax()) != t:
                assert _parting("numpy f32", i, lt, t, codec) <= 2 * BOUND
    print(f"\nlargest |mkdsl - numpy f32| logit difference: {worst:.3f}")
    assert worst <= BOUND


@pytest.mark.slow
def test_mkdsl_greedy_equals_transformers_float32_but_near_ties(decoded, mkdsl_greedy):
    """transformers' greedy, teacher-forced on mkdsl's tokens (one forward per prompt): its choice
    equals mkdsl's token at every position, so its own greedy run makes mkdsl's tokens, up to a
    near tie, which is named."""
    torch = pytest.importorskip("torch", reason="the `oracle` extra (torch, transformers) is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    rows, made, _, codec = mkdsl_greedy
    w, meta = decoded
    heads, kv = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
    hidden = int(meta["llama.embedding_length"])
    config = LlamaConfig(
        vocab_size=w["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta["llama.rope.freq_base"]),
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(_hf_state(w, config, torch), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for prompt, tokens in zip(rows, made, strict=True):
        with torch.no_grad():
            out = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float().numpy()
        for i, (t, lt) in enumerate(zip(tokens, out, strict=True)):
            if int(lt.argmax()) != t:
                assert _parting("transformers f32", i, lt, t, codec) <= 2 * BOUND


def _hf_state(w: dict, config, torch) -> dict:
    """The decoded GGUF tensors under Hugging Face's names, q/k rows back in its order (llama.cpp
    stores row 2j + s of a head where Hugging Face has row s * d/2 + j)."""
    d = config.head_dim

    def unpermute(x, n):
        return x.reshape(n, d // 2, 2, -1).swapaxes(1, 2).reshape(x.shape)

    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    out = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"]}
    for i in range(config.num_hidden_layers):
        for gg, hf in names.items():
            x = w[f"blk.{i}.{gg}.weight"]
            if gg in ("attn_q", "attn_k"):
                x = unpermute(x, config.num_attention_heads if gg == "attn_q" else config.num_key_value_heads)
            out[f"model.layers.{i}.{hf}.weight"] = x
    return {k: torch.from_numpy(np.array(v, np.float32)) for k, v in out.items()}
