# A small block drafter for tests: Kimi K3's DSpark drafter (specs/kimi_k3_dspark.mk) at sizes that
# pair with specs/tiny.mk (hidden 128, vocabulary 256), reading the hidden states of tiny's layers
# 0 and 1. One layer, one device. Its `mini` profile pairs with specs/llama3_8b.mk's mini (hidden
# 256, vocabulary 512), whose layers 0 and 1 it then reads.
model tiny_draft

const L     = 1
const H     = 128
const V     = 256
const NH    = 2
const NKV   = 1
const D     = 64
const F     = 256
const W     = 64
const MR    = 16
const MASK  = 255
const EPS   = 0.00001
const THETA = 10000.0
const C1    = 0
const C2    = 1
const NC    = 2
const NKVR  = NKV

dim B in 1 .. 16

profile mini {
  H = 256
  V = 512
  MASK = 511
}

weight embed:       bf16[V, H]
weight fc:          bf16[NC*H, H]
weight hidden_norm: bf16[H]
weight attn_norm:   bf16[H]              per layer
weight wq:          bf16[H, NH*D]    per layer
weight wk:          bf16[H, NKVR*D]  per layer
weight wv:          bf16[H, NKVR*D]  per layer
weight q_norm:      bf16[D]              per layer
weight k_norm:      bf16[D]              per layer
weight wo:          bf16[NH*D, H]    per layer
weight mlp_norm:    bf16[H]              per layer
weight w_gate:      bf16[H, F]       per layer
weight w_up:        bf16[H, F]       per layer
weight w_down:      bf16[F, H]       per layer
weight final_norm:  bf16[H]
weight lm_head:     bf16[H, V]
weight markov_w1:   bf16[V, MR]
weight markov_w2:   bf16[V, MR]

# The context rows this step adds (the target's hidden states of the tokens accepted since the
# last step) and their positions (-1: no row); the host writes both before each step.
state context:      f32[B, NC*H]
state context_pos:  i32[B]
context context at context_pos from layers C1, C2

# Each layer's context cache: keys and values by slot, and the position each slot holds (-1: empty).
state k_cache:      bf16[NKVR, W, D] per layer
state v_cache:      bf16[NKVR, W, D] per layer
state slot_pos:     i32[W]               per layer

block attn(h, c) {
  q = rope(rmsnorm(linear(h, wq), q_norm, heads=NH, eps=EPS), positions, heads=NH, theta=THETA)
  k = rope(rmsnorm(linear(h, wk), k_norm, heads=NKVR, eps=EPS), positions, heads=NKVR, theta=THETA)
  ck = rope(rmsnorm(linear(c, wk), k_norm, heads=NKVR, eps=EPS), context_pos, heads=NKVR, theta=THETA)
  y = block_attention(q, k, linear(h, wv), ck, linear(c, wv), k_cache, v_cache, slot_pos, context_pos, positions,
                      heads=NH, kv_heads=NKVR, window=W)
  return linear(y, wo)
}

block mlp(h) {
  return linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)
}

layer decoder(x, c) {
  x = x + attn(rmsnorm(x, attn_norm, eps=EPS), c)
  return x + mlp(rmsnorm(x, mlp_norm, eps=EPS)), c
}

layers L {
  decoder: otherwise
}

# tokens: the anchor, then MASK in every other row; positions: anchor .. anchor + B - 1.
step(tokens, positions) {
  c = rmsnorm(linear(context, fc), hidden_norm, eps=EPS)
  x, c = layers(embedding(tokens, embed), c)
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, markov_argmax(logits, tokens, markov_w1, markov_w2)
}
