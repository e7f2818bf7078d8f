# DeepSeek-V2-Lite: one greedy decode step.
# Config values used (deepseek-ai/DeepSeek-V2-Lite config.json): num_hidden_layers 27,
# hidden_size 2048, num_attention_heads 16, q_lora_rank null (q projected directly),
# kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
# first_k_dense_replace 1 (layer 0 dense, intermediate_size 10944), n_routed_experts 64 of
# moe_intermediate_size 1408, num_experts_per_tok 6, n_shared_experts 2 (one shared SwiGLU of
# width 2 x 1408), scoring_func softmax, topk_method greedy, norm_topk_prob false,
# routed_scaling_factor 1.0, rope_theta 10000, rope_scaling yarn (factor 40,
# original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale 0.707,
# mscale_all_dim 0.707), max_position_embeddings 163840, rms_norm_eps 1e-6, vocab_size 102400,
# tie_word_embeddings false, torch_dtype bfloat16.
# Equations (DeepSeek-V2's modeling_deepseek.py): MLA as in DeepSeek-V3 but q = Wq h; the rope
# lanes pair interleaved (the code de-interleaves, then rotates halves); YaRN with the floored and
# ceiled correction range, cos and sin times mscale(40, 0.707) / mscale(40, 0.707) = 1, and
# softmax scale 192^-0.5 * mscale(40, 0.707)^2, mscale(s, m) = 0.1 m ln s + 1; the router's
# softmax over the 64 experts, the top 6 weighted by their probabilities as they are (not
# renormalised) times 1.0; plus the shared expert; plain RMSNorm before each sublayer.
#
# Deployment: 4 TPU7x cores (2 chips), ep 2 x tp 2: 4 heads per core (wq, wkv_b, wo split by
# heads over all 4; the latent cache whole on every core), the routed experts by owner over all
# 4 (16 each), the dense MLP and the shared expert by columns over tp (5472 and 1408 per core;
# 5472 is padded by the compiler), the head by vocabulary over all 4.
model deepseek_v2_lite

const L     = 27          # layers
const DENSE = 1           # first_k_dense_replace
const H     = 2048        # hidden width
const NH    = 16          # attention heads
const KVR   = 512         # kv_lora_rank
const NOPE  = 128         # qk_nope_head_dim
const ROPE  = 64          # qk_rope_head_dim
const VD    = 128         # v_head_dim
const FD    = 10944       # dense MLP width
const E     = 64          # routed experts
const TOPK  = 6           # experts per token
const FE    = 1408        # expert width
const NSH   = 2           # shared experts (one MLP of width NSH * FE)
const RSF   = 1.0         # routed_scaling_factor
const V     = 102400      # vocabulary
const EPS   = 0.000001    # rms_norm_eps
const THETA = 10000.0     # rope_theta
const YF    = 40.0        # YaRN factor
const OMP   = 4096        # original_max_position_embeddings
const MSCALE_ALL = 0.707  # mscale_all_dim (= mscale)
const SCALE = (NOPE + ROPE) ** -0.5 * (0.1 * MSCALE_ALL * ln(YF) + 1.0) ** 2

const EPN = 2
const TPN = 2
mesh { ep = EPN  tp = TPN }

dim B in 1 .. 8           # rows decoded together
dim S in 1 .. 163840      # cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded like the full model over 4 devices: one dense and
# one MoE layer, 16 experts, top 6 unnormalised, the published head dims and rope; the kv rank
# 128 (the kernel needs a multiple of 128); a dense width that 2 devices split into columns the
# compiler pads, as at full size.
profile mini {
  L = 2
  H = 256
  NH = 8
  KVR = 128
  FD = 320
  E = 16
  FE = 256
  V = 1024
}

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]                          per layer
weight mlp_norm:   bf16[H]                          per layer
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @(ep, tp)]

weight wq:         bf16[H, NH*(NOPE+ROPE) @(ep, tp)] per layer
weight wkv_a:      bf16[H, KVR + ROPE]               per layer
weight kv_norm:    bf16[KVR]                         per layer
weight wkv_b:      bf16[KVR, NH*(NOPE+VD) @(ep, tp)] per layer
weight wo:         bf16[NH*VD @(ep, tp), H]          per layer

state kv_cache:    bf16[B, S, KVR + ROPE] per layer

weight dense_gate: bf16[H, FD @tp]  per layer(dense)
weight dense_up:   bf16[H, FD @tp]  per layer(dense)
weight dense_down: bf16[FD @tp, H]  per layer(dense)

weight router:      bf16[H, E]                    per layer(moe)
weight w_gate:      bf16[E @(ep, tp), H, FE]      per layer(moe)
weight w_up:        bf16[E @(ep, tp), H, FE]      per layer(moe)
weight w_down:      bf16[E @(ep, tp), FE, H]      per layer(moe)
weight shared_gate: bf16[H, NSH*FE @tp]           per layer(moe)
weight shared_up:   bf16[H, NSH*FE @tp]           per layer(moe)
weight shared_down: bf16[NSH*FE @tp, H]           per layer(moe)

