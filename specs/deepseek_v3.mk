# DeepSeek-V3 (671B): one greedy decode step.
# 61 layers: MLA everywhere (q rank 1536, kv rank 512, 128 heads of 128 "nope" + 64 rope query/key
# dims and 128 value dims; the rope part decoupled, one rotated 64-dim key shared by all heads,
# interleaved pairs, YaRN factor 40 with the floored/ceiled correction range and the m^2 softmax
# scale); a dense SwiGLU MLP of width 18432 in layers 0-2, and in layers 3-60 a MoE of 256 SwiGLU
# experts of width 2048 (top 8) plus one shared expert, routed by sigmoid scores with a
# selection-only correction bias, limited to the 4 best of 8 groups (a group's score: the sum of
# its top 2), renormalised over the chosen 8 and scaled by 2.5. Untied head, vocab 129280.
# Facts: ../shared/facts/models.md (section 1).
#
# Weights as the checkpoint ships them: FP8 e4m3 with one f32 scale per 128x128 block
# (`weight_scale_inv`, multiplied) for every attention projection (kv_b_proj included: the MLA
# kernel decodes its codes and applies the block scales), the dense MLP, the experts and the
# shared expert; bf16 for the embedding, the head, the norms and the router; f32 for the
# correction bias.
# Not modelled: the multi-token-prediction layer (layer 61 in the checkpoint; plain decode skips
# it) and the "dynamic" per-token fp8 quantisation of activations of DeepSeek's optional fp8 GEMM
# path (its default path, like mkdsl's numeric contract, rounds activations to bf16).
# The `checkpoint hf` section at the end loads the published checkpoint: each fp8 `.weight` with
# its `.weight_scale_inv` as one block-scaled weight (codes and scales transposed, bit for bit,
# kv_b_proj's included).
model deepseek_v3

const L     = 61          # layers
const DENSE = 3           # first_k_dense_replace: layers 0 .. DENSE-1 have a dense MLP
const H     = 7168        # hidden width
const NH    = 128         # attention heads
const QR    = 1536        # q_lora_rank
const KVR   = 512         # kv_lora_rank (the latent cache holds KVR + ROPE per token)
const NOPE  = 128         # qk_nope_head_dim
const ROPE  = 64          # qk_rope_head_dim
const VD    = 128         # v_head_dim
const FD    = 18432       # dense MLP width
const E     = 256         # routed experts
const TOPK  = 8           # experts per token
const NG    = 8           # expert groups
const TG    = 4           # groups kept
const FE    = 2048        # expert width (and the shared expert's)
const RSF   = 2.5         # routed_scaling_factor
const V     = 129280      # vocabulary
const EPS   = 0.000001    # rms_norm_eps (every norm)
const THETA = 10000.0     # rope_theta
const YF    = 40.0        # YaRN factor
const OMP   = 4096        # original_max_position_embeddings
const MSCALE_ALL = 1.0    # mscale_all_dim
const SCALE = (NOPE + ROPE) ** -0.5 * (0.1 * MSCALE_ALL * ln(YF) + 1.0) ** 2   # 0.135234

# Deployment: 64 TPU7x cores (32 chips), ep 8 x tp 8. Attention is split by heads over all 64
# cores (2 heads each: 384 columns of wq_b, 512 of wkv_b, 256 rows of wo); the latent cache, the
# low-rank down projections and their norms are whole on every core (one latent shared by all
# heads). The routed experts are split by owner over ep (32 per group of 8 cores) and by columns
# over tp (256 of each expert's 2048 per core: two whole 128x128 scale blocks; 4 whole experts per
# core, E @(ep, tp), checks but libtpu rejects the strided SMEM copy of a [56, 2] slice of the
# experts' [56, 16] scales). The dense MLP and the shared expert are split by columns over tp
# (2304 and 256 per core: whole scale blocks; 18432 / 64 = 288 would cut a block), replicated
# over ep. The head and the embedding are
# split by vocabulary over all 64 cores (2020 columns each, padded to 2048 by the compiler).
const EPN   = 8
const TPN   = 8
mesh { ep = EPN  tp = TPN }

dim B in 1 .. 8           # rows decoded together
dim S in 1 .. 163840      # cache length (max_position_embeddings = 40 x 4096)

