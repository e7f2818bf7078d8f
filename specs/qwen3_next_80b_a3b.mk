# Qwen3-Next-80B-A3B: one greedy decode step.
# 48 layers: Gated DeltaNet (linear attention) everywhere except gated full attention at
# (l + 1) % 4 == 0; every layer's MLP is a MoE (512 bf16 experts, top 10 of a softmax,
# renormalised, SwiGLU of width 512) plus a shared SwiGLU expert of width 512 scaled by a
# sigmoid gate. Every norm but the GDN output norm is (1 + w). Sizes and equations: the published
# config.json and model card of Qwen/Qwen3-Next-80B-A3B-Instruct and its reference implementation.
#
# Weights are declared in the order the equations use them, as [in, out] matrices (the
# checkpoint's [out, in] transposed). The `checkpoint hf` section at the end regroups these
# checkpoint tensors (prefix model.layers.N.):
# * linear_attn.in_proj_qkvz.weight [12288, 2048] is grouped per key head g (16 groups of 768
#   rows: q_g 128 | k_g 128 | v_2g, v_2g+1 256 | z_2g, z_2g+1 256): gdn_wq takes the q_g rows of
#   every group in head order, gdn_wk the k_g rows, gdn_wv the v rows, gdn_wz the z rows.
# * linear_attn.in_proj_ba.weight [64, 2048], per group of 4 (b_2g, b_2g+1, a_2g, a_2g+1):
#   gdn_wba's columns are the 32 b rows in head order, then the 32 a rows, then 64 zero columns
#   (a matmul's width is a whole number of 128-lane tiles; `slice` takes b and a back out).
# * linear_attn.conv1d.weight [8192, 1, 4] over the channels [q 2048 | k 2048 | v 4096] (the
#   depthwise conv is per channel): gdn_conv_q/k/v are its three row ranges, as [4, channels].
# * self_attn.q_proj.weight [8192, 2048] interleaves per head h (512 rows: query 256 | gate 256):
#   attn_wq takes the query rows of every head, attn_wg the gate rows.
# * mlp.experts.E.{gate,up,down}_proj.weight stack into moe_w1, moe_w3, moe_w2 [512, ...];
#   mlp.shared_expert_gate.weight [1, 2048] is the vector shared_egate.
# Everything else maps one to one (A_log -> gdn_a_log, linear_attn.norm -> gdn_norm, ...).
# The MTP head (mtp.*) is not part of normal decoding and is not declared.
model qwen3_next_80b_a3b

const L      = 48        # layers
const H      = 2048      # hidden width
const V      = 151936    # vocabulary
const EPS    = 0.000001  # rms_norm_eps (and the GDN l2norm's epsilon)
# Gated DeltaNet
const NK     = 16        # key heads (q and k)
const NV     = 32        # value heads; value heads 2g, 2g+1 share key head g
const DK     = 128
const DV     = 128
const CONV   = 4         # causal conv taps
const BA     = (2 * NV + 127) // 128 * 128   # [beta | a] projection, padded to whole lane tiles
# Gated full attention
const NH     = 16        # query heads
const NKV    = 2         # KV heads
const HD     = 256       # head dim
const ROT    = 64        # rotated dims per head (partial_rotary_factor 0.25)
const THETA  = 10000000.0
# MoE
const E      = 512       # routed experts
const TOPK   = 10
const FE     = 512       # expert width
const FS     = 512       # shared expert width

dim B in 1 .. 8          # rows decoded together
dim S in 1 .. 262144     # cache length (max_position_embeddings)

# Devices: 4 TPU7x chips = 8 cores (tpu7x:2x2x1), 159 GB of bf16 weights, ~20 GB per core.
const EPN = 4
const TPN = 2
mesh { ep = EPN  tp = TPN }

