# specs/tiny.mk with a multi-token-prediction head (as DeepSeek-V3 declares one, specs/deepseek_v3.mk):
# the target's last hidden state and the next token's embedding, normed, concatenated, projected,
# one decoder layer with its own cache, the shared output head. For the MTP drafter's tests.
model tiny_mtp

const L = 2
const H = 128
const NH = 2
const NKV = 1
const D = 128
const F = 256
const V = 256

dim B in 1 .. 8
dim S in 1 .. 256

weight embed:     bf16[V, H]
weight norm1:     bf16[H]        per layer
weight wq:        bf16[H, NH*D]  per layer
weight wk:        bf16[H, NKV*D] per layer
weight wv:        bf16[H, NKV*D] per layer
weight wo:        bf16[NH*D, H]  per layer
weight norm2:     bf16[H]        per layer
weight w_gate:    bf16[H, F]     per layer
weight w_up:      bf16[H, F]     per layer
weight w_down:    bf16[F, H]     per layer
weight out_norm:  bf16[H]
weight lm_head:   bf16[H, V]

weight mtp_enorm:     bf16[H]
weight mtp_hnorm:     bf16[H]
weight mtp_eh_proj:   bf16[2*H, H]
weight mtp_norm1:     bf16[H]
weight mtp_wq:        bf16[H, NH*D]
weight mtp_wk:        bf16[H, NKV*D]
weight mtp_wv:        bf16[H, NKV*D]
weight mtp_wo:        bf16[NH*D, H]
weight mtp_norm2:     bf16[H]
weight mtp_w_gate:    bf16[H, F]
weight mtp_w_up:      bf16[H, F]
weight mtp_w_down:    bf16[F, H]
weight mtp_head_norm: bf16[H]

state k_cache: bf16[B, NKV, S, D] per layer
state v_cache: bf16[B, NKV, S, D] per layer
state mtp_k_cache: bf16[B, NKV, S, D]
state mtp_v_cache: bf16[B, NKV, S, D]

block decoder_layer(x, norm1, wq, wk, wv, wo, norm2, w_gate, w_up, w_down, k_cache, v_cache) {
  h = rmsnorm(x, norm1)
  q = rope(linear(h, wq), pos, heads=NH)
  k = rope(linear(h, wk), pos, heads=NKV)
  a = attention(q, k, linear(h, wv), k_cache, v_cache, pos, heads=NH, kv_heads=NKV)
  x = x + linear(a, wo)
  h = rmsnorm(x, norm2)
  return x + linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)
}

layer decoder(x) {
  return decoder_layer(x, norm1, wq, wk, wv, wo, norm2, w_gate, w_up, w_down, k_cache, v_cache)
}

layers L { decoder: otherwise }

step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm), lm_head)
  return logits, argmax(logits)
}

mtp(h: f32[B, H], tokens, pos) {
  e = rmsnorm(embedding(tokens, embed), mtp_enorm)
  x = linear(concat(e, rmsnorm(h, mtp_hnorm)), mtp_eh_proj)
  x = decoder_layer(x, mtp_norm1, mtp_wq, mtp_wk, mtp_wv, mtp_wo, mtp_norm2, mtp_w_gate, mtp_w_up, mtp_w_down,
                    mtp_k_cache, mtp_v_cache)
  return x, linear(rmsnorm(x, mtp_head_norm), lm_head)
}
