# Qwen3-30B-A3B: one greedy decode step.
# 48 layers, hidden 2048, 32 query / 4 KV heads of 128 with RMSNorm on each query and key head,
# RoPE theta 1e6 (rotate-half, the whole head), 128 bf16 SwiGLU experts of width 768, top 8 by a
# softmax router renormalised over the chosen 8, no shared expert, vocab 151936, untied head.
# Facts: ../shared/facts/models.md (section 4).
#
# Deployment: 8 TPU7x cores (4 chips), ep 2 x tp 4. Attention is split by KV head over tp (one
# KV head and 8 query heads per core; the two ep halves compute it alike); the experts are split
# by owner over all 8 cores (16 each, whole columns). The head is not split: 151936 = 128 x 1187
# columns (1187 is prime) cannot be cut into 128-lane blocks over 2 or more devices, so every core
# streams the whole lm_head (622 MB of bf16) until the compiler pads split vocabularies.
model qwen3_30b_a3b

const L     = 48        # layers
const H     = 2048      # hidden width
const NH    = 32        # query heads
const NKV   = 4         # key/value heads
const D     = 128       # head dim
const E     = 128       # routed experts
const TOPK  = 8         # experts per token
const FE    = 768       # expert width
const V     = 151936    # vocabulary
const EPS   = 0.000001  # rmsnorm epsilon (every norm)
const THETA = 1000000.0 # rope base

const EPN   = 2
const TPN   = 4
mesh { ep = EPN  tp = TPN }

dim B in 1 .. 8         # rows decoded together
dim S in 1 .. 40960     # KV cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded like the full model over 4 devices (ep 2 x tp 2);
# the published head dim and expert count and top-k, since each device's K/V columns and the
# router's columns must be whole 128-lane blocks.
profile mini {
  L = 2
  H = 256
  NH = 4
  NKV = 2
  FE = 256
  V = 1024
  TPN = 2
}

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]             per layer
weight wq:         bf16[H, NH*D @tp]   per layer
weight wk:         bf16[H, NKV*D @tp]  per layer
weight wv:         bf16[H, NKV*D @tp]  per layer
weight q_norm:     bf16[D]             per layer
weight k_norm:     bf16[D]             per layer
weight wo:         bf16[NH*D @tp, H]   per layer
weight mlp_norm:   bf16[H]             per layer
weight router:     bf16[H, E]          per layer
weight w_gate:     bf16[E @(ep, tp), H, FE]  per layer
weight w_up:       bf16[E @(ep, tp), H, FE]  per layer
weight w_down:     bf16[E @(ep, tp), FE, H]  per layer
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V]

state k_cache: bf16[B, NKV @tp, S, D] per layer
state v_cache: bf16[B, NKV @tp, S, D] per layer

block attn(h) {
  q = rope(rmsnorm(linear(h, wq), q_norm, heads=NH, eps=EPS), positions, heads=NH, theta=THETA)
  k = rope(rmsnorm(linear(h, wk), k_norm, heads=NKV, eps=EPS), positions, heads=NKV, theta=THETA)
  v = linear(h, wv)
  return linear(attention(q, k, v, k_cache, v_cache, positions, heads=NH, kv_heads=NKV), wo)
}

# softmax over all experts, the top 8, renormalised (norm_topk_prob); SwiGLU experts
block moe(h) {
  p, ids = topk(softmax(linear(h, router)), k=TOPK)
  return moe_experts(h, p / rowsum(p), ids, w_gate, w_up, w_down, act=swiglu)
}

layer decoder(x) {
  x = x + attn(rmsnorm(x, attn_norm, eps=EPS))
  return x + moe(rmsnorm(x, mlp_norm, eps=EPS))
}

layers L {
  decoder: otherwise
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}
