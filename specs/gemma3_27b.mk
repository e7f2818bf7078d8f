# Gemma 3 27B (text): one greedy decode step.
# Config values used (google/gemma-3-27b-it config.json, text_config): num_hidden_layers 62,
# hidden_size 5376, num_attention_heads 32, num_key_value_heads 16, head_dim 128,
# intermediate_size 21504, hidden_activation gelu_pytorch_tanh, vocab_size 262208,
# rms_norm_eps 1e-6, query_pre_attn_scalar 168 (scale 168^-0.5), sliding_window 1024,
# sliding_window_pattern 6 (layer l is global when (l + 1) % 6 == 0, local otherwise),
# rope_local_base_freq 10000 (local layers, no scaling), rope_theta 1e6 with
# rope_scaling {rope_type linear, factor 8} (global layers), max_position_embeddings 131072,
# tie_word_embeddings true, final_logit_softcapping and attn_logit_softcapping null.
# Equations (transformers Gemma3TextModel): every RMSNorm has (1 + w) weights; each sublayer is
# normalised before (input_layernorm, pre_feedforward_layernorm) and its output after
# (post_attention_layernorm, post_feedforward_layernorm) before the residual add; q and k get a
# per-head (1 + w) RMSNorm (q_norm, k_norm) before rotate-half RoPE over the whole head; the MLP is
# GeGLU, down(gelu_tanh(gate(h)) * up(h)); the embedding is multiplied by sqrt(hidden_size); the
# head is the embedding table, transposed.
#
# One stated detail: transformers multiplies the embedding by sqrt(5376) = 73.32 cast to the
# checkpoint dtype (bf16: 73.5) and rounds the product to bf16; here activations are f32 (the
# language's numeric contract) and the factor is the exact sqrt(H), as the equation writes it.
#
# Deployment: 4 TPU7x cores (2 chips), tp 4: 8 query and 4 KV heads per core, 5376 MLP columns
# per core, the embedding table (and so the tied head) split by vocabulary rows, 65552 per core,
# which the compiler pads to 65664 (whole 128-lane tiles); the logits stay split.
model gemma3_27b

const L       = 62          # layers
const H       = 5376        # hidden width
const NH      = 32          # query heads
const NKV     = 16          # key/value heads
const D       = 128         # head dim
const F       = 21504       # MLP width
const V       = 262208      # vocabulary
const EPS     = 0.000001    # rmsnorm epsilon (every norm)
const QPAS    = 168         # query_pre_attn_scalar
const WINDOW  = 1024        # sliding window of the local layers
const PATTERN = 6           # sliding_window_pattern: every 6th layer is global
const LOCAL_THETA  = 10000.0    # rope_local_base_freq
const GLOBAL_THETA = 1000000.0  # rope_theta
const GLOBAL_FACTOR = 8.0       # rope_scaling linear factor (global layers)

const TPN = 4
mesh { tp = TPN }

dim B in 1 .. 8             # rows decoded together
dim S in 1 .. 131072        # KV cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded over 2 devices: the published head dim, GQA 2:1,
# norms, GeGLU, scale rule (query_pre_attn_scalar = hidden / heads, as at 27B) and both rope
# settings; one local and one global layer (pattern 2) and a 32-token window, so a short cache
# already reaches past the window.
profile mini {
  L = 2
  H = 512
  NH = 4
  NKV = 2
  F = 1024
  V = 1000
  QPAS = 128
  WINDOW = 32
  PATTERN = 2
  TPN = 2
}

# Gemma 3 4B, the same architecture at head dim 256 (google/gemma-3-4b-it text_config:
# num_hidden_layers 34, hidden_size 2560, 8 query / 4 KV heads of 256, intermediate_size 10240,
# query_pre_attn_scalar 256; the other values as above), on 2 cores.
profile gemma3_4b {
  L = 34
  H = 2560
  NH = 8
  NKV = 4
  D = 256
  F = 10240
  QPAS = 256
  TPN = 2
}

