# Llama 4 Scout (text): one greedy decode step.
# Config values used (meta-llama/Llama-4-Scout-17B-16E, config.json text_config): num_hidden_layers
# 48, hidden_size 5120, num_attention_heads 40, num_key_value_heads 8, head_dim 128, vocab_size
# 202048, rms_norm_eps 1e-5, rope_theta 500000 with rope_scaling {rope_type llama3, factor 16,
# low_freq_factor 1, high_freq_factor 1, original_max_position_embeddings 8192},
# num_local_experts 16, num_experts_per_tok 1, intermediate_size 8192 (each expert and the shared
# expert), interleave_moe_layer_step 1 (every layer MoE), no_rope_layers: every 4th layer
# (no_rope_layer_interval 4), attention_chunk_size 8192, use_qk_norm true,
# attn_temperature_tuning true, floor_scale 8192, attn_scale 0.1, hidden_act silu,
# max_position_embeddings 10485760, tie_word_embeddings false.
# Equations (transformers Llama4TextModel): pre-norm residual blocks with RMSNorm weights w;
# layer l is NoPE (no rotary embedding) when (l + 1) % 4 == 0, else a RoPE layer.
# - RoPE layers: q and k rotated in interleaved pairs (view_as_complex over adjacent lanes) at
#   llama3-scaled frequencies, then each head normalised by a weightless RMSNorm (qk_norm, eps
#   rms_norm_eps); attention is chunked: a token sees only the tokens of its own chunk of 8192
#   positions (key // 8192 == query // 8192), causally.
# - NoPE layers: no rotation, no qk norm, global causal attention, and the queries scaled by the
#   attention temperature 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)).
# - Attention scale head_dim^-0.5 in both.
# - MoE: router logits Wr h (no bias); the top 1 logit per token; its score sigmoid(logit); the
#   chosen expert runs on the input scaled by that score (routed_in = h * score), its output
#   added unweighted; plus a shared SwiGLU expert on h: out = shared(h) + expert(score * h).
#   Experts are SwiGLU: down(silu(gate(x)) * up(x)).
#
# Deployment: 8 TPU7x cores (4 chips), ep 2 x tp 4: 10 query and 2 KV heads per core; the 16
# experts split by owner over all 8 cores (2 each, whole); the shared expert split by columns over
# tp; the head split by vocabulary over all 8 (25256 columns per core, stored padded to whole
# 128-lane tiles).
model llama4_scout

const L     = 48          # layers
const H     = 5120        # hidden width
const NH    = 40          # query heads
const NKV   = 8           # key/value heads
const D     = 128         # head dim
const E     = 16          # routed experts
const TOPK  = 1           # experts per token
const FE    = 8192        # expert width (intermediate_size; the shared expert's too)
const V     = 202048      # vocabulary
const EPS   = 0.00001     # rms_norm_eps (every norm, the weightless qk norm too)
const THETA = 500000.0    # rope_theta
const ROPE_FACTOR = 16.0  # rope_scaling (llama3)
const ROPE_LOW    = 1.0
const ROPE_HIGH   = 1.0
const ROPE_ORIG   = 8192
const CHUNK = 8192        # attention_chunk_size (RoPE layers)
const NOPE_EVERY  = 4     # no_rope_layer_interval: layer l is NoPE when (l + 1) % 4 == 0
const FLOOR_SCALE = 8192  # attention temperature of the NoPE layers
const ATTN_SCALE  = 0.1

const EPN = 2
const TPN = 4
mesh { ep = EPN  tp = TPN }

dim B in 1 .. 8             # rows decoded together
dim S in 1 .. 10485760      # KV cache length (max_position_embeddings)

# Small enough for TPU interpret mode, sharded like the full model over 4 devices (ep 2 x tp 2):
# the published head dim, expert count, top 1 and both layer kinds (a NoPE layer every 2nd), with a
# chunk of 8 and a temperature floor of 4 so that a short decode crosses chunks and temperatures.
profile mini {
  L = 2
  H = 256
  NH = 4
  NKV = 2
  FE = 256
  V = 1000
  CHUNK = 8
  NOPE_EVERY = 2
  FLOOR_SCALE = 4
  TPN = 2
}

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]             per layer
weight wq:         bf16[H, NH*D @tp]   per layer
weight wk:         bf16[H, NKV*D @tp]  per layer
weight wv:         bf16[H, NKV*D @tp]  per layer
weight wo:         bf16[NH*D @tp, H]   per layer
weight mlp_norm:   bf16[H]             per layer
weight router:     bf16[H, E]          per layer
weight w_gate:     bf16[E @(ep, tp), H, FE]  per layer
weight w_up:       bf16[E @(ep, tp), H, FE]  per layer
weight w_down:     bf16[E @(ep, tp), FE, H]  per layer
weight ws_gate:    bf16[H, FE @tp]     per layer   # the shared expert
weight ws_up:      bf16[H, FE @tp]     per layer
weight ws_down:    bf16[FE @tp, H]     per layer
weight final_norm: bf16[H]
weight lm_head:    bf16[H, V @(ep, tp)]

