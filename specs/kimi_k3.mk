# Kimi K3: one greedy decode step.
# 93 layers: Kimi Delta Attention (KDA) everywhere except MLA at l % 4 == 3 and the last layer;
# a dense MLP at layer 0 and a latent MoE (896 MXFP4 experts, top 16, two shared experts fused)
# after it; "attention residuals" instead of a plain residual add (as the model card describes).
model kimi_k3

const L     = 93        # layers
const H     = 7168      # hidden width
const V     = 163840    # vocabulary
const NH    = 96        # heads, KDA and MLA alike
const D     = 128       # head dim (KDA key/value, MLA value)
const CONV  = 4         # KDA short-conv taps
const QR    = 1536      # MLA q rank
const KVR   = 512       # MLA kv rank (the latent cache holds KVR + XK per token)
const NOPE  = 128       # MLA per-head key dims from the latent
const XK    = 64        # MLA extra key dims, shared by all heads, not rotated
const E     = 896       # routed experts
const TOPK  = 16        # experts per token
const FE    = 3072      # expert width
const LAT   = 3584      # latent expert space
const FS    = 6144      # the two shared experts, fused
const FD    = 33792     # dense MLP width (layer 0)
const BLOCK = 12        # layers per attention-residual block
const EPS   = 0.00001

# Devices: 16 TPU7x chips = 32 cores (one JAX device each). Experts are split 8 ways by owner
# (expert parallel) and 4 ways by columns inside each expert; everything split by heads,
# columns or vocabulary uses all 32 devices (ep x tp). Axis sizes are powers of two.
const EPN   = 8
const TPN   = 4
const DEV   = EPN * TPN
mesh { ep = EPN  tp = TPN }

# All-reduces send bf16 partial sums between devices (half the bytes of f32), as the fastest
# known Kimi K3 kernel does; they are added in f32. The mini profile keeps f32 partial sums, so
# its kernel can be held to the f32 reference (the bf16 wire is checked by tests/test_comm.py).
const WIRE  = 1

# The weight ring: 21 banks of [1792, 512] bf16 (1.75 MiB each), so 20 tiles stay in flight and
# land during the exchanges (without the hint `fit_ring` stops at 13). 62.1 MiB are planned at
# batch 8, so the cap is raised from its 58 MiB default to 64: libtpu compiles the 32-core kernel
# with it at batch 1 and 8 and counts less VMEM than the planner, its own scratch included
# (tests/test_kimi_sharded_compile.py prints both). 22 banks would fit too (63.9 MiB planned) for
# 0.6 us per step with libtpu's schedule as compute (32 us with the estimate; `mkdsl plan
# --levers`), leaving no room to grow. `core` (one device, whole weights) keeps 3
# banks under the same 64 MiB cap (the delta rule's 8-state slots, the short convolutions' buffers
# and its 1024-token MLA tiles are larger there; tests/test_kimi_compile.py prints libtpu's figure).
const RING  = 21
const VCAP  = 64

# MLA's latent cache tiles: 256 tokens. With all 96 heads on one core (`core`) the tile loop's fixed
# part (the tile pushed into the MXU twice, the pops of both products) needs longer tiles to keep up
# with its stream: 1024 tokens there (0.98x its stream at 1.9 GHz against 1.65x at 256; up to 1023
# tokens read past each row's position, which the plan counts); 3 heads per core keep up at 256.
const KVT   = 256
hints { wire_bf16 = WIRE  ring_depth = RING  vmem_cap_mib = VCAP  kv_tile = KVT }