# Small enough for TPU interpret mode, sharded over 2 devices (ep 2 x tp 1): 3 GDN layers and one
# gated-attention layer; the published head dims (128 for GDN, 256 with 64 rotated for
# attention), two value heads per key head, top-10 routing; 128 experts, since the router's
# columns must be whole 128-lane tiles.
profile mini {
  L = 4
  H = 256
  V = 1024
  NK = 2
  NV = 4
  NH = 4
  E = 128
  FE = 128
  FS = 128
  EPN = 2
  TPN = 1
}

# ---- embedding, output head, layer norms ((1 + w) weights, stored as w)
weight embed:        bf16[V, H]
weight lm_head:      bf16[H, V]
weight final_norm:   bf16[H]
weight input_norm:   bf16[H]  per layer
weight post_norm:    bf16[H]  per layer

# ---- Gated DeltaNet (layers of kind gdn); split by key head with its two value heads
weight gdn_wq:       bf16[H, NK*DK @(ep, tp)]      per layer(gdn)
weight gdn_wk:       bf16[H, NK*DK @(ep, tp)]      per layer(gdn)
weight gdn_wv:       bf16[H, NV*DV @(ep, tp)]      per layer(gdn)
weight gdn_wz:       bf16[H, NV*DV @(ep, tp)]      per layer(gdn)
weight gdn_wba:      bf16[H, BA]                   per layer(gdn)
weight gdn_conv_q:   bf16[CONV, NK*DK @(ep, tp)]   per layer(gdn)
weight gdn_conv_k:   bf16[CONV, NK*DK @(ep, tp)]   per layer(gdn)
weight gdn_conv_v:   bf16[CONV, NV*DV @(ep, tp)]   per layer(gdn)
weight gdn_a_log:    f32[NV]                       per layer(gdn)
weight gdn_dt_bias:  f32[NV]                       per layer(gdn)
weight gdn_norm:     bf16[DV]                      per layer(gdn)
weight gdn_wo:       bf16[NV*DV @(ep, tp), H]      per layer(gdn)

state gdn_state:     f32[B, NV @(ep, tp), DK, DV]         per layer(gdn)
state gdn_q_conv:    f32[B, CONV - 1, NK*DK @(ep, tp)]    per layer(gdn)
state gdn_k_conv:    f32[B, CONV - 1, NK*DK @(ep, tp)]    per layer(gdn)
state gdn_v_conv:    f32[B, CONV - 1, NV*DV @(ep, tp)]    per layer(gdn)

# ---- gated full attention (layers of kind full_attn); split by KV head over tp
weight attn_wq:      bf16[H, NH*HD @tp]    per layer(full_attn)
weight attn_wg:      bf16[H, NH*HD @tp]    per layer(full_attn)
weight attn_wk:      bf16[H, NKV*HD @tp]   per layer(full_attn)
weight attn_wv:      bf16[H, NKV*HD @tp]   per layer(full_attn)
weight attn_qnorm:   bf16[HD]              per layer(full_attn)
weight attn_knorm:   bf16[HD]              per layer(full_attn)
weight attn_wo:      bf16[NH*HD @tp, H]    per layer(full_attn)

state k_cache:       bf16[B, NKV @tp, S, HD]   per layer(full_attn)
state v_cache:       bf16[B, NKV @tp, S, HD]   per layer(full_attn)

# ---- MoE, every layer: experts split by owner over all cores, the shared expert by columns
weight moe_router:   bf16[H, E]                    per layer
weight moe_w1:       bf16[E @(ep, tp), H, FE]      per layer
weight moe_w3:       bf16[E @(ep, tp), H, FE]      per layer
weight moe_w2:       bf16[E @(ep, tp), FE, H]      per layer
weight shared_gate:  bf16[H, FS @tp]               per layer
weight shared_up:    bf16[H, FS @tp]               per layer
weight shared_down:  bf16[FS @tp, H]               per layer
weight shared_egate: bf16[H]                       per layer