# Interleaved-pair YaRN rope over `dim` lanes from `offset` in each of `heads` heads.
block yarn(x, heads, dim, offset) {
  return rope(x, positions, heads=heads, theta=THETA, rotary_dim=dim, rotary_offset=offset,
              pairing="interleaved", scaling="yarn", factor=YF, original_max_position=OMP,
              beta_fast=32.0, beta_slow=1.0, truncate=true)
}

block mla(h) {
  q = yarn(linear(h, wq), NH, ROPE, NOPE)
  kv = linear(h, wkv_a)
  c = rmsnorm(slice(kv, start=0, size=KVR), kv_norm, eps=EPS)
  k_pe = yarn(slice(kv, start=KVR, size=ROPE), 1, ROPE, 0)
  y = mla_attention(q, c, k_pe, wkv_b, kv_cache, positions, heads=NH, nope=NOPE, extra=ROPE,
                    vdim=VD, scale=SCALE)
  return linear(y, wo)
}

block swiglu_mlp(h, gate, up, down) {
  return linear(swiglu(linear(h, gate), linear(h, up)), down)
}

# softmax over the experts, the top 6 weighted by their probabilities (not renormalised) x 1.0
block moe_ffn(h) {
  p, ids = topk(softmax(linear(h, router)), k=TOPK)
  r = moe_experts(h, p * RSF, ids, w_gate, w_up, w_down, act=swiglu)
  return r + swiglu_mlp(h, shared_gate, shared_up, shared_down)
}

layer dense(x) {
  x = x + mla(rmsnorm(x, attn_norm, eps=EPS))
  return x + swiglu_mlp(rmsnorm(x, mlp_norm, eps=EPS), dense_gate, dense_up, dense_down)
}

layer moe(x) {
  x = x + mla(rmsnorm(x, attn_norm, eps=EPS))
  return x + moe_ffn(rmsnorm(x, mlp_norm, eps=EPS))
}

layers L {
  dense: l < DENSE
  moe:   otherwise
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}

# Where each weight comes from in the published Hugging Face checkpoint (bf16): matrices are stored
# [out, in], the spec's [in, out]; each expert is its own tensor, stacked over `{e}`; the shared
# experts are one MLP. `config` names transformers' class and config.json fields (for
# `mkdsl verify --against transformers`).
checkpoint hf {
  config {
    architecture = "DeepseekV2ForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = FD
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NH
    q_lora_rank = null
    kv_lora_rank = KVR
    qk_nope_head_dim = NOPE
    qk_rope_head_dim = ROPE
    v_head_dim = VD
    head_dim = ROPE
    n_routed_experts = E
    num_experts_per_tok = TOPK
    moe_intermediate_size = FE
    n_shared_experts = NSH
    first_k_dense_replace = DENSE
    routed_scaling_factor = RSF
    topk_method = "greedy"
    norm_topk_prob = false
    rms_norm_eps = EPS
    rope_theta = THETA
    rope_scaling.type = "yarn"
    rope_scaling.factor = YF
    rope_scaling.original_max_position_embeddings = OMP
    rope_scaling.beta_fast = 32.0
    rope_scaling.beta_slow = 1.0
    rope_scaling.mscale = MSCALE_ALL
    rope_scaling.mscale_all_dim = MSCALE_ALL
    tie_word_embeddings = false
  }
  embed       = "model.embed_tokens.weight"
  attn_norm   = "model.layers.{l}.input_layernorm.weight"
  mlp_norm    = "model.layers.{l}.post_attention_layernorm.weight"
  final_norm  = "model.norm.weight"
  lm_head     = "lm_head.weight" | transpose
  wq          = "model.layers.{l}.self_attn.q_proj.weight" | transpose
  wkv_a       = "model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight" | transpose
  kv_norm     = "model.layers.{l}.self_attn.kv_a_layernorm.weight"
  wkv_b       = "model.layers.{l}.self_attn.kv_b_proj.weight" | transpose
  wo          = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  dense_gate  = "model.layers.{l}.mlp.gate_proj.weight" | transpose
  dense_up    = "model.layers.{l}.mlp.up_proj.weight" | transpose
  dense_down  = "model.layers.{l}.mlp.down_proj.weight" | transpose
  router      = "model.layers.{l}.mlp.gate.weight" | transpose
  w_gate      = "model.layers.{l}.mlp.experts.{e}.gate_proj.weight" | transpose
  w_up        = "model.layers.{l}.mlp.experts.{e}.up_proj.weight" | transpose
  w_down      = "model.layers.{l}.mlp.experts.{e}.down_proj.weight" | transpose
  shared_gate = "model.layers.{l}.mlp.shared_experts.gate_proj.weight" | transpose
  shared_up   = "model.layers.{l}.mlp.shared_experts.up_proj.weight" | transpose
  shared_down = "model.layers.{l}.mlp.shared_experts.down_proj.weight" | transpose
}
