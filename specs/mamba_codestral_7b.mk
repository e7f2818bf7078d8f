# Mistral AI Mamba-Codestral-7B (v0.1): one greedy decode step of a pure Mamba2 model.
# 64 layers, each `x + mamba2(rmsnorm(x))` (the residual kept in f32: residual_in_fp32), a final
# RMSNorm and an untied output head. Sizes and equations: the config.json of
# mistralai/Mamba-Codestral-7B-v0.1 and its reference implementation, transformers' `mamba2`
# (whose Mamba2Config defaults are these widths).
#
# Mamba2 mixer per row (in_proj [z I | x I | B G*N | C G*N | dt NH] rows, all linear, no bias):
#   x, B, C = silu(conv1d(.) + conv bias)   (one depthwise conv over [x | B | C], split in three)
#   dt = softplus(dt + dt_bias);  S_h = exp(dt_h * A_h) S_h + dt_h B_g x_h^T, A = -exp(A_log)
#   y_h = S_h^T C_g + D_h x_h     (head h reads group g = h // (NH / G))
#   out = out_proj(rmsnorm_G(y * silu(z)) * norm.weight): the gated norm gates first, then
#   normalises each of the G groups of I/G channels alone.
# Weights are declared [in, out]; the `checkpoint hf` section cuts in_proj's rows and the conv's
# channels into the parts above. D (one per head) is stored once per channel of the head
# (`repeat`), so the D skip is an elementwise product.
model mamba_codestral_7b

const L       = 64        # num_hidden_layers
const H       = 4096      # hidden_size
const V       = 32768     # vocab_size
const EPS     = 0.00001   # layer_norm_epsilon (every RMSNorm, the gated one too)
const NH      = 128       # num_heads
const P       = 64        # head_dim
const I       = NH * P    # the mixer's inner width (8192 = expand 2 x hidden)
const N       = 128       # state_size
const G       = 8         # n_groups (B and C groups)
const K       = 4         # conv_kernel

dim B in 1 .. 8           # rows decoded together

# One TPU7x core: 7.3 B bf16 parameters, 14.6 GB.
mesh { tp = 1 }

# Two layers at widths TPU interpret mode runs: 4 heads of the published 64 channels in 2 groups
# of the published state width 128 (inner width 256 = expand 1 x hidden 256).
profile mini {
  L = 2
  H = 256
  V = 512
  NH = 4
  G = 2
}

weight embed:      bf16[V, H]
weight norm:       bf16[H]         per layer
weight norm_f:     bf16[H]
weight lm_head:    bf16[H, V]
weight ssm_wz:     bf16[H, I]      per layer
weight ssm_wx:     bf16[H, I]      per layer
weight ssm_wb:     bf16[H, G*N]    per layer
weight ssm_wc:     bf16[H, G*N]    per layer
weight ssm_wdt:    bf16[H, NH]     per layer
weight conv_x:     bf16[K, I]      per layer
weight conv_b:     bf16[K, G*N]    per layer
weight conv_c:     bf16[K, G*N]    per layer
weight conv_bx:    bf16[I]         per layer
weight conv_bb:    bf16[G*N]       per layer
weight conv_bc:    bf16[G*N]       per layer
weight a_log:      f32[NH]         per layer
weight dt_bias:    bf16[NH]        per layer
weight ssm_d:      bf16[I]         per layer
weight ssm_norm:   bf16[I]         per layer
weight ssm_wo:     bf16[I, H]      per layer

state ssm:         f32[B, NH, N, P]    per layer
state cx:          f32[B, K - 1, I]    per layer
state cb:          f32[B, K - 1, G*N]  per layer
state cc:          f32[B, K - 1, G*N]  per layer

block mamba2(h) {
  x = short_conv(linear(h, ssm_wx), conv_x, cx, conv_bx)
  b = short_conv(linear(h, ssm_wb), conv_b, cb, conv_bb)
  c = short_conv(linear(h, ssm_wc), conv_c, cc, conv_bc)
  dt = softplus(linear(h, ssm_wdt) + dt_bias)
  y = recurrent(c, b, x, ssm, -exp(a_log) * dt, dt, heads=NH, key_heads=G, rule="outer") + x * ssm_d
  return linear(rmsnorm(y * silu(linear(h, ssm_wz)), ssm_norm, heads=G, eps=EPS), ssm_wo)
}

layer mamba(x) {
  return x + mamba2(rmsnorm(x, norm, eps=EPS))
}

layers L { mamba: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, norm_f, eps=EPS), lm_head)
  return logits, argmax(logits)
}

# The Hugging Face checkpoint (bf16), names as transformers' Mamba2ForCausalLM saves them (prefix
# backbone.layers.N.mixer.): in_proj.weight [I + (I + 2GN) + NH, H] cut into z | x | B | C | dt
# rows; conv1d.weight [I + 2GN, 1, K] and conv1d.bias over [x | B | C].
checkpoint hf {
  config {
    architecture = "Mamba2ForCausalLM"
    vocab_size = V
    hidden_size = H
    num_hidden_layers = L
    layer_norm_epsilon = EPS
    num_heads = NH
    head_dim = P
    state_size = N
    n_groups = G
    conv_kernel = K
    expand = I // H
    use_conv_bias = true
    residual_in_fp32 = true
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
}
