# The smallest complete spec: two layers of a tiny GQA decoder. Used by the tests.
model tiny

const L = 2
const H = 128
const NH = 2
const NKV = 1
const D = 128
const F = 256
const V = 256

dim B in 1 .. 8
dim S in 1 .. 256

weight embed:     bf16[V, H]
weight norm1:     bf16[H]        per layer
weight wq:        bf16[H, NH*D]  per layer
weight wk:        bf16[H, NKV*D] per layer
weight wv:        bf16[H, NKV*D] per layer
weight wo:        bf16[NH*D, H]  per layer
weight norm2:     bf16[H]        per layer
weight w_gate:    bf16[H, F]     per layer
weight w_up:      bf16[H, F]     per layer
weight w_down:    bf16[F, H]     per layer
weight out_norm:  bf16[H]
weight lm_head:   bf16[H, V]

state k_cache: bf16[B, NKV, S, D] per layer
state v_cache: bf16[B, NKV, S, D] per layer

layer decoder(x) {
  h = rmsnorm(x, norm1)
  q = rope(linear(h, wq), pos, heads=NH)
  k = rope(linear(h, wk), pos, heads=NKV)
  a = attention(q, k, linear(h, wv), k_cache, v_cache, pos, heads=NH, kv_heads=NKV)
  x = x + linear(a, wo)
  h = rmsnorm(x, norm2)
  return x + linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)
}

layers L { decoder: otherwise }

step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm), lm_head)
  return logits, argmax(logits)
}
