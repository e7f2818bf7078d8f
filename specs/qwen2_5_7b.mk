# Qwen2.5-7B: one greedy decode step.
# Config values used (Qwen/Qwen2.5-7B-Instruct config.json): num_hidden_layers 28,
# hidden_size 3584, num_attention_heads 28, num_key_value_heads 4 (head_dim 3584 / 28 = 128),
# intermediate_size 18944, hidden_act silu, rope_theta 1e6, rms_norm_eps 1e-6, vocab_size 152064,
# max_position_embeddings 32768, use_sliding_window false, tie_word_embeddings false.
# Equations (transformers Qwen2Attention, Qwen2MLP): q, k, v projections with biases, the output
# projection without; rotate-half RoPE over the whole head; GQA 7:1 at scale 128^-0.5; plain
# RMSNorm before each sublayer; SwiGLU MLP; a final RMSNorm; an untied head.
#
# Deployment: 4 TPU7x cores (2 chips), tp 4: 7 query heads and 1 KV head per core, 4736 MLP
# columns and 38016 vocabulary columns (the logits stay split; argmax combines the cores' bests).
model qwen2_5_7b

const L     = 28        # layers
const H     = 3584      # hidden width
const NH    = 28        # query heads
const NKV   = 4         # key/value heads
const D     = 128       # head dim
const F     = 18944     # MLP width
const V     = 152064    # vocabulary
const EPS   = 0.000001  # rmsnorm epsilon
const THETA = 1000000.0 # rope base

const TPN = 4
mesh { tp = TPN }

dim B in 1 .. 8         # rows decoded together
dim S in 1 .. 32768     # KV cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded over 2 devices: the published head dim and the
# 7:1 GQA ratio (7 query heads and 1 KV head per device, as at full size).
profile mini {
  L = 2
  H = 256
  NH = 14
  NKV = 2
  F = 512
  V = 1024
  TPN = 2
}

# Qwen2.5-32B, the same architecture (Qwen/Qwen2.5-32B-Instruct config.json: num_hidden_layers
# 64, hidden_size 5120, 40 query / 8 KV heads of 128, intermediate_size 27648, the other values
# as above) on 8 cores (4 chips): 5 query heads and 1 KV head per core.
profile qwen2_5_32b {
  L = 64
  H = 5120
  NH = 40
  NKV = 8
  F = 27648
  TPN = 8
}

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]             per layer
weight wq:         bf16[H, NH*D @tp]   per layer
weight bq:         bf16[NH*D @tp]      per layer
weight wk:         bf16[H, NKV*D @tp]  per layer
weight bk:         bf16[NKV*D @tp]     per layer
weight wv:         bf16[H, NKV*D @tp]  per layer
weight bv:         bf16[NKV*D @tp]     per layer
weight wo:         bf16[NH*D @tp, H]   per layer
weight mlp_norm:   bf16[H]             per layer
weight w_gate:     bf16[H, F @tp]      per layer
weight w_up:       bf16[H, F @tp]      per layer
weight w_down:     bf16[F @tp, H]      per layer
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @tp]

state k_cache: bf16[B, NKV @tp, S, D] per layer
state v_cache: bf16[B, NKV @tp, S, D] per layer

block attn(h) {
  q = rope(linear(h, wq) + bq, positions, heads=NH, theta=THETA)
  k = rope(linear(h, wk) + bk, positions, heads=NKV, theta=THETA)
  v = linear(h, wv) + bv
  return linear(attention(q, k, v, k_cache, v_cache, positions, heads=NH, kv_heads=NKV), wo)
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

# Where each weight comes from in the published Hugging Face checkpoint (bf16): matrices are
# stored [out, in], the spec's [in, out]. `config` names transformers' class and config.json fields
# (for `mkdsl verify --against transformers`).
checkpoint hf {
  config {
    architecture = "Qwen2ForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = F
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NKV
    head_dim = D
    rms_norm_eps = EPS
    rope_theta = THETA
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
  wo         = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  mlp_norm   = "model.layers.{l}.post_attention_layernorm.weight"
  w_gate     = "model.layers.{l}.mlp.gate_proj.weight" | transpose
  w_up       = "model.layers.{l}.mlp.up_proj.weight" | transpose
  w_down     = "model.layers.{l}.mlp.down_proj.weight" | transpose
  final_norm = "model.norm.weight"
  lm_head    = "lm_head.weight" | transpose
}

# llama.cpp's names (its qwen2 architecture keeps Hugging Face's q/k row order: no permutation).
# Quantised or f32 tensors round to the spec's bf16 (`round`); the loader says which.
checkpoint gguf {
  embed      = "token_embd.weight" | round
  attn_norm  = "blk.{l}.attn_norm.weight" | round
  wq         = "blk.{l}.attn_q.weight" | transpose | round
  bq         = "blk.{l}.attn_q.bias" | round
  wk         = "blk.{l}.attn_k.weight" | transpose | round
  bk         = "blk.{l}.attn_k.bias" | round
  wv         = "blk.{l}.attn_v.weight" | transpose | round
  bv         = "blk.{l}.attn_v.bias" | round
  wo         = "blk.{l}.attn_output.weight" | transpose | round
  mlp_norm   = "blk.{l}.ffn_norm.weight" | round
  w_gate     = "blk.{l}.ffn_gate.weight" | transpose | round
  w_up       = "blk.{l}.ffn_up.weight" | transpose | round
  w_down     = "blk.{l}.ffn_down.weight" | transpose | round
  final_norm = "output_norm.weight" | round
  lm_head    = "output.weight" | transpose | round
}