block gated_deltanet(h) {
  q = l2norm(short_conv(linear(h, gdn_wq), gdn_conv_q, gdn_q_conv), heads=NK, scale=DK ** -0.5, eps=EPS)
  k = l2norm(short_conv(linear(h, gdn_wk), gdn_conv_k, gdn_k_conv), heads=NK, eps=EPS)
  v = short_conv(linear(h, gdn_wv), gdn_conv_v, gdn_v_conv)
  ba = linear(h, gdn_wba)
  beta = sigmoid(slice(ba, start=0, size=NV))
  g = -exp(gdn_a_log) * softplus(slice(ba, start=NV, size=NV) + gdn_dt_bias)   # one decay per value head
  o = recurrent(q, k, v, gdn_state, g, beta, heads=NV, key_heads=NK, rule="delta")
  return linear(rmsnorm(o, gdn_norm, heads=NV, eps=EPS) * silu(linear(h, gdn_wz)), gdn_wo)
}

block gated_attention(h) {
  q = rope(rmsnorm(linear(h, attn_wq), attn_qnorm, heads=NH, eps=EPS, offset=1.0), positions,
           heads=NH, theta=THETA, rotary_dim=ROT)
  k = rope(rmsnorm(linear(h, attn_wk), attn_knorm, heads=NKV, eps=EPS, offset=1.0), positions,
           heads=NKV, theta=THETA, rotary_dim=ROT)
  o = attention(q, k, linear(h, attn_wv), k_cache, v_cache, positions, heads=NH, kv_heads=NKV)
  return linear(o * sigmoid(linear(h, attn_wg)), attn_wo)
}

# softmax over all experts, the top 10 renormalised (norm_topk_prob); SwiGLU experts; the
# shared SwiGLU expert scaled by sigmoid(h . shared_expert_gate)
block moe(h) {
  p, ids = topk(softmax(linear(h, moe_router)), k=TOPK)
  routed = moe_experts(h, p / rowsum(p), ids, moe_w1, moe_w3, moe_w2, act=swiglu)
  shared = linear(swiglu(linear(h, shared_gate), linear(h, shared_up)), shared_down)
  return routed + shared * sigmoid(rowsum(h * shared_egate))
}

layer gdn(x) {
  x = x + gated_deltanet(rmsnorm(x, input_norm, eps=EPS, offset=1.0))
  return x + moe(rmsnorm(x, post_norm, eps=EPS, offset=1.0))
}

layer full_attn(x) {
  x = x + gated_attention(rmsnorm(x, input_norm, eps=EPS, offset=1.0))
  return x + moe(rmsnorm(x, post_norm, eps=EPS, offset=1.0))
}

layers L {
  full_attn: (l + 1) % 4 == 0
  gdn:       otherwise
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, final_norm, eps=EPS, offset=1.0), lm_head)
  return logits, argmax(logits)
}

