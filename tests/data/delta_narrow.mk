model delta_narrow

# The delta rule with value heads 64 wide and 16 of them (a Gated DeltaNet at the widths Mosaic
# rejected when the loop over the heads' slots sliced 64-wide columns at a loop index).
const L = 1
const H = 256
const NH = 16      # value heads
const NK = 8       # key heads
const DK = 128
const DV = 64
const V = 512
const EPS = 0.000001

dim B in 1 .. 8
dim S in 1 .. 256

weight embed:    bf16[V, H]
weight norm1:    bf16[H]            per layer
weight w_q:      bf16[H, NK*DK]     per layer
weight w_k:      bf16[H, NK*DK]     per layer
weight w_v:      bf16[H, NH*DV]     per layer
weight w_ab:     bf16[H, 128]       per layer
weight a_log:    f32[NH]            per layer
weight dt_bias:  f32[NH]            per layer
weight w_o:      bf16[NH*DV, H]     per layer
weight out_norm: bf16[H]
weight lm_head:  bf16[H, V]

state st: f32[B, NH, DK, DV] per layer

block mixer(h) {
  q = l2norm(linear(h, w_q), heads=NK, scale=DK ** -0.5)
  k = l2norm(linear(h, w_k), heads=NK)
  ab = linear(h, w_ab)
  beta = sigmoid(slice(ab, start=0, size=NH))
  g = -exp(a_log) * softplus(slice(ab, start=NH, size=NH) + dt_bias)
  o = recurrent(q, k, linear(h, w_v), st, g, beta, heads=NH, key_heads=NK, rule="delta")
  return linear(o, w_o)
}

layer mix(x) {
  return x + mixer(rmsnorm(x, norm1, eps=EPS))
}

layers L { mix: otherwise }

step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}