# Small enough for TPU interpret mode, sharded like the full model over 4 devices (ep 2 x tp 2):
# one dense and one MoE layer, 16 experts in 4 groups (keep 2, top 4), group-limited routing.
# The published head dims (128 + 64, 128) and rope (YaRN, factor 40); the kv rank 128 (the
# kernel needs a multiple of 128).
profile mini {
  L = 2
  DENSE = 1
  H = 256
  NH = 8
  QR = 256
  KVR = 128
  FD = 512
  E = 16
  TOPK = 4
  NG = 4
  TG = 2
  FE = 256
  V = 1024
  EPN = 2
  TPN = 2
}

# ---- embedding, head, norms
weight embed:      bf16[V @(ep, tp), H]
weight attn_norm:  bf16[H]    per layer
weight mlp_norm:   bf16[H]    per layer
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @(ep, tp)]

# ---- MLA
weight wq_a:       fp8_e4m3(block=128)[H, QR]                       per layer
weight q_norm:     bf16[QR]                                         per layer
weight wq_b:       fp8_e4m3(block=128)[QR, NH*(NOPE+ROPE) @(ep, tp)] per layer
weight wkv_a:      fp8_e4m3(block=128)[H, KVR + ROPE]               per layer
weight kv_norm:    bf16[KVR]                                        per layer
weight wkv_b:      fp8_e4m3(block=128)[KVR, NH*(NOPE+VD) @(ep, tp)] per layer
weight wo:         fp8_e4m3(block=128)[NH*VD @(ep, tp), H]          per layer

state kv_cache:    bf16[B, S, KVR + ROPE] per layer

# ---- dense MLP (layers 0 .. DENSE-1)
weight dense_gate: fp8_e4m3(block=128)[H, FD @tp]  per layer(dense)
weight dense_up:   fp8_e4m3(block=128)[H, FD @tp]  per layer(dense)
weight dense_down: fp8_e4m3(block=128)[FD @tp, H]  per layer(dense)

# ---- MoE (the other layers)
weight router:      bf16[H, E]                                   per layer(moe)
weight router_bias: f32[E]                                       per layer(moe)
weight w_gate:      fp8_e4m3(block=128)[E @ep, H, FE @tp]        per layer(moe)
weight w_up:        fp8_e4m3(block=128)[E @ep, H, FE @tp]        per layer(moe)
weight w_down:      fp8_e4m3(block=128)[E @ep, FE @tp, H]        per layer(moe)
weight shared_gate: fp8_e4m3(block=128)[H, FE @tp]               per layer(moe)
weight shared_up:   fp8_e4m3(block=128)[H, FE @tp]               per layer(moe)
weight shared_down: fp8_e4m3(block=128)[FE @tp, H]               per layer(moe)

# ---- the MTP head's own weights (its layer is a MoE layer; embedding and output head are shared),
# split like the layers' (the kernel holds them for the host, which runs the head: it does not read them)
weight mtp_enorm:       bf16[H]
weight mtp_hnorm:       bf16[H]
weight mtp_eh_proj:     bf16[2*H, H]
weight mtp_head_norm:   bf16[H]
weight mtp_attn_norm:   bf16[H]
weight mtp_mlp_norm:    bf16[H]
weight mtp_wq_a:        fp8_e4m3(block=128)[H, QR]
weight mtp_q_norm:      bf16[QR]
weight mtp_wq_b:        fp8_e4m3(block=128)[QR, NH*(NOPE+ROPE) @(ep, tp)]
weight mtp_wkv_a:       fp8_e4m3(block=128)[H, KVR + ROPE]
weight mtp_kv_norm:     bf16[KVR]
weight mtp_wkv_b:       fp8_e4m3(block=128)[KVR, NH*(NOPE+VD) @(ep, tp)]
weight mtp_wo:          fp8_e4m3(block=128)[NH*VD @(ep, tp), H]
weight mtp_router:      bf16[H, E]
weight mtp_router_bias: f32[E]
weight mtp_w_gate:      fp8_e4m3(block=128)[E @ep, H, FE @tp]
weight mtp_w_up:        fp8_e4m3(block=128)[E @ep, H, FE @tp]
weight mtp_w_down:      fp8_e4m3(block=128)[E @ep, FE @tp, H]
weight mtp_shared_gate: fp8_e4m3(block=128)[H, FE @tp]
weight mtp_shared_up:   fp8_e4m3(block=128)[H, FE @tp]
weight mtp_shared_down: fp8_e4m3(block=128)[FE @tp, H]
state mtp_cache:        bf16[B, S, KVR + ROPE]

