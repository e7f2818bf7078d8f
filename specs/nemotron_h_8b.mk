# NVIDIA Nemotron-H-8B (Base, 8K): one greedy decode step of a hybrid Mamba2 / attention model.
# 52 single-mixer layers, each `x + mixer(rmsnorm(x))`: 24 Mamba2 layers, 24 MLP layers
# (squared-ReLU, no gate) and 4 attention layers, in the order of the config's
# hybrid_override_pattern (M: Mamba2, -: MLP, *: attention). Attention has no position encoding
# (no RoPE). Sizes and equations: the config.json of nvidia/Nemotron-H-8B-Base-8K and its reference
# implementation, transformers' `nemotron_h` (whose NemotronHConfig defaults are these widths).
#
# Mamba2 mixer per row (in_proj [z I | x I | B G*N | C G*N | dt NH] rows, all linear, no bias):
#   x, B, C = silu(conv1d(.) + conv bias)   (one depthwise conv over [x | B | C], split in three)
#   dt = softplus(dt + dt_bias);  S_h = exp(dt_h * A_h) S_h + dt_h B_g x_h^T, A = -exp(A_log)
#   y_h = S_h^T C_g + D_h x_h     (head h reads group g = h // (NH / G))
#   out = out_proj(rmsnorm_G(y * silu(z)) * norm.weight): the gated norm gates first, then
#   normalises each of the G groups of I/G channels alone (norm_before_gate=False).
# Weights are declared [in, out]; the `checkpoint hf` section cuts in_proj's rows and the conv's
# channels into the parts above. D (one per head) is stored once per channel of the head
# (`repeat`), so the D skip is an elementwise product.
model nemotron_h_8b

const L       = 52        # layers (len(hybrid_override_pattern))
const PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
const H       = 4096      # hidden_size
const V       = 131072    # vocab_size
const EPS     = 0.00001   # layer_norm_epsilon (every RMSNorm, the gated one too)
# Mamba2
const NH      = 128       # mamba_num_heads
const P       = 64        # mamba_head_dim
const I       = NH * P    # the mixer's inner width (8192 = expand 2 x hidden)
const N       = 128       # ssm_state_size
const G       = 8         # n_groups (B and C groups)
const K       = 4         # conv_kernel
# attention (no RoPE)
const NQ      = 32        # num_attention_heads
const NKV     = 8         # num_key_value_heads
const D       = 128       # head_dim
# MLP
const F       = 21504     # intermediate_size (relu2)

dim B in 1 .. 8           # rows decoded together
dim S in 1 .. 8192        # KV cache length (max_position_embeddings)

# One TPU7x core: 8.1 B bf16 parameters, 16 GB.
mesh { tp = 1 }

# The first 8 layers of the pattern (M-M-M-M*: every kind), at widths TPU interpret mode runs:
# 4 Mamba heads of the published 64 channels in 2 groups of the published state width 128.
profile mini {
  L = 8
  PATTERN = "M-M-M-M*"
  H = 256
  V = 512
  NH = 4
  G = 2
  NQ = 4
  NKV = 2
  D = 64
  F = 512
}

weight embed:      bf16[V, H]
weight norm:       bf16[H]         per layer
weight norm_f:     bf16[H]
weight lm_head:    bf16[H, V]

# ---- Mamba2 (layers of kind mamba)
weight ssm_wz:     bf16[H, I]      per layer(mamba)
weight ssm_wx:     bf16[H, I]      per layer(mamba)
weight ssm_wb:     bf16[H, G*N]    per layer(mamba)
weight ssm_wc:     bf16[H, G*N]    per layer(mamba)
weight ssm_wdt:    bf16[H, NH]     per layer(mamba)
weight conv_x:     bf16[K, I]      per layer(mamba)
weight conv_b:     bf16[K, G*N]    per layer(mamba)
weight conv_c:     bf16[K, G*N]    per layer(mamba)
weight conv_bx:    bf16[I]         per layer(mamba)
weight conv_bb:    bf16[G*N]       per layer(mamba)
weight conv_bc:    bf16[G*N]       per layer(mamba)
weight a_log:      f32[NH]         per layer(mamba)
weight dt_bias:    bf16[NH]        per layer(mamba)
weight ssm_d:      bf16[I]         per layer(mamba)
weight ssm_norm:   bf16[I]         per layer(mamba)
weight ssm_wo:     bf16[I, H]      per layer(mamba)

state ssm:         f32[B, NH, N, P]    per layer(mamba)
state cx:          f32[B, K - 1, I]    per layer(mamba)
state cb:          f32[B, K - 1, G*N]  per layer(mamba)
state cc:          f32[B, K - 1, G*N]  per layer(mamba)

# ---- attention (layers of kind attn)
weight wq:         bf16[H, NQ*D]   per layer(attn)
weight wk:         bf16[H, NKV*D]  per layer(attn)
weight wv:         bf16[H, NKV*D]  per layer(attn)
weight wo:         bf16[NQ*D, H]   per layer(attn)

state k_cache:     bf16[B, NKV, S, D]  per layer(attn)
state v_cache:     bf16[B, NKV, S, D]  per layer(attn)

# ---- MLP (layers of kind mlp)
weight w_up:       bf16[H, F]      per layer(mlp)
weight w_down:     bf16[F, H]      per layer(mlp)