weight embed:          bf16[V @tp, H]
weight attn_norm:      bf16[H]             per layer   # input_layernorm
weight wq:             bf16[H, NH*D @tp]   per layer
weight wk:             bf16[H, NKV*D @tp]  per layer
weight wv:             bf16[H, NKV*D @tp]  per layer
weight q_norm:         bf16[D]             per layer
weight k_norm:         bf16[D]             per layer
weight wo:             bf16[NH*D @tp, H]   per layer
weight post_attn_norm: bf16[H]             per layer   # post_attention_layernorm
weight pre_ffn_norm:   bf16[H]             per layer   # pre_feedforward_layernorm
weight w_gate:         bf16[H, F @tp]      per layer
weight w_up:           bf16[H, F @tp]      per layer
weight w_down:         bf16[F @tp, H]      per layer
weight post_ffn_norm:  bf16[H]             per layer   # post_feedforward_layernorm
weight final_norm:     bf16[H]

state k_cache: bf16[B, NKV @tp, S, D] per layer
state v_cache: bf16[B, NKV @tp, S, D] per layer

block norm(x, w) {
  return rmsnorm(x, w, eps=EPS, offset=1.0)
}

# q and k: per-head (1 + w) RMSNorm, then RoPE with the layer type's base and scaling
block attn(h, theta, scaling, factor, window) {
  q = rmsnorm(linear(h, wq), q_norm, heads=NH, eps=EPS, offset=1.0)
  k = rmsnorm(linear(h, wk), k_norm, heads=NKV, eps=EPS, offset=1.0)
  q = rope(q, positions, heads=NH, theta=theta, scaling=scaling, factor=factor)
  k = rope(k, positions, heads=NKV, theta=theta, scaling=scaling, factor=factor)
  a = attention(q, k, linear(h, wv), k_cache, v_cache, positions, heads=NH, kv_heads=NKV,
                scale=QPAS ** -0.5, window=window)
  return linear(a, wo)
}

# one body for both layer types; window 0 is no window (global attention)
block decoder(x, theta, scaling="none", factor=1.0, window=0) {
  x = x + norm(attn(norm(x, attn_norm), theta, scaling, factor, window), post_attn_norm)
  h = norm(x, pre_ffn_norm)
  y = linear(gelu_tanh(linear(h, w_gate)) * linear(h, w_up), w_down)
  return x + norm(y, post_ffn_norm)
}

layer local(x) {
  return decoder(x, theta=LOCAL_THETA, window=WINDOW)
}

layer global(x) {
  return decoder(x, theta=GLOBAL_THETA, scaling="linear", factor=GLOBAL_FACTOR)
}

layers L {
  global: (l + 1) % PATTERN == 0
  local:  otherwise
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed) * sqrt(H))
  logits = linear(norm(x, final_norm), embed, transposed=true)
  return logits, argmax(logits)
}

# Where each weight comes from in the published Hugging Face checkpoint (bf16; the text model of
# google/gemma-3-27b-it, prefix language_model. there, model. in a text-only save as here): matrices
# are stored [out, in], the spec's [in, out]; the output head is the embedding (tied). `config`
# names transformers' class and config.json fields (for `mkdsl verify --against transformers`).
checkpoint hf {
  config {
    architecture = "Gemma3ForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = F
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NKV
    head_dim = D
    rms_norm_eps = EPS
    query_pre_attn_scalar = QPAS
    sliding_window = WINDOW
    sliding_window_pattern = PATTERN
    rope_theta = GLOBAL_THETA
    rope_local_base_freq = LOCAL_THETA
    rope_scaling.rope_type = "linear"
    rope_scaling.factor = GLOBAL_FACTOR
    hidden_activation = "gelu_pytorch_tanh"
    tie_word_embeddings = true
  }
  embed          = "model.embed_tokens.weight"
  attn_norm      = "model.layers.{l}.input_layernorm.weight"
  wq             = "model.layers.{l}.self_attn.q_proj.weight" | transpose
  wk             = "model.layers.{l}.self_attn.k_proj.weight" | transpose
  wv             = "model.layers.{l}.self_attn.v_proj.weight" | transpose
  q_norm         = "model.layers.{l}.self_attn.q_norm.weight"
  k_norm         = "model.layers.{l}.self_attn.k_norm.weight"
  wo             = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  post_attn_norm = "model.layers.{l}.post_attention_layernorm.weight"
  pre_ffn_norm   = "model.layers.{l}.pre_feedforward_layernorm.weight"
  w_gate         = "model.layers.{l}.mlp.gate_proj.weight" | transpose
  w_up           = "model.layers.{l}.mlp.up_proj.weight" | transpose
  w_down         = "model.layers.{l}.mlp.down_proj.weight" | transpose
  post_ffn_norm  = "model.layers.{l}.post_feedforward_layernorm.weight"
  final_norm     = "model.norm.weight"
}
