# OLMo 2 7B (allenai/OLMo-2-1124-7B): one greedy decode step.
# Config values used (config.json): num_hidden_layers 32, hidden_size 4096,
# num_attention_heads 32, num_key_value_heads 32 (head_dim 128), intermediate_size 11008,
# hidden_act silu, rope_theta 500000, rope_scaling null, rms_norm_eps 1e-6, vocab_size 100352,
# max_position_embeddings 4096, attention_bias false, tie_word_embeddings false.
# Equations (transformers Olmo2DecoderLayer, Olmo2Attention): no norm before a sublayer; its
# output is normalised (post_attention_layernorm, post_feedforward_layernorm) before the residual
# add; q and k are RMS-normalised over their full width (q_norm [4096], k_norm [4096], not per
# head) before rotate-half RoPE; SwiGLU MLP; plain RMSNorm (weights w); a final norm; untied head.
#
# Stated details: the config's torch_dtype is float32; the weights are declared bf16 here, the
# dtype it is served in (the kernel streams `linear` matrices as bf16 or quantised formats, not
# f32). Olmo2RMSNorm casts the normalised x to the input dtype before the weight multiply; here
# activations are f32 (the language's numeric contract).
#
# Deployment: 2 TPU7x cores (one chip), tp 2: 16 heads per core. The full-width q/k norms run on
# each core's half of q and k (their weights split alike): each core sums its squares and the
# compiler adds the two partial sums (one all-reduce of a [B, 1] value per norm).
model olmo2_7b

const L     = 32        # layers
const H     = 4096      # hidden width
const NH    = 32        # heads (query and key/value)
const D     = 128       # head dim
const F     = 11008     # MLP width
const V     = 100352    # vocabulary
const EPS   = 0.000001  # rmsnorm epsilon
const THETA = 500000.0  # rope base

const TPN = 2
mesh { tp = TPN }

dim B in 1 .. 8         # rows decoded together
dim S in 1 .. 4096      # KV cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded over 2 devices like the full model.
profile mini {
  L = 2
  H = 256
  NH = 4
  F = 512
  V = 1024
}

weight embed:      bf16[V, H]
weight wq:         bf16[H, NH*D @tp]   per layer
weight wk:         bf16[H, NH*D @tp]   per layer
weight wv:         bf16[H, NH*D @tp]   per layer
weight q_norm:     bf16[NH*D @tp]      per layer
weight k_norm:     bf16[NH*D @tp]      per layer
weight wo:         bf16[NH*D @tp, H]   per layer
weight post_attn_norm: bf16[H]         per layer   # post_attention_layernorm
weight w_gate:     bf16[H, F @tp]      per layer
weight w_up:       bf16[H, F @tp]      per layer
weight w_down:     bf16[F @tp, H]      per layer
weight post_ffn_norm:  bf16[H]         per layer   # post_feedforward_layernorm
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @tp]

state k_cache: bf16[B, NH @tp, S, D] per layer
state v_cache: bf16[B, NH @tp, S, D] per layer

block attn(x) {
  q = rope(rmsnorm(linear(x, wq), q_norm, eps=EPS), positions, heads=NH, theta=THETA)
  k = rope(rmsnorm(linear(x, wk), k_norm, eps=EPS), positions, heads=NH, theta=THETA)
  return linear(attention(q, k, linear(x, wv), k_cache, v_cache, positions, heads=NH, kv_heads=NH), wo)
}

layer decoder(x) {
  x = x + rmsnorm(attn(x), post_attn_norm, eps=EPS)
  y = linear(swiglu(linear(x, w_gate), linear(x, w_up)), w_down)
  return x + rmsnorm(y, post_ffn_norm, eps=EPS)
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
    architecture = "Olmo2ForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = F
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NH
    head_dim = D
    rms_norm_eps = EPS
    rope_theta = THETA
    tie_word_embeddings = false
  }
  embed          = "model.embed_tokens.weight"
  wq             = "model.layers.{l}.self_attn.q_proj.weight" | transpose
  wk             = "model.layers.{l}.self_attn.k_proj.weight" | transpose
  wv             = "model.layers.{l}.self_attn.v_proj.weight" | transpose
  q_norm         = "model.layers.{l}.self_attn.q_norm.weight"
  k_norm         = "model.layers.{l}.self_attn.k_norm.weight"
  wo             = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  post_attn_norm = "model.layers.{l}.post_attention_layernorm.weight"
  w_gate         = "model.layers.{l}.mlp.gate_proj.weight" | transpose
  w_up           = "model.layers.{l}.mlp.up_proj.weight" | transpose
  w_down         = "model.layers.{l}.mlp.down_proj.weight" | transpose
  post_ffn_norm  = "model.layers.{l}.post_feedforward_layernorm.weight"
  final_norm     = "model.norm.weight"
  lm_head        = "lm_head.weight" | transpose
}
