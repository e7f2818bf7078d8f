# gpt-oss-120b: one greedy decode step.
# 36 layers alternating sliding-window (even layers, 128 tokens) and full attention (odd), hidden
# 2880, 64 query / 8 KV heads of 64 with q/k/v/o biases and a learned sink logit per query head,
# YaRN RoPE (factor 32, theta 150000, not truncated, cos and sin times the concentration
# 0.1 ln 32 + 1), 128 MXFP4 experts of width 2880, top 4 of the biased router logits with a
# softmax over those 4, clamped SwiGLU (gate <= 7, |up| <= 7, gate * sigmoid(1.702 gate) * (up + 1))
# with expert biases, vocab 201088 (o200k_harmony), RMSNorm eps 1e-5, untied head.
# Values from the published model card, config and reference implementation.
#
# As published, with two notes on how the checkpoint's tensors become these weights:
# - The fused gate_up projection [5760] interleaves its halves (gate = u[0::2], up = u[1::2]);
#   the spec declares the gate (w1, b1) and up (w3, b3) experts separately, de-interleaved.
# - The `checkpoint hf` section at the end loads the published checkpoint: it re-packs the MXFP4
#   experts (blocks [E, out, in/32, 16] + E8M0 scales [E, out, in/32]) into mkdsl's uint32
#   [E, in/8, out] codes and [E, in/32, out] scales, bit for bit, and de-interleaves gate_up
#   (`group_rows` over its rows, in groups of 2).
#
# Deployment: 4 TPU7x cores (2 chips), ep 2 x tp 2. Attention is split by KV head over tp (4 KV
# heads and 32 query heads per core; the two ep halves compute it alike); the experts by owner
# over all 4 cores (32 each, whole columns: 2880 / 2 is not a multiple of 128); the head by
# vocabulary over all 4 (201088 / 4 = 50272 columns, padded by the compiler to 50304).
model gpt_oss_120b

const L      = 36        # layers
const H      = 2880      # hidden width
const NH     = 64        # query heads
const NKV    = 8         # key/value heads
const D      = 64        # head dim
const E      = 128       # experts
const TOPK   = 4         # experts per token
const FE     = 2880      # expert width
const V      = 201088    # vocabulary
const EPS    = 0.00001   # rmsnorm epsilon
const WINDOW = 128       # sliding window of the even layers
const THETA  = 150000.0  # rope base
const YARN   = 32.0      # YaRN factor
const ORIG   = 4096      # original_max_position_embeddings
const CONC   = 0.1 * ln(YARN) + 1.0  # YaRN concentration, 1.346574
const ALPHA  = 1.702     # swiglu_alpha
const LIMIT  = 7.0       # swiglu_limit

const EPN = 2
const TPN = 2
mesh { ep = EPN  tp = TPN }

dim B in 1 .. 8          # rows decoded together
dim S in 1 .. 131072     # KV cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded over 2 devices (tp 2; the experts split 2 ways):
# the published head dim, GQA ratio 8:1, top-k, window, sinks, biases and activation; one sliding
# and one full layer; 8 experts of width 256.
profile mini {
  L = 2
  H = 256
  NH = 16
  NKV = 2
  E = 8
  FE = 256
  V = 1024
  EPN = 1
}

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]                  per layer
weight wq:         bf16[H, NH*D @tp]        per layer
weight bq:         bf16[NH*D @tp]           per layer
weight wk:         bf16[H, NKV*D @tp]       per layer
weight bk:         bf16[NKV*D @tp]          per layer
weight wv:         bf16[H, NKV*D @tp]       per layer
weight bv:         bf16[NKV*D @tp]          per layer
weight sinks:      bf16[NH @tp]             per layer
weight wo:         bf16[NH*D @tp, H]        per layer
weight bo:         bf16[H]                  per layer
weight mlp_norm:   bf16[H]                  per layer
weight router:     bf16[H, E]               per layer
weight router_b:   bf16[E]                  per layer
weight w1:         mxfp4[E @(ep, tp), H, FE]  per layer   # gate: u[0::2] of gate_up
weight b1:         bf16[E @(ep, tp), FE]      per layer
weight w3:         mxfp4[E @(ep, tp), H, FE]  per layer   # up: u[1::2] of gate_up
weight b3:         bf16[E @(ep, tp), FE]      per layer
weight w2:         mxfp4[E @(ep, tp), FE, H]  per layer   # down
weight b2:         bf16[E @(ep, tp), H]       per layer
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @(ep, tp)]

state k_cache: bf16[B, NKV @tp, S, D] per layer
state v_cache: bf16[B, NKV @tp, S, D] per layer

# YaRN rope on the whole head, rotate-half pairs, cos and sin times the concentration
block yarn(x, heads) {
  return rope(x, positions, heads=heads, theta=THETA, scaling="yarn", factor=YARN,
              original_max_position=ORIG, beta_fast=32.0, beta_slow=1.0, truncate=false,
              concentration=CONC)
}

# q, k, v with their biases, q and k rotated
block qkv(h) {
  q = yarn(linear(h, wq) + bq, heads=NH)
  k = yarn(linear(h, wk) + bk, heads=NKV)
  return q, k, linear(h, wv) + bv
}