# Interleaved-pair YaRN rope over `dim` lanes from `offset` in each of `heads` heads.
block yarn(x, heads, dim, offset) {
  return rope(x, positions, heads=heads, theta=THETA, rotary_dim=dim, rotary_offset=offset,
              pairing="interleaved", scaling="yarn", factor=YF, original_max_position=OMP,
              beta_fast=32.0, beta_slow=1.0, truncate=true)
}

# MLA with its weights and cache as parameters: the layers' and the MTP layer's.
block mla(h, wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo, kv_cache) {
  q = yarn(linear(rmsnorm(linear(h, wq_a), q_norm, eps=EPS), wq_b), NH, ROPE, NOPE)
  kv = linear(h, wkv_a)
  c = rmsnorm(slice(kv, start=0, size=KVR), kv_norm, eps=EPS)
  k_pe = yarn(slice(kv, start=KVR, size=ROPE), 1, ROPE, 0)
  y = mla_attention(q, c, k_pe, wkv_b, kv_cache, positions, heads=NH, nope=NOPE, extra=ROPE,
                    vdim=VD, scale=SCALE)
  return linear(y, wo)
}

block dense_mlp(h) {
  return linear(swiglu(linear(h, dense_gate), linear(h, dense_up)), dense_down)
}

# Sigmoid scores; the biased scores choose (4 of 8 groups, then the top 8), the unbiased ones
# weigh, renormalised over the chosen 8 and scaled by 2.5; plus the shared expert.
block moe_ffn(h, router, router_bias, w_gate, w_up, w_down, shared_gate, shared_up, shared_down) {
  s = sigmoid(linear(h, router))
  c, ids = group_topk(s + router_bias, k=TOPK, groups=NG, topk_groups=TG)
  w = take(s, ids)
  r = moe_experts(h, w / rowsum(w) * RSF, ids, w_gate, w_up, w_down, act=swiglu)
  return r + linear(swiglu(linear(h, shared_gate), linear(h, shared_up)), shared_down)
}

layer dense(x) {
  x = x + mla(rmsnorm(x, attn_norm, eps=EPS), wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo, kv_cache)
  return x + dense_mlp(rmsnorm(x, mlp_norm, eps=EPS))
}

