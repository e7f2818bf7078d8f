# Llama 3 8B: one greedy decode step.
# 32 layers, hidden 4096, 32 query / 8 KV heads of 128, SwiGLU FFN 14336, vocab 128256.
model llama3_8b

const L     = 32        # layers
const H     = 4096      # hidden width
const NH    = 32        # query heads
const NKV   = 8         # key/value heads
const D     = 128       # head dim
const F     = 14336     # FFN width
const V     = 128256    # vocabulary
const EPS   = 0.00001   # rmsnorm epsilon
const THETA = 500000.0  # rope base

dim B in 1 .. 8         # rows decoded together
dim S in 1 .. 131072    # KV cache length

profile mini {
  L = 2
  H = 256
  NH = 4
  NKV = 2
  D = 64
  F = 512
  V = 512
}

mesh { tp = 1 }

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]             per layer
weight wq:         bf16[H, NH*D @tp]   per layer
weight wk:         bf16[H, NKV*D @tp]  per layer
weight wv:         bf16[H, NKV*D @tp]  per layer
weight wo:         bf16[NH*D @tp, H]   per layer
weight mlp_norm:   bf16[H]             per layer
weight w_gate:     bf16[H, F @tp]      per layer
weight w_up:       bf16[H, F @tp]      per layer
weight w_down:     bf16[F @tp, H]      per layer
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @tp]

state k_cache: bf16[B, NKV @tp, S, D] per layer
state v_cache: bf16[B, NKV @tp, S, D] per layer

block swiglu_mlp(x) {
  g = linear(x, w_gate)
  u = linear(x, w_up)
  return linear(swiglu(g, u), w_down)
}

layer decoder(x) {
  h = rmsnorm(x, attn_norm, eps=EPS)
  q = rope(linear(h, wq), positions, heads=NH, theta=THETA)
  k = rope(linear(h, wk), positions, heads=NKV, theta=THETA)
  v = linear(h, wv)
  a = attention(q, k, v, k_cache, v_cache, positions, heads=NH, kv_heads=NKV)
  x = x + linear(a, wo)
  x = x + swiglu_mlp(rmsnorm(x, mlp_norm, eps=EPS))
  return x
}

layers L {
  decoder: otherwise
}

step(tokens, positions) {
  x = embedding(tokens, embed)
  x = layers(x)
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}
