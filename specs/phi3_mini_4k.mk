# Phi-3-mini-4k-instruct: one greedy decode step.
# Config values used (microsoft/Phi-3-mini-4k-instruct config.json): num_hidden_layers 32,
# hidden_size 3072, num_attention_heads 32, num_key_value_heads 32 (head_dim 3072 / 32 = 96),
# intermediate_size 8192, hidden_act silu, rope_theta 10000, rope_scaling null,
# rms_norm_eps 1e-5, sliding_window 2047, vocab_size 32064, max_position_embeddings 4096,
# tie_word_embeddings false.
# Equations (transformers Phi3DecoderLayer, Phi3Attention, Phi3MLP): plain RMSNorm before each
# sublayer; one fused qkv_proj [9216, 3072] whose rows are q (3072), k (3072), v (3072); rotate-half
# RoPE over the whole 96-wide head; attention at scale 96^-0.5 over the last 2047 tokens (the new
# one included; transformers' sliding-window mask keeps keys q - 2046 .. q); one fused
# gate_up_proj [16384, 3072], gate rows first, then up, `down(silu(gate) * up)`; final RMSNorm;
# untied head.
#
# As published, with one note on the checkpoint: the fused q|k|v and gate|up projections are
# declared as separate weights (wq, wk, wv, w_gate, w_up), the rows of the stored tensors they
# are (a checkpoint mapping takes them with `rows(start, stop)`), so that each splits over the
# mesh by heads and columns.
#
# Deployment: 2 TPU7x cores (one chip), tp 2: 16 heads of 96 per core (1536 columns of q, k and
# v), 4096 MLP columns, 16032 vocabulary columns (padded by the compiler to 16128).
model phi3_mini_4k

const L      = 32        # layers
const H      = 3072      # hidden width
const NH     = 32        # heads (query and key/value)
const D      = 96        # head dim
const F      = 8192      # MLP width
const V      = 32064     # vocabulary
const EPS    = 0.00001   # rmsnorm epsilon
const THETA  = 10000.0   # rope base
const WINDOW = 2047      # sliding_window

const TPN = 2
mesh { tp = TPN }

dim B in 1 .. 8          # rows decoded together
dim S in 1 .. 4096       # KV cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded over 2 devices: the published head dim 96 and a
# 40-token window, so a short cache already reaches past it.
profile mini {
  L = 2
  H = 256
  NH = 8
  F = 512
  V = 1000
  WINDOW = 40
}

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]             per layer
weight wq:         bf16[H, NH*D @tp]   per layer   # qkv_proj rows 0 .. 3071
weight wk:         bf16[H, NH*D @tp]   per layer   # qkv_proj rows 3072 .. 6143
weight wv:         bf16[H, NH*D @tp]   per layer   # qkv_proj rows 6144 .. 9215
weight wo:         bf16[NH*D @tp, H]   per layer
weight mlp_norm:   bf16[H]             per layer
weight w_gate:     bf16[H, F @tp]      per layer   # gate_up_proj rows 0 .. 8191
weight w_up:       bf16[H, F @tp]      per layer   # gate_up_proj rows 8192 .. 16383
weight w_down:     bf16[F @tp, H]      per layer
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @tp]

state k_cache: bf16[B, NH @tp, S, D] per layer
state v_cache: bf16[B, NH @tp, S, D] per layer

block attn(h) {
  q = rope(linear(h, wq), positions, heads=NH, theta=THETA)
  k = rope(linear(h, wk), positions, heads=NH, theta=THETA)
  a = attention(q, k, linear(h, wv), k_cache, v_cache, positions, heads=NH, kv_heads=NH, window=WINDOW)
  return linear(a, wo)
}

layer decoder(x) {
  x = x + attn(rmsnorm(x, attn_norm, eps=EPS))
  h = rmsnorm(x, mlp_norm, eps=EPS)
  return x + linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)
}

layers L { decoder: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}

# Where each weight comes from in the published Hugging Face checkpoint (bf16): qkv_proj fuses q, k, v
# and gate_up_proj gate, up along their rows; matrices are
# stored [out, in], the spec's [in, out]. `config` names transformers' class and config.json fields
# (for `mkdsl verify --against transformers`).
checkpoint hf {
  config {
    architecture = "Phi3ForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = F
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NH
    head_dim = D
    rms_norm_eps = EPS
    rope_theta = THETA
    sliding_window = WINDOW
    pad_token_id = V - 64    # 32000
    tie_word_embeddings = false
  }
  embed      = "model.embed_tokens.weight"
  attn_norm  = "model.layers.{l}.input_layernorm.weight"
  wq         = "model.layers.{l}.self_attn.qkv_proj.weight" | rows(0, NH*D) | transpose
  wk         = "model.layers.{l}.self_attn.qkv_proj.weight" | rows(NH*D, 2*NH*D) | transpose
  wv         = "model.layers.{l}.self_attn.qkv_proj.weight" | rows(2*NH*D, 3*NH*D) | transpose
  wo         = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  mlp_norm   = "model.layers.{l}.post_attention_layernorm.weight"
  w_gate     = "model.layers.{l}.mlp.gate_up_proj.weight" | rows(0, F) | transpose
  w_up       = "model.layers.{l}.mlp.gate_up_proj.weight" | rows(F, 2*F) | transpose
  w_down     = "model.layers.{l}.mlp.down_proj.weight" | transpose
  final_norm = "model.norm.weight"
  lm_head    = "lm_head.weight" | transpose
}

# llama.cpp's names (its phi3 architecture keeps the fused qkv and gate_up tensors, rows in
# Hugging Face's order). Quantised or f32 tensors round to the spec's bf16 (`round`).
checkpoint gguf {
  embed      = "token_embd.weight" | round
  attn_norm  = "blk.{l}.attn_norm.weight" | round
  wq         = "blk.{l}.attn_qkv.weight" | rows(0, NH*D) | transpose | round
  wk         = "blk.{l}.attn_qkv.weight" | rows(NH*D, 2*NH*D) | transpose | round
  wv         = "blk.{l}.attn_qkv.weight" | rows(2*NH*D, 3*NH*D) | transpose | round
  wo         = "blk.{l}.attn_output.weight" | transpose | round
  mlp_norm   = "blk.{l}.ffn_norm.weight" | round
  w_gate     = "blk.{l}.ffn_up.weight" | rows(0, F) | transpose | round
  w_up       = "blk.{l}.ffn_up.weight" | rows(F, 2*F) | transpose | round
  w_down     = "blk.{l}.ffn_down.weight" | transpose | round
  final_norm = "output_norm.weight" | round
  lm_head    = "output.weight" | transpose | round
}