layer moe(x) {
  x = x + mla(rmsnorm(x, attn_norm, eps=EPS), wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo, kv_cache)
  return x + moe_ffn(rmsnorm(x, mlp_norm, eps=EPS), router, router_bias, w_gate, w_up, w_down,
                     shared_gate, shared_up, shared_down)
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

# Multi-token prediction (the checkpoint's layer 61; num_nextn_predict_layers = 1): the hidden state
# h the layers give for a token (before the final norm) and the embedding of the token after it,
# each RMS-normed, concatenated [embedding | hidden] (`eh_proj`'s input order, inferred from its
# name), projected back to H, through one MoE layer of its own, then its own norm and the shared
# output head. The host runs it for each draft (docs/language.md, "MTP heads").
mtp(h: f32[B, H], tokens, positions) {
  e = rmsnorm(embedding(tokens, embed), mtp_enorm, eps=EPS)
  x = linear(concat(e, rmsnorm(h, mtp_hnorm, eps=EPS)), mtp_eh_proj)
  x = x + mla(rmsnorm(x, mtp_attn_norm, eps=EPS), mtp_wq_a, mtp_q_norm, mtp_wq_b, mtp_wkv_a, mtp_kv_norm,
              mtp_wkv_b, mtp_wo, mtp_cache)
  x = x + moe_ffn(rmsnorm(x, mtp_mlp_norm, eps=EPS), mtp_router, mtp_router_bias, mtp_w_gate, mtp_w_up,
                  mtp_w_down, mtp_shared_gate, mtp_shared_up, mtp_shared_down)
  return x, linear(rmsnorm(x, mtp_head_norm, eps=EPS), lm_head)
}

# Where each weight comes from in the published Hugging Face checkpoint (deepseek-ai/DeepSeek-V3;
# prefix model.layers.N.; layer 61 is the MTP head's). Matrices are stored [out, in]
# (the spec's are [in, out]); an fp8 matrix is its codes `*` its 128x128 block scales, both
# transposed. The dense MLP is read for layers 0 .. DENSE-1, the router and experts (one tensor
# each, stacked over `{e}`) for the others. From this layout nothing rounds: every weight is stored
# as the spec declares it. A dequantised save (bf16 `.weight`, no scales: transformers' save of the model) loads
# by each line's `or` source, quantised back into 128x128 blocks: exactly where its values are fp8
# codes times power-of-two block scales, else rounded to nearest (DeepSeek's amax / 448 scales).
checkpoint hf {
  config {
    architecture = "DeepseekV3ForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = FD
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NH
    q_lora_rank = QR
    kv_lora_rank = KVR
    qk_nope_head_dim = NOPE
    qk_rope_head_dim = ROPE
    v_head_dim = VD
    n_routed_experts = E
    num_experts_per_tok = TOPK
    n_group = NG
    topk_group = TG
    moe_intermediate_size = FE
    n_shared_experts = 1
    first_k_dense_replace = DENSE
    routed_scaling_factor = RSF
    norm_topk_prob = true
    rms_norm_eps = EPS
    rope_theta = THETA
    rope_interleave = true
    rope_scaling.rope_type = "yarn"
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
  wq_a        = "model.layers.{l}.self_attn.q_a_proj.weight"
                * "model.layers.{l}.self_attn.q_a_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.self_attn.q_a_proj.weight" | transpose | round
  q_norm      = "model.layers.{l}.self_attn.q_a_layernorm.weight"
  wq_b        = "model.layers.{l}.self_attn.q_b_proj.weight"
                * "model.layers.{l}.self_attn.q_b_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.self_attn.q_b_proj.weight" | transpose | round
  wkv_a       = "model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight"
                * "model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight_scale_inv" | transpose
                or "model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight" | transpose | round
  kv_norm     = "model.layers.{l}.self_attn.kv_a_layernorm.weight"
  wkv_b       = "model.layers.{l}.self_attn.kv_b_proj.weight"
                * "model.layers.{l}.self_attn.kv_b_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.self_attn.kv_b_proj.weight" | transpose | round
  wo          = "model.layers.{l}.self_attn.o_proj.weight"
                * "model.layers.{l}.self_attn.o_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.self_attn.o_proj.weight" | transpose | round
  dense_gate  = "model.layers.{l}.mlp.gate_proj.weight" * "model.layers.{l}.mlp.gate_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.gate_proj.weight" | transpose | round
  dense_up    = "model.layers.{l}.mlp.up_proj.weight" * "model.layers.{l}.mlp.up_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.up_proj.weight" | transpose | round
  dense_down  = "model.layers.{l}.mlp.down_proj.weight" * "model.layers.{l}.mlp.down_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.down_proj.weight" | transpose | round
  router      = "model.layers.{l}.mlp.gate.weight" | transpose
  router_bias = "model.layers.{l}.mlp.gate.e_score_correction_bias"
  w_gate      = "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"
                * "model.layers.{l}.mlp.experts.{e}.gate_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.experts.{e}.gate_proj.weight" | transpose | round
  w_up        = "model.layers.{l}.mlp.experts.{e}.up_proj.weight"
                * "model.layers.{l}.mlp.experts.{e}.up_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.experts.{e}.up_proj.weight" | transpose | round
  w_down      = "model.layers.{l}.mlp.experts.{e}.down_proj.weight"
                * "model.layers.{l}.mlp.experts.{e}.down_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.experts.{e}.down_proj.weight" | transpose | round
  shared_gate = "model.layers.{l}.mlp.shared_experts.gate_proj.weight"
                * "model.layers.{l}.mlp.shared_experts.gate_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.shared_experts.gate_proj.weight" | transpose | round
  shared_up   = "model.layers.{l}.mlp.shared_experts.up_proj.weight"
                * "model.layers.{l}.mlp.shared_experts.up_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.shared_experts.up_proj.weight" | transpose | round
  shared_down = "model.layers.{l}.mlp.shared_experts.down_proj.weight"
                * "model.layers.{l}.mlp.shared_experts.down_proj.weight_scale_inv" | transpose
                or "model.layers.{l}.mlp.shared_experts.down_proj.weight" | transpose | round
  mtp_enorm       = "model.layers.61.enorm.weight"
  mtp_hnorm       = "model.layers.61.hnorm.weight"
  mtp_eh_proj     = "model.layers.61.eh_proj.weight" | transpose
  mtp_head_norm   = "model.layers.61.shared_head.norm.weight"
  mtp_attn_norm   = "model.layers.61.input_layernorm.weight"
  mtp_mlp_norm    = "model.layers.61.post_attention_layernorm.weight"
  mtp_wq_a        = "model.layers.61.self_attn.q_a_proj.weight"
                    * "model.layers.61.self_attn.q_a_proj.weight_scale_inv" | transpose
                or "model.layers.61.self_attn.q_a_proj.weight" | transpose | round
  mtp_q_norm      = "model.layers.61.self_attn.q_a_layernorm.weight"
  mtp_wq_b        = "model.layers.61.self_attn.q_b_proj.weight"
                    * "model.layers.61.self_attn.q_b_proj.weight_scale_inv" | transpose
                or "model.layers.61.self_attn.q_b_proj.weight" | transpose | round
  mtp_wkv_a       = "model.layers.61.self_attn.kv_a_proj_with_mqa.weight"
                    * "model.layers.61.self_attn.kv_a_proj_with_mqa.weight_scale_inv" | transpose
                or "model.layers.61.self_attn.kv_a_proj_with_mqa.weight" | transpose | round
  mtp_kv_norm     = "model.layers.61.self_attn.kv_a_layernorm.weight"
  mtp_wkv_b       = "model.layers.61.self_attn.kv_b_proj.weight"
                    * "model.layers.61.self_attn.kv_b_proj.weight_scale_inv" | transpose
                or "model.layers.61.self_attn.kv_b_proj.weight" | transpose | round
  mtp_wo          = "model.layers.61.self_attn.o_proj.weight"
                    * "model.layers.61.self_attn.o_proj.weight_scale_inv" | transpose
                or "model.layers.61.self_attn.o_proj.weight" | transpose | round
  mtp_router      = "model.layers.61.mlp.gate.weight" | transpose
  mtp_router_bias = "model.layers.61.mlp.gate.e_score_correction_bias"
  mtp_w_gate      = "model.layers.61.mlp.experts.{e}.gate_proj.weight"
                    * "model.layers.61.mlp.experts.{e}.gate_proj.weight_scale_inv" | transpose
                or "model.layers.61.mlp.experts.{e}.gate_proj.weight" | transpose | round
  mtp_w_up        = "model.layers.61.mlp.experts.{e}.up_proj.weight"
                    * "model.layers.61.mlp.experts.{e}.up_proj.weight_scale_inv" | transpose
                or "model.layers.61.mlp.experts.{e}.up_proj.weight" | transpose | round
  mtp_w_down      = "model.layers.61.mlp.experts.{e}.down_proj.weight"
                    * "model.layers.61.mlp.experts.{e}.down_proj.weight_scale_inv" | transpose
                or "model.layers.61.mlp.experts.{e}.down_proj.weight" | transpose | round
  mtp_shared_gate = "model.layers.61.mlp.shared_experts.gate_proj.weight"
                    * "model.layers.61.mlp.shared_experts.gate_proj.weight_scale_inv" | transpose
                or "model.layers.61.mlp.shared_experts.gate_proj.weight" | transpose | round
  mtp_shared_up   = "model.layers.61.mlp.shared_experts.up_proj.weight"
                    * "model.layers.61.mlp.shared_experts.up_proj.weight_scale_inv" | transpose
                or "model.layers.61.mlp.shared_experts.up_proj.weight" | transpose | round
  mtp_shared_down = "model.layers.61.mlp.shared_experts.down_proj.weight"
                    * "model.layers.61.mlp.shared_experts.down_proj.weight_scale_inv" | transpose
                or "model.layers.61.mlp.shared_experts.down_proj.weight" | transpose | round
}
