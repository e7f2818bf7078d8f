model recurrent_outer

# The plain gated outer-product members of the `recurrent` family, one layer kind each, sharded
# over 2 devices with ONE key group (B/C, k/q) for all value heads: the keys are replicated.
const L = 3
const H = 256
const NH = 4       # value heads
const P = 64       # value head width (Mamba2's headdim)
const N = 128      # state width per head (Mamba2's d_state; the key width)
const G = 1        # key groups (Mamba2's ngroups)
const CONV = 4
const V = 512
const EPS = 0.000001
const TP = 2

mesh { tp = TP }

dim B in 1 .. 8
dim S in 1 .. 256

weight embed:    bf16[V, H]
weight norm1:    bf16[H]              per layer
weight w_x:      bf16[H, NH*P @tp]    per layer
weight w_b:      bf16[H, G*N]         per layer
weight w_c:      bf16[H, G*N]         per layer
weight w_dt:     bf16[H, 128]         per layer
weight w_gk:     bf16[H, NH*N @tp]    per layer
weight conv_x:   bf16[CONV, NH*P @tp] per layer
weight conv_b:   bf16[CONV, G*N]      per layer
weight conv_c:   bf16[CONV, G*N]      per layer
weight conv_bx:  f32[NH*P @tp]        per layer
weight conv_bb:  f32[G*N]             per layer
weight a_log:    f32[NH]              per layer
weight dt_bias:  f32[NH]              per layer
weight log_gamma: f32[NH @tp]         per layer
weight w_o:      bf16[NH*P @tp, H]    per layer
weight out_norm: bf16[H]
weight lm_head:  bf16[H, V @tp]

state ssm:  f32[B, NH @tp, N, P]        per layer
state cx:   f32[B, CONV - 1, NH*P @tp]  per layer
state cb:   f32[B, CONV - 1, G*N]       per layer
state cc:   f32[B, CONV - 1, G*N]       per layer

# Mamba2: S = exp(dt A) S + dt B x^T, y = S^T C (A = -exp(a_log), dt = softplus(. + dt_bias));
# its conv1d has a bias, then SiLU (written here both fused and as an activation of its own)
block mamba2(h) {
  x = silu(short_conv(linear(h, w_x), conv_x, cx, conv_bx, act="none"))
  b = short_conv(linear(h, w_b), conv_b, cb, conv_bb)
  c = short_conv(linear(h, w_c), conv_c, cc)
  dt = softplus(slice(linear(h, w_dt), start=0, size=NH) + dt_bias)
  y = recurrent(c, b, x, ssm, -exp(a_log) * dt, dt, heads=NH, key_heads=G, rule="outer")
  return linear(y, w_o)
}

# RetNet: a constant decay gamma_h per head, no input scale
block retention(h) {
  y = recurrent(linear(h, w_c), linear(h, w_b), linear(h, w_x), ssm, log_gamma, heads=NH, key_heads=G, rule="outer")
  return linear(y, w_o)
}

# GLA: a decay per key channel, log-sigmoid of a projection
block gla(h) {
  gk = -softplus(-linear(h, w_gk))
  y = recurrent(linear(h, w_c), linear(h, w_b), linear(h, w_x), ssm, gk, heads=NH, key_heads=G, rule="outer")
  return linear(y, w_o)
}

layer ssm_layer(x) {
  return x + mamba2(rmsnorm(x, norm1, eps=EPS))
}

layer ret_layer(x) {
  return x + retention(rmsnorm(x, norm1, eps=EPS))
}

layer gla_layer(x) {
  return x + gla(rmsnorm(x, norm1, eps=EPS))
}

layers L {
  ssm_layer: l == 0
  ret_layer: l == 1
  gla_layer: otherwise
}

step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}