# Derived sizes. Every device's slice of a weight is a whole number of 128-lane columns, so
# weight tiles are lane aligned and no DMA is narrower than 128 lanes. Narrow projections are
# stored padded (zeros, which the loader writes): per device for the head-split ones (device
# i's block of columns holds its heads first, then zeros; `compact` drops the zeros), at the
# end for the others (`slice` drops them). Zero-padded MLP columns contribute exactly zero.
const NB    = 1 + (L - 1) // BLOCK                        # residual blocks kept (embedding + snapshots)
const HD    = NH // DEV                                   # heads per device
const NHB   = (HD + 127) // 128 * 128                     # KDA beta columns per device, padded
const QH    = HD * (NOPE + XK)                            # MLA query columns per device
const QB    = (QH + 127) // 128 * 128                     # ... padded
const KVP   = (KVR + XK + 127) // 128 * 128               # MLA kv down-projection, padded
const EP    = (E + EPN * 128 - 1) // (EPN * 128) * (EPN * 128)      # router columns, padded
const FDP   = (FD + DEV * 128 - 1) // (DEV * 128) * (DEV * 128)    # dense MLP width, padded
const LATW  = (LAT // TPN + 511) // 512 * 512                 # moe_down columns per device, padded
const FSP   = (FS + DEV * 128 - 1) // (DEV * 128) * (DEV * 128)    # shared experts, padded

dim B in 1 .. 8         # rows decoded together
dim S in 1 .. 131072    # cache length

# Small enough for TPU interpret mode, with both layer kinds, the dense layer and a block boundary.
profile mini {
  L = 8
  H = 256
  V = 1024
  NH = 8
  QR = 256
  KVR = 128
  E = 16
  TOPK = 4
  FE = 256
  LAT = 256
  FS = 256
  FD = 512
  BLOCK = 4
  EPN = 4
  TPN = 2
  WIRE = 0
}

# Published per-layer dims, only 5 layers (dense layer 0, KDA 1-2, MLA 3-4), on one device:
# about 74 GB of weights, within one TPU7x core's 94.7 GB of HBM (single-core compile check).
profile core {
  L = 5
  EPN = 1
  TPN = 1
  RING = 3
  VCAP = 64
  KVT = 1024
}

# ---- embedding, output head, residual mixing
weight embed:       bf16[V @(ep, tp), H]
weight lm_head:     bf16[H, V @(ep, tp)]
weight final_norm:  bf16[H]
weight out_res:     bf16[H]            # residual-norm weight times residual projection, folded
weight attn_res:    bf16[H]  per layer
weight mlp_res:     bf16[H]  per layer
weight input_norm:  bf16[H]  per layer
weight post_norm:   bf16[H]  per layer

# ---- KDA (layers of kinds kda_dense and kda_moe)
weight kda_wq:      bf16[H, NH*D @(ep, tp)]      per layer(kda_dense, kda_moe)
weight kda_wk:      bf16[H, NH*D @(ep, tp)]      per layer(kda_dense, kda_moe)
weight kda_wv:      bf16[H, NH*D @(ep, tp)]      per layer(kda_dense, kda_moe)
weight kda_conv_q:  bf16[CONV, NH*D @(ep, tp)]   per layer(kda_dense, kda_moe)
weight kda_conv_k:  bf16[CONV, NH*D @(ep, tp)]   per layer(kda_dense, kda_moe)
weight kda_conv_v:  bf16[CONV, NH*D @(ep, tp)]   per layer(kda_dense, kda_moe)
weight kda_wfa:     bf16[H, D]         per layer(kda_dense, kda_moe)
weight kda_wfb:     bf16[D, NH*D @(ep, tp)]      per layer(kda_dense, kda_moe)
weight kda_a_log:   f32[NH @(ep, tp)]            per layer(kda_dense, kda_moe)
weight kda_dt_bias: f32[NH*D @(ep, tp)]          per layer(kda_dense, kda_moe)
weight kda_wb:      bf16[H, DEV*NHB @(ep, tp)]       per layer(kda_dense, kda_moe)
weight kda_wg:      bf16[H, NH*D @(ep, tp)]      per layer(kda_dense, kda_moe)
weight kda_onorm:   bf16[D]            per layer(kda_dense, kda_moe)
weight kda_wo:      bf16[NH*D @(ep, tp), H]      per layer(kda_dense, kda_moe)

state kda_state:    f32[B, NH @(ep, tp), D, D]        per layer(kda_dense, kda_moe)
state kda_q_conv:   f32[B, CONV - 1, NH*D @(ep, tp)]  per layer(kda_dense, kda_moe)
state kda_k_conv:   f32[B, CONV - 1, NH*D @(ep, tp)]  per layer(kda_dense, kda_moe)
state kda_v_conv:   f32[B, CONV - 1, NH*D @(ep, tp)]  per layer(kda_dense, kda_moe)

# ---- MLA, K3 variant: no rotary embedding, gated output, latent cache with absorption
weight mla_wqa:     bf16[H, QR]            per layer(mla_moe)
weight mla_qnorm:   bf16[QR]               per layer(mla_moe)
weight mla_wqb:     bf16[QR, DEV*QB @(ep, tp)] per layer(mla_moe)
weight mla_wkva:    bf16[H, KVP]           per layer(mla_moe)
weight mla_kvnorm:  bf16[KVR]              per layer(mla_moe)
weight mla_wkvb:    bf16[KVR, NH*(NOPE+D) @(ep, tp)] per layer(mla_moe)
weight mla_wg:      bf16[H, NH*D @(ep, tp)]          per layer(mla_moe)
weight mla_wo:      bf16[NH*D @(ep, tp), H]          per layer(mla_moe)

state mla_cache:    bf16[B, S, KVR + XK]   per layer(mla_moe)

# ---- MLPs: dense at layer 0, latent MoE after it
weight dense_gate:  bf16[H, FDP @(ep, tp)]  per layer(kda_dense)
weight dense_up:    bf16[H, FDP @(ep, tp)]  per layer(kda_dense)
weight dense_down:  bf16[FDP @(ep, tp), H]  per layer(kda_dense)

weight moe_router:  bf16[H, EP @ep]         per layer(kda_moe, mla_moe)
weight moe_bias:    f32[E]              per layer(kda_moe, mla_moe)
# Placement (`mkdsl plan --placement --context 1152`, modeled): `moe_down` stays split over tp. Its
# gather (3 peers) and the router's (over ep, 7 peers) come from x alone and run as one exchange
# (the shard pass's ready-together step); split over ep instead (padded to whole 128-lane slices
# per device, which the TPU compiler needs for the gather) both gathers would go over ep and could
# not share a phase: 3531.6 / 7912.7 us at batch 1 / 8 against 3511.9 / 7763.6 us this way (before
# the padding below).
# Each device's 896 columns are stored in a block of LATW = 1024 (zeros last; `compact` drops them
# before the gather): 896 has no 128-lane divisor above 128, so unpadded it streamed as 28
# [1792, 128] tiles, whose loop libtpu schedules at 0.89x their stream, against 0.38x for the
# [1792, 512] tiles of 1024 (`mkdsl plan --static`, 1.9 GHz; 14% more bytes, which land during
# the exchanges).
# `mla_wqa`, `mla_wkva` and `kda_wfa` stay whole: split by rows over tp the first two save 62 / 38 us
# with libtpu's schedule as compute and cost 49 / 71 us with the estimate (`mkdsl plan --levers`).
weight moe_down:    bf16[H, TPN*LATW @tp]   per layer(kda_moe, mla_moe)
weight moe_w1:      mxfp4[E @ep, LAT, FE @tp]   per layer(kda_moe, mla_moe)
weight moe_w3:      mxfp4[E @ep, LAT, FE @tp]   per layer(kda_moe, mla_moe)
weight moe_w2:      mxfp4[E @ep, FE @tp, LAT]   per layer(kda_moe, mla_moe)
weight moe_rnorm:   bf16[LAT]           per layer(kda_moe, mla_moe)
weight moe_up:      bf16[LAT @(ep, tp), H]        per layer(kda_moe, mla_moe)
weight shared_gate: bf16[H, FSP @(ep, tp)]  per layer(kda_moe, mla_moe)
weight shared_up:   bf16[H, FSP @(ep, tp)]  per layer(kda_moe, mla_moe)
weight shared_down: bf16[FSP @(ep, tp), H]  per layer(kda_moe, mla_moe)

block kda(x) {
  q = l2norm(short_conv(linear(x, kda_wq), kda_conv_q, kda_q_conv), heads=NH, scale=D ** -0.5)
  k = l2norm(short_conv(linear(x, kda_wk), kda_conv_k, kda_k_conv), heads=NH)
  v = short_conv(linear(x, kda_wv), kda_conv_v, kda_v_conv)
  g = kda_gate(linear(linear(x, kda_wfa), kda_wfb), kda_a_log, kda_dt_bias, heads=NH)
  beta = sigmoid(compact(linear(x, kda_wb), block=NHB, keep=HD))
  o = recurrent(q, k, v, kda_state, g, beta, heads=NH, rule="delta")
  return linear(rmsnorm(o, kda_onorm, heads=NH, eps=EPS) * sigmoid(linear(x, kda_wg)), kda_wo)
}

block mla(x) {
  q = compact(linear(rmsnorm(linear(x, mla_wqa), mla_qnorm, eps=EPS), mla_wqb), block=QB, keep=QH)
  kv = linear(x, mla_wkva)
  c = rmsnorm(slice(kv, start=0, size=KVR), mla_kvnorm, eps=EPS)
  y = mla_attention(q, c, slice(kv, start=KVR, size=XK), mla_wkvb, mla_cache, positions,
                    heads=NH, nope=NOPE, extra=XK, vdim=D)
  return linear(y * sigmoid(linear(x, mla_wg)), mla_wo)
}

block dense_mlp(x) {
  return linear(situ(linear(x, dense_gate), linear(x, dense_up)), dense_down)
}

# The experts' gated activation, applied to each chosen expert's gate and up results.
block expert_act(g, u) {
  return situ(g, u)
}

block moe(x) {
  lat = compact(linear(x, moe_down), block=LATW, keep=LAT // TPN)  # first: its wide tiles land during the exchange before
  w, ids = route(sigmoid(slice(linear(x, moe_router), start=0, size=E)), moe_bias, k=TOPK)
  r = moe_experts(lat, w, ids, moe_w1, moe_w3, moe_w2, act=expert_act)
  shared = linear(situ(linear(x, shared_gate), linear(x, shared_up)), shared_down)
  return linear(rmsnorm(r, moe_rnorm, eps=EPS), moe_up) + shared
}

# Attention residuals: mix the kept blocks and the running prefix; every BLOCK layers the
# prefix becomes a new block.
layer kda_dense(blocks, prefix) {
  h = res_mix(blocks, prefix, attn_res, layer=l, block=BLOCK)
  blocks, prefix = res_snapshot(blocks, prefix, layer=l, block=BLOCK)
  prefix = prefix + kda(rmsnorm(h, input_norm, eps=EPS))
  m = res_mix(blocks, prefix, mlp_res, layer=l, block=BLOCK, after_snapshot=true)
  return blocks, prefix + dense_mlp(rmsnorm(m, post_norm, eps=EPS))
}

layer kda_moe(blocks, prefix) {
  h = res_mix(blocks, prefix, attn_res, layer=l, block=BLOCK)
  blocks, prefix = res_snapshot(blocks, prefix, layer=l, block=BLOCK)
  prefix = prefix + kda(rmsnorm(h, input_norm, eps=EPS))
  m = res_mix(blocks, prefix, mlp_res, layer=l, block=BLOCK, after_snapshot=true)
  return blocks, prefix + moe(rmsnorm(m, post_norm, eps=EPS))
}

layer mla_moe(blocks, prefix) {
  h = res_mix(blocks, prefix, attn_res, layer=l, block=BLOCK)
  blocks, prefix = res_snapshot(blocks, prefix, layer=l, block=BLOCK)
  prefix = prefix + mla(rmsnorm(h, input_norm, eps=EPS))
  m = res_mix(blocks, prefix, mlp_res, layer=l, block=BLOCK, after_snapshot=true)
  return blocks, prefix + moe(rmsnorm(m, post_norm, eps=EPS))
}

layers L {
  kda_dense: l == 0
  mla_moe:   l % 4 == 3 or l == L - 1
  kda_moe:   otherwise
}

step(tokens, positions) {
  blocks, prefix = res_init(embedding(tokens, embed), nblocks=NB)
  blocks, prefix = layers(blocks, prefix)
  x = res_mix(blocks, prefix, out_res, layer=L - 1, block=BLOCK, after_snapshot=true)
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}

# Where each weight comes from in the published checkpoint (moonshotai/Kimi-K3, safetensors shards;
# every name under `language_model.model.` but the output head): matrices stored [out, in] (the
# spec's are [in, out]); the routed experts packed MXFP4 (`weight_packed`, two e2m1 codes a byte
# along the input, `* weight_scale`, one E8M0 byte per 32 inputs); each attention-residual vector
# the product of its norm gain and its projection (`*`: the residual projection's [1, H] times
# the norm's [H], folded into bf16, so it says `round`). The spec's padded projections take
# their zeros here: `pad` at the end, `group_pad` in each device's block of columns.
# transformers has no class for this model: `KimiK3ForCausalLM` is mkdsl's stand-in, transformers'
# KimiLinear with K3's parts (mkdsl/verify/kimi_k3.py; the oracle: docs/verification.md). The
# config fields are the published config.json's; the experts also load a dequantised save (`or`).
checkpoint hf {
  config {
    architecture = "KimiK3ForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = FD
    moe_intermediate_size = FE
    routed_expert_hidden_size = LAT
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NH
    q_lora_rank = QR
    kv_lora_rank = KVR
    qk_nope_head_dim = NOPE
    qk_rope_head_dim = XK
    v_head_dim = D
    num_experts = E
    num_experts_per_token = TOPK
    num_shared_experts = FS // FE
    routed_scaling_factor = 1.0
    rms_norm_eps = EPS
    hidden_act = "situ"
    first_k_dense_replace = 1
    attn_res_block_size = BLOCK
    pad_token_id = V - 1     # 163839
    bos_token_id = V - 256   # 163584
    eos_token_id = V - 254   # 163586
    linear_attn_config.head_dim = D
    linear_attn_config.num_heads = NH
    linear_attn_config.short_conv_kernel_size = CONV
    linear_attn_config.gate_lower_bound = -5.0
  }
  embed       = "language_model.model.embed_tokens.weight"
  lm_head     = "language_model.lm_head.weight" | transpose
  final_norm  = "language_model.model.norm.weight"
  out_res     = "language_model.model.output_attn_res_norm.weight"
                * "language_model.model.output_attn_res_proj.weight" | round
  attn_res    = "language_model.model.layers.{l}.self_attention_res_norm.weight"
                * "language_model.model.layers.{l}.self_attention_res_proj.weight" | round
  mlp_res     = "language_model.model.layers.{l}.mlp_res_norm.weight"
                * "language_model.model.layers.{l}.mlp_res_proj.weight" | round
  input_norm  = "language_model.model.layers.{l}.input_layernorm.weight"
  post_norm   = "language_model.model.layers.{l}.post_attention_layernorm.weight"
  kda_wq      = "language_model.model.layers.{l}.self_attn.q_proj.weight" | transpose
  kda_wk      = "language_model.model.layers.{l}.self_attn.k_proj.weight" | transpose
  kda_wv      = "language_model.model.layers.{l}.self_attn.v_proj.weight" | transpose
  kda_conv_q  = "language_model.model.layers.{l}.self_attn.q_conv1d.weight" | squeeze(1) | transpose
  kda_conv_k  = "language_model.model.layers.{l}.self_attn.k_conv1d.weight" | squeeze(1) | transpose
  kda_conv_v  = "language_model.model.layers.{l}.self_attn.v_conv1d.weight" | squeeze(1) | transpose
  kda_wfa     = "language_model.model.layers.{l}.self_attn.f_a_proj.weight" | transpose
  kda_wfb     = "language_model.model.layers.{l}.self_attn.f_b_proj.weight" | transpose
  kda_a_log   = "language_model.model.layers.{l}.self_attn.A_log"
  kda_dt_bias = "language_model.model.layers.{l}.self_attn.dt_bias"
  kda_wb      = "language_model.model.layers.{l}.self_attn.b_proj.weight"
                | transpose | group_pad(groups=DEV, size=NHB, dim=1)
  kda_wg      = "language_model.model.layers.{l}.self_attn.g_proj.weight" | transpose
  kda_onorm   = "language_model.model.layers.{l}.self_attn.o_norm.weight"
  kda_wo      = "language_model.model.layers.{l}.self_attn.o_proj.weight" | transpose
  mla_wqa     = "language_model.model.layers.{l}.self_attn.q_a_proj.weight" | transpose
  mla_qnorm   = "language_model.model.layers.{l}.self_attn.q_a_layernorm.weight"
  mla_wqb     = "language_model.model.layers.{l}.self_attn.q_b_proj.weight"
                | transpose | group_pad(groups=DEV, size=QB, dim=1)
  mla_wkva    = "language_model.model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight"
                | transpose | pad(KVP, dim=1)
  mla_kvnorm  = "language_model.model.layers.{l}.self_attn.kv_a_layernorm.weight"
  mla_wkvb    = "language_model.model.layers.{l}.self_attn.kv_b_proj.weight" | transpose
  mla_wg      = "language_model.model.layers.{l}.self_attn.g_proj.weight" | transpose
  mla_wo      = "language_model.model.layers.{l}.self_attn.o_proj.weight" | transpose
  dense_gate  = "language_model.model.layers.{l}.mlp.gate_proj.weight" | transpose | pad(FDP, dim=1)
  dense_up    = "language_model.model.layers.{l}.mlp.up_proj.weight" | transpose | pad(FDP, dim=1)
  dense_down  = "language_model.model.layers.{l}.mlp.down_proj.weight" | transpose | pad(FDP)
  moe_router  = "language_model.model.layers.{l}.block_sparse_moe.gate.weight" | transpose | pad(EP, dim=1)
  moe_bias    = "language_model.model.layers.{l}.block_sparse_moe.gate.e_score_correction_bias"
  moe_down    = "language_model.model.layers.{l}.block_sparse_moe.routed_expert_down_proj.weight"
                | transpose | group_pad(groups=TPN, size=LATW, dim=1)
  moe_w1      = "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight_packed"
                * "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight_scale" | transpose
                or "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight" | transpose
  moe_w3      = "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight_packed"
                * "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight_scale" | transpose
                or "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight" | transpose
  moe_w2      = "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight_packed"
                * "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight_scale" | transpose
                or "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight" | transpose
  moe_rnorm   = "language_model.model.layers.{l}.block_sparse_moe.routed_expert_norm.weight"
  moe_up      = "language_model.model.layers.{l}.block_sparse_moe.routed_expert_up_proj.weight" | transpose
  shared_gate = "language_model.model.layers.{l}.block_sparse_moe.shared_experts.gate_proj.weight"
                | transpose | pad(FSP, dim=1)
  shared_up   = "language_model.model.layers.{l}.block_sparse_moe.shared_experts.up_proj.weight"
                | transpose | pad(FSP, dim=1)
  shared_down = "language_model.model.layers.{l}.block_sparse_moe.shared_experts.down_proj.weight"
                | transpose | pad(FSP)
}