block mamba2(h) {
  x = short_conv(linear(h, ssm_wx), conv_x, cx, conv_bx)
  b = short_conv(linear(h, ssm_wb), conv_b, cb, conv_bb)
  c = short_conv(linear(h, ssm_wc), conv_c, cc, conv_bc)
  dt = softplus(linear(h, ssm_wdt) + dt_bias)
  y = recurrent(c, b, x, ssm, -exp(a_log) * dt, dt, heads=NH, key_heads=G, rule="outer") + x * ssm_d
  return linear(rmsnorm(y * silu(linear(h, ssm_wz)), ssm_norm, heads=G, eps=EPS), ssm_wo)
}

block self_attention(h) {
  a = attention(linear(h, wq), linear(h, wk), linear(h, wv), k_cache, v_cache, positions, heads=NQ, kv_heads=NKV)
  return linear(a, wo)
}

block relu2_mlp(h) {
  return linear(square(relu(linear(h, w_up))), w_down)
}

layer mamba(x) {
  return x + mamba2(rmsnorm(x, norm, eps=EPS))
}

layer attn(x) {
  return x + self_attention(rmsnorm(x, norm, eps=EPS))
}

layer mlp(x) {
  return x + relu2_mlp(rmsnorm(x, norm, eps=EPS))
}

# hybrid_override_pattern: M-M-M-M* then (-M-M-M-M-M*) x 3 then -M-M-M-M-M-
layers L {
  attn:  l % 11 == 7 and l < 44
  mamba: (l < 7 and l % 2 == 0) or (l > 7 and (l - 8) % 11 % 2 == 1)
  mlp:   otherwise
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, norm_f, eps=EPS), lm_head)
  return logits, argmax(logits)
}

# The Hugging Face checkpoint (bf16; A_log f32), names as transformers' NemotronHForCausalLM
# saves them (prefix backbone.layers.N.mixer.): in_proj.weight [I + (I + 2GN) + NH, H] cut into
# z | x | B | C | dt rows; conv1d.weight [I + 2GN, 1, K] and conv1d.bias over [x | B | C].
checkpoint hf {
  config {
    architecture = "NemotronHForCausalLM"
    vocab_size = V
    hidden_size = H
    num_hidden_layers = L
    hybrid_override_pattern = PATTERN
    layer_norm_epsilon = EPS
    mamba_num_heads = NH
    mamba_head_dim = P
    ssm_state_size = N
    n_groups = G
    conv_kernel = K
    expand = I // H
    use_conv_bias = true
    num_attention_heads = NQ
    num_key_value_heads = NKV
    head_dim = D
    intermediate_size = F
    mlp_hidden_act = "relu2"
    tie_word_embeddings = false
  }
  embed    = "backbone.embeddings.weight"
  norm     = "backbone.layers.{l}.norm.weight"
  norm_f   = "backbone.norm_f.weight"
  lm_head  = "lm_head.weight" | transpose
  ssm_wz   = "backbone.layers.{l}.mixer.in_proj.weight" | rows(0, I) | transpose
  ssm_wx   = "backbone.layers.{l}.mixer.in_proj.weight" | rows(I, 2*I) | transpose
  ssm_wb   = "backbone.layers.{l}.mixer.in_proj.weight" | rows(2*I, 2*I + G*N) | transpose
  ssm_wc   = "backbone.layers.{l}.mixer.in_proj.weight" | rows(2*I + G*N, 2*I + 2*G*N) | transpose
  ssm_wdt  = "backbone.layers.{l}.mixer.in_proj.weight" | rows(2*I + 2*G*N, 2*I + 2*G*N + NH) | transpose
  conv_x   = "backbone.layers.{l}.mixer.conv1d.weight" | rows(0, I) | squeeze(dim=1) | transpose
  conv_b   = "backbone.layers.{l}.mixer.conv1d.weight" | rows(I, I + G*N) | squeeze(dim=1) | transpose
  conv_c   = "backbone.layers.{l}.mixer.conv1d.weight" | rows(I + G*N, I + 2*G*N) | squeeze(dim=1) | transpose
  conv_bx  = "backbone.layers.{l}.mixer.conv1d.bias" | rows(0, I)
  conv_bb  = "backbone.layers.{l}.mixer.conv1d.bias" | rows(I, I + G*N)
  conv_bc  = "backbone.layers.{l}.mixer.conv1d.bias" | rows(I + G*N, I + 2*G*N)
  a_log    = "backbone.layers.{l}.mixer.A_log"
  dt_bias  = "backbone.layers.{l}.mixer.dt_bias"
  ssm_d    = "backbone.layers.{l}.mixer.D" | repeat(each=P)
  ssm_norm = "backbone.layers.{l}.mixer.norm.weight"
  ssm_wo   = "backbone.layers.{l}.mixer.out_proj.weight" | transpose
  wq       = "backbone.layers.{l}.mixer.q_proj.weight" | transpose
  wk       = "backbone.layers.{l}.mixer.k_proj.weight" | transpose
  wv       = "backbone.layers.{l}.mixer.v_proj.weight" | transpose
  wo       = "backbone.layers.{l}.mixer.o_proj.weight" | transpose
  w_up     = "backbone.layers.{l}.mixer.up_proj.weight" | transpose
  w_down   = "backbone.layers.{l}.mixer.down_proj.weight" | transpose
}
