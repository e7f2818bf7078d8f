# Qwen3-30B-A3B: one greedy decode step.
# 48 layers, hidden 2048, 32 query / 4 KV heads of 128 with RMSNorm on each query and key head,
# RoPE theta 1e6 (rotate-half, the whole head), 128 bf16 SwiGLU experts of width 768, top 8 by a
# softmax router renormalised over the chosen 8, no shared expert, vocab 151936, untied head.
# Values from the published config.json and the model card.
#
# Deployment: 8 TPU7x cores (4 chips), ep 2 x tp 4. Attention is split by KV head over tp (one
# KV head and 8 query heads per core; the two ep halves compute it alike); the experts are split
# by owner over all 8 cores (16 each, whole columns). The head is split by vocabulary over all 8:
# 151936 / 8 = 18992 columns per core, which the compiler stores padded to 19072 (whole 128-lane
# tiles); the logits stay split and argmax combines the cores' bests.
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
weight lm_head:    bf16[H, V @(ep, tp)]

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

# Where each weight comes from in the published Hugging Face checkpoint (Qwen/Qwen3-30B-A3B, bf16):
# matrices are stored [out, in] (the spec's are [in, out]); each expert is its own tensor,
# stacked over `{e}`.
checkpoint hf {
  config {
    architecture = "Qwen3MoeForCausalLM"
    vocab_size = V
    hidden_size = H
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NKV
    head_dim = D
    rms_norm_eps = EPS
    rope_theta = THETA
    num_experts = E
    num_experts_per_tok = TOPK
    moe_intermediate_size = FE
    norm_topk_prob = true
    decoder_sparse_step = 1
    tie_word_embeddings = false
  }
  embed      = "model.embed_tokens.weight"
  attn_norm  = "model.layers.{l}.input_layernorm.weight"
  wq         = "model.layers.{l}.self_attn.q_proj.weight" | transpose
  wk         = "model.layers.{l}.self_attn.k_proj.weight" | transpose
  wv         = "model.layers.{l}.self_attn.v_proj.weight" | transpose
  q_norm     = "model.layers.{l}.self_attn.q_norm.weight"
  k_norm     = "model.layers.{l}.self_attn.k_norm.weight"
  wo         = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  mlp_norm   = "model.layers.{l}.post_attention_layernorm.weight"
  router     = "model.layers.{l}.mlp.gate.weight" | transpose
  w_gate     = "model.layers.{l}.mlp.experts.{e}.gate_proj.weight" | transpose
  w_up       = "model.layers.{l}.mlp.experts.{e}.up_proj.weight" | transpose
  w_down     = "model.layers.{l}.mlp.experts.{e}.down_proj.weight" | transpose
  final_norm = "model.norm.weight"
  lm_head    = "lm_head.weight" | transpose
}
