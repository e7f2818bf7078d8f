model fp8_wide_experts

# fp8 experts with 128 x 128 block scales, 1536 wide: six 256-column tiles per expert, each
# of whose scale DMAs once took a strided [8, 2] slice of the expert's [8, 12] scale block.
const L = 1
const H = 1024
const E = 4
const TOPK = 2
const F = 1536
const V = 512
const EPS = 0.000001

dim B in 1 .. 8
dim S in 1 .. 256

weight embed:    bf16[V, H]
weight norm1:    bf16[H]                             per layer
weight router:   bf16[H, E]                          per layer
weight w_gate:   fp8_e4m3(block=128)[E, H, F]        per layer
weight w_up:     fp8_e4m3(block=128)[E, H, F]        per layer
weight w_down:   fp8_e4m3(block=128)[E, F, H]        per layer
weight out_norm: bf16[H]
weight lm_head:  bf16[H, V]

block moe(h) {
  p, ids = topk(softmax(linear(h, router)), k=TOPK)
  return moe_experts(h, p / rowsum(p), ids, w_gate, w_up, w_down, act=swiglu)
}

layer mlp(x) {
  return x + moe(rmsnorm(x, norm1, eps=EPS))
}

layers L { mlp: otherwise }

step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}