# clamped SwiGLU: gate <= LIMIT, -LIMIT <= up <= LIMIT, gate * sigmoid(ALPHA gate) * (up + 1)
block oss_act(g, u) {
  g = clamp(g, hi=LIMIT)
  u = clamp(u, lo=-LIMIT, hi=LIMIT)
  return g * sigmoid(g * ALPHA) * (u + 1.0)
}

# top 4 of the biased router logits, softmax over those 4; the expert biases inside the sum
block moe(h) {
  v, ids = topk(linear(h, router) + router_b, k=TOPK)
  return moe_experts(h, softmax(v), ids, w1, w3, w2, b1, b3, b2, act=oss_act)
}

layer sliding(x) {
  h = rmsnorm(x, attn_norm, eps=EPS)
  q, k, v = qkv(h)
  a = attention(q, k, v, k_cache, v_cache, positions, sinks, heads=NH, kv_heads=NKV, window=WINDOW)
  x = x + (linear(a, wo) + bo)
  return x + moe(rmsnorm(x, mlp_norm, eps=EPS))
}

layer full(x) {
  h = rmsnorm(x, attn_norm, eps=EPS)
  q, k, v = qkv(h)
  a = attention(q, k, v, k_cache, v_cache, positions, sinks, heads=NH, kv_heads=NKV)
  x = x + (linear(a, wo) + bo)
  return x + moe(rmsnorm(x, mlp_norm, eps=EPS))
}

layers L {
  sliding: l % 2 == 0
  full:    otherwise
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}

# Where each weight comes from in the published Hugging Face checkpoint (openai/gpt-oss-120b;
# prefix model.layers.N.): bf16 matrices stored [out, in] (the spec's are [in, out]); the experts
# fused per layer, [E, ...], as MXFP4 blocks `*` their scales; gate_up's rows interleave gate
# (even) and up (odd), so `group_rows(groups=FE, start=0, stop=1, dim=1)` of its 2 x FE rows
# takes the gate, `start=1, stop=2` the up projection (its bias likewise). A dequantised save
# (transformers' bf16 save of the model) stores each layer's experts as `gate_up_proj` [E, H, 2 x FE]
# (already [in, out], gate and up interleaved along the last axis) and `down_proj` [E, FE, H]: the
# `or` sources, quantised back to MXFP4 exactly (a bf16 save of MXFP4 values is always exact; other
# values are refused, as no line says `round`).
checkpoint hf {
  config {
    architecture = "GptOssForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = FE
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NKV
    head_dim = D
    num_local_experts = E
    num_experts_per_tok = TOPK
    sliding_window = WINDOW
    rms_norm_eps = EPS
    swiglu_limit = LIMIT
    rope_theta = THETA
    rope_scaling.rope_type = "yarn"
    rope_scaling.factor = YARN
    rope_scaling.original_max_position_embeddings = ORIG
    rope_scaling.beta_fast = 32.0
    rope_scaling.beta_slow = 1.0
    rope_scaling.truncate = false
    tie_word_embeddings = false
  }
  embed      = "model.embed_tokens.weight"
  attn_norm  = "model.layers.{l}.input_layernorm.weight"
  wq         = "model.layers.{l}.self_attn.q_proj.weight" | transpose
  bq         = "model.layers.{l}.self_attn.q_proj.bias"
  wk         = "model.layers.{l}.self_attn.k_proj.weight" | transpose
  bk         = "model.layers.{l}.self_attn.k_proj.bias"
  wv         = "model.layers.{l}.self_attn.v_proj.weight" | transpose
  bv         = "model.layers.{l}.self_attn.v_proj.bias"
  sinks      = "model.layers.{l}.self_attn.sinks"
  wo         = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  bo         = "model.layers.{l}.self_attn.o_proj.bias"
  mlp_norm   = "model.layers.{l}.post_attention_layernorm.weight"
  router     = "model.layers.{l}.mlp.router.weight" | transpose
  router_b   = "model.layers.{l}.mlp.router.bias"
  w1         = "model.layers.{l}.mlp.experts.gate_up_proj_blocks" * "model.layers.{l}.mlp.experts.gate_up_proj_scales"
               | group_rows(groups=FE, start=0, stop=1, dim=1) | transpose
               or "model.layers.{l}.mlp.experts.gate_up_proj" | group_rows(groups=FE, start=0, stop=1, dim=2)
  b1         = "model.layers.{l}.mlp.experts.gate_up_proj_bias" | group_rows(groups=FE, start=0, stop=1, dim=1)
  w3         = "model.layers.{l}.mlp.experts.gate_up_proj_blocks" * "model.layers.{l}.mlp.experts.gate_up_proj_scales"
               | group_rows(groups=FE, start=1, stop=2, dim=1) | transpose
               or "model.layers.{l}.mlp.experts.gate_up_proj" | group_rows(groups=FE, start=1, stop=2, dim=2)
  b3         = "model.layers.{l}.mlp.experts.gate_up_proj_bias" | group_rows(groups=FE, start=1, stop=2, dim=1)
  w2         = "model.layers.{l}.mlp.experts.down_proj_blocks" * "model.layers.{l}.mlp.experts.down_proj_scales"
               | transpose
               or "model.layers.{l}.mlp.experts.down_proj"
  b2         = "model.layers.{l}.mlp.experts.down_proj_bias"
  final_norm = "model.norm.weight"
  lm_head    = "lm_head.weight" | transpose
}
