# Mixtral 8x7B (v0.1): one greedy decode step.
# Config values used (mistralai/Mixtral-8x7B-v0.1 config.json): num_hidden_layers 32,
# hidden_size 4096, num_attention_heads 32, num_key_value_heads 8 (head_dim 4096 / 32 = 128),
# intermediate_size 14336 (per expert), num_local_experts 8, num_experts_per_tok 2,
# hidden_act silu, rope_theta 1e6, rms_norm_eps 1e-5, vocab_size 32000,
# max_position_embeddings 32768, sliding_window null, tie_word_embeddings false,
# torch_dtype bfloat16 (the experts ship in bf16).
# Equations (transformers MixtralSparseMoeBlock): router logits `Wg h` ([8, 4096], no bias),
# softmax over the 8 experts, the top 2, renormalised over those 2 (= a softmax over the two
# chosen logits); each expert is SwiGLU, w2(silu(w1 h) * w3 h); attention is GQA 4:1 with
# rotate-half RoPE over the whole head and scale 128^-0.5, no biases; plain RMSNorm before each
# sublayer, a final RMSNorm, an untied head.
#
# Deployment: 4 TPU7x cores (2 chips), ep 2 x tp 2. Attention split by KV head over tp (4 KV and
# 16 query heads per core, the two ep halves compute it alike); the 8 experts by owner over all 4
# cores (2 each, whole columns; 22.5 GB of experts per core); the head by vocabulary over all 4
# (8000 columns per core, padded by the compiler to 8064).
model mixtral_8x7b

const L     = 32        # layers
const H     = 4096      # hidden width
const NH    = 32        # query heads
const NKV   = 8         # key/value heads
const D     = 128       # head dim
const E     = 8         # experts
const TOPK  = 2         # experts per token
const FE    = 14336     # expert width
const V     = 32000     # vocabulary
const EPS   = 0.00001   # rmsnorm epsilon
const THETA = 1000000.0 # rope base

const EPN = 2
const TPN = 2
mesh { ep = EPN  tp = TPN }

dim B in 1 .. 8         # rows decoded together
dim S in 1 .. 32768     # KV cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded like the full model over 4 devices (ep 2 x tp 2):
# the published head dim, GQA ratio, expert count and top-2.
profile mini {
  L = 2
  H = 256
  NH = 8
  NKV = 2
  FE = 256
  V = 1000
}

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]                  per layer
weight wq:         bf16[H, NH*D @tp]        per layer
weight wk:         bf16[H, NKV*D @tp]       per layer
weight wv:         bf16[H, NKV*D @tp]       per layer
weight wo:         bf16[NH*D @tp, H]        per layer
weight mlp_norm:   bf16[H]                  per layer
weight router:     bf16[H, E]               per layer
weight w1:         bf16[E @(ep, tp), H, FE] per layer   # gate
weight w3:         bf16[E @(ep, tp), H, FE] per layer   # up
weight w2:         bf16[E @(ep, tp), FE, H] per layer   # down
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @(ep, tp)]

state k_cache: bf16[B, NKV @tp, S, D] per layer
state v_cache: bf16[B, NKV @tp, S, D] per layer

block attn(h) {
  q = rope(linear(h, wq), positions, heads=NH, theta=THETA)
  k = rope(linear(h, wk), positions, heads=NKV, theta=THETA)
  return linear(attention(q, k, linear(h, wv), k_cache, v_cache, positions, heads=NH, kv_heads=NKV), wo)
}

# the top 2 router logits, a softmax over those 2; SwiGLU experts
block moe(h) {
  v, ids = topk(linear(h, router), k=TOPK)
  return moe_experts(h, softmax(v), ids, w1, w3, w2, act=swiglu)
}

layer decoder(x) {
  x = x + attn(rmsnorm(x, attn_norm, eps=EPS))
  return x + moe(rmsnorm(x, mlp_norm, eps=EPS))
}

layers L { decoder: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}

# Where each weight comes from in the published Hugging Face checkpoint (bf16): each expert is its own
# tensor, stacked over `{e}`; matrices are
# stored [out, in], the spec's [in, out]. `config` names transformers' class and config.json fields
# (for `mkdsl verify --against transformers`).
checkpoint hf {
  config {
    architecture = "MixtralForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = FE
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NKV
    head_dim = D
    num_local_experts = E
    num_experts_per_tok = TOPK
    rms_norm_eps = EPS
    rope_theta = THETA
    tie_word_embeddings = false
  }
  embed      = "model.embed_tokens.weight"
  attn_norm  = "model.layers.{l}.input_layernorm.weight"
  wq         = "model.layers.{l}.self_attn.q_proj.weight" | transpose
  wk         = "model.layers.{l}.self_attn.k_proj.weight" | transpose
  wv         = "model.layers.{l}.self_attn.v_proj.weight" | transpose
  wo         = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  mlp_norm   = "model.layers.{l}.post_attention_layernorm.weight"
  router     = "model.layers.{l}.block_sparse_moe.gate.weight" | transpose
  w1         = "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight" | transpose
  w3         = "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight" | transpose
  w2         = "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight" | transpose
  final_norm = "model.norm.weight"
  lm_head    = "lm_head.weight" | transpose
}