# Where each weight comes from in the published Hugging Face checkpoint (bf16; prefix
# model.layers.N.), regrouped as the comment at the top says: `group_rows` takes one part of
# every key head's group of in_proj_qkvz rows (q 128 | k 128 | v 2 x 128 | z 2 x 128) and of
# every head's query | gate rows of q_proj; `regroup` puts in_proj_ba's b rows (2 per key head)
# before its a rows, `pad` adds the zero columns up to BA; the conv's three channel ranges lose
# its [C, 1, 4] middle dimension; experts are stacked over `{e}`.
checkpoint hf {
  config {
    architecture = "Qwen3NextForCausalLM"
    vocab_size = V
    hidden_size = H
    num_hidden_layers = L
    rms_norm_eps = EPS
    linear_num_key_heads = NK
    linear_num_value_heads = NV
    linear_key_head_dim = DK
    linear_value_head_dim = DV
    linear_conv_kernel_dim = CONV
    num_attention_heads = NH
    num_key_value_heads = NKV
    head_dim = HD
    partial_rotary_factor = ROT / HD
    rope_theta = THETA
    full_attention_interval = 4
    num_experts = E
    num_experts_per_tok = TOPK
    norm_topk_prob = true
    moe_intermediate_size = FE
    shared_expert_intermediate_size = FS
    decoder_sparse_step = 1
    tie_word_embeddings = false
  }
  embed        = "model.embed_tokens.weight"
  lm_head      = "lm_head.weight" | transpose
  final_norm   = "model.norm.weight"
  input_norm   = "model.layers.{l}.input_layernorm.weight"
  post_norm    = "model.layers.{l}.post_attention_layernorm.weight"
  gdn_wq       = "model.layers.{l}.linear_attn.in_proj_qkvz.weight"
                 | group_rows(groups=NK, start=0, stop=DK) | transpose
  gdn_wk       = "model.layers.{l}.linear_attn.in_proj_qkvz.weight"
                 | group_rows(groups=NK, start=DK, stop=2*DK) | transpose
  gdn_wv       = "model.layers.{l}.linear_attn.in_proj_qkvz.weight"
                 | group_rows(groups=NK, start=2*DK, stop=2*DK + NV//NK*DV) | transpose
  gdn_wz       = "model.layers.{l}.linear_attn.in_proj_qkvz.weight"
                 | group_rows(groups=NK, start=2*DK + NV//NK*DV, stop=2*DK + 2*(NV//NK)*DV) | transpose
  gdn_wba      = "model.layers.{l}.linear_attn.in_proj_ba.weight" | regroup(groups=NK, parts=2) | pad(BA) | transpose
  gdn_conv_q   = "model.layers.{l}.linear_attn.conv1d.weight" | rows(0, NK*DK) | squeeze(1) | transpose
  gdn_conv_k   = "model.layers.{l}.linear_attn.conv1d.weight" | rows(NK*DK, 2*NK*DK) | squeeze(1) | transpose
  gdn_conv_v   = "model.layers.{l}.linear_attn.conv1d.weight"
                 | rows(2*NK*DK, 2*NK*DK + NV*DV) | squeeze(1) | transpose
  gdn_a_log    = "model.layers.{l}.linear_attn.A_log"
  gdn_dt_bias  = "model.layers.{l}.linear_attn.dt_bias"
  gdn_norm     = "model.layers.{l}.linear_attn.norm.weight"
  gdn_wo       = "model.layers.{l}.linear_attn.out_proj.weight" | transpose
  attn_wq      = "model.layers.{l}.self_attn.q_proj.weight" | group_rows(groups=NH, start=0, stop=HD) | transpose
  attn_wg      = "model.layers.{l}.self_attn.q_proj.weight" | group_rows(groups=NH, start=HD, stop=2*HD) | transpose
  attn_wk      = "model.layers.{l}.self_attn.k_proj.weight" | transpose
  attn_wv      = "model.layers.{l}.self_attn.v_proj.weight" | transpose
  attn_qnorm   = "model.layers.{l}.self_attn.q_norm.weight"
  attn_knorm   = "model.layers.{l}.self_attn.k_norm.weight"
  attn_wo      = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  moe_router   = "model.layers.{l}.mlp.gate.weight" | transpose
  moe_w1       = "model.layers.{l}.mlp.experts.{e}.gate_proj.weight" | transpose
  moe_w3       = "model.layers.{l}.mlp.experts.{e}.up_proj.weight" | transpose
  moe_w2       = "model.layers.{l}.mlp.experts.{e}.down_proj.weight" | transpose
  shared_gate  = "model.layers.{l}.mlp.shared_expert.gate_proj.weight" | transpose
  shared_up    = "model.layers.{l}.mlp.shared_expert.up_proj.weight" | transpose
  shared_down  = "model.layers.{l}.mlp.shared_expert.down_proj.weight" | transpose
  shared_egate = "model.layers.{l}.mlp.shared_expert_gate.weight" | squeeze(0)
}