state k_cache: bf16[B, NKV @tp, S, D] per layer
state v_cache: bf16[B, NKV @tp, S, D] per layer

# rotary embedding in interleaved pairs at llama3-scaled frequencies, then the weightless qk norm
block rope_norm(x, heads) {
  x = rope(x, positions, heads=heads, theta=THETA, pairing="interleaved", scaling="llama3",
           factor=ROPE_FACTOR, low_freq_factor=ROPE_LOW, high_freq_factor=ROPE_HIGH,
           original_max_position=ROPE_ORIG)
  return rmsnorm(x, heads=heads, eps=EPS)
}

# the top-1 expert on its sigmoid-scaled input, plus the shared expert
block moe(h) {
  v, ids = topk(linear(h, router), k=TOPK)
  routed = moe_experts(h, sigmoid(v), ids, w_gate, w_up, w_down, act=swiglu, weigh="input")
  return linear(swiglu(linear(h, ws_gate), linear(h, ws_up)), ws_down) + routed
}

layer chunked(x) {
  h = rmsnorm(x, attn_norm, eps=EPS)
  q = rope_norm(linear(h, wq), heads=NH)
  k = rope_norm(linear(h, wk), heads=NKV)
  a = attention(q, k, linear(h, wv), k_cache, v_cache, positions, heads=NH, kv_heads=NKV, chunk=CHUNK)
  x = x + linear(a, wo)
  return x + moe(rmsnorm(x, mlp_norm, eps=EPS))
}

# NoPE: global attention, the queries scaled by the position's temperature
layer nope(x) {
  h = rmsnorm(x, attn_norm, eps=EPS)
  temperature = 1.0 + ATTN_SCALE * log(floor((to_f32(positions) + 1.0) / FLOOR_SCALE) + 1.0)
  a = attention(linear(h, wq) * temperature, linear(h, wk), linear(h, wv), k_cache, v_cache, positions,
                heads=NH, kv_heads=NKV)
  x = x + linear(a, wo)
  return x + moe(rmsnorm(x, mlp_norm, eps=EPS))
}

layers L {
  nope:    (l + 1) % NOPE_EVERY == 0
  chunked: otherwise
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}

# Where each weight comes from in a Hugging Face save of the text model (Llama4ForCausalLM; the
# published multimodal checkpoint prefixes these with `language_model.`): matrices are stored
# [out, in], the spec's [in, out]; the experts are stacked tensors, gate_up_proj [E, H, 2 FE]
# (gate columns first, then up) and down_proj [E, FE, H], already [in, out].
checkpoint hf {
  config {
    architecture = "Llama4ForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = FE
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NKV
    head_dim = D
    rms_norm_eps = EPS
    rope_theta = THETA
    rope_scaling.rope_type = "llama3"
    rope_scaling.factor = ROPE_FACTOR
    rope_scaling.low_freq_factor = ROPE_LOW
    rope_scaling.high_freq_factor = ROPE_HIGH
    rope_scaling.original_max_position_embeddings = ROPE_ORIG
    num_local_experts = E
    num_experts_per_tok = TOPK
    interleave_moe_layer_step = 1
    no_rope_layer_interval = NOPE_EVERY
    attention_chunk_size = CHUNK
    use_qk_norm = true
    attn_temperature_tuning = true
    floor_scale = FLOOR_SCALE
    attn_scale = ATTN_SCALE
    hidden_act = "silu"
    tie_word_embeddings = false
  }
  embed      = "model.embed_tokens.weight"
  attn_norm  = "model.layers.{l}.input_layernorm.weight"
  wq         = "model.layers.{l}.self_attn.q_proj.weight" | transpose
  wk         = "model.layers.{l}.self_attn.k_proj.weight" | transpose
  wv         = "model.layers.{l}.self_attn.v_proj.weight" | transpose
  wo         = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  mlp_norm   = "model.layers.{l}.post_attention_layernorm.weight"
  router     = "model.layers.{l}.feed_forward.router.weight" | transpose
  w_gate     = "model.layers.{l}.feed_forward.experts.gate_up_proj" | rows(start=0, stop=FE, dim=2)
  w_up       = "model.layers.{l}.feed_forward.experts.gate_up_proj" | rows(start=FE, stop=2 * FE, dim=2)
  w_down     = "model.layers.{l}.feed_forward.experts.down_proj"
  ws_gate    = "model.layers.{l}.feed_forward.shared_expert.gate_proj.weight" | transpose
  ws_up      = "model.layers.{l}.feed_forward.shared_expert.up_proj.weight" | transpose
  ws_down    = "model.layers.{l}.feed_forward.shared_expert.down_proj.weight" | transpose
  final_norm = "model.norm.weight"
  lm_head    = "lm_head.weight" | transpose
}
