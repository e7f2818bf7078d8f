# Kimi K3's DSpark block drafter: one drafting step (speculative decoding).
# Its rows are one block of one sequence: the anchor (the last accepted token) and mask tokens at
# consecutive positions. Five Qwen3-style layers (pre-norm attention with per-head q/k RMSNorms
# and rotate-half RoPE, pre-norm SwiGLU MLP, residual adds), its own embedding and output head.
# Every layer's queries also attend to a cache of the target's context: the hidden states of target
# layers 24, 48, 72, 88 and 92 for each accepted token, concatenated, projected by `fc` and normed,
# give each layer a key and a value at the token's position, kept in 2048 slots (slot = position
# mod 2048, each remembering its position). Draft k = argmax of slot k's logits plus the Markov
# bias markov_w2 . markov_w1[previous token], read left to right from the anchor.
# Sizes from the checkpoint's config.json (transformer_layer_config, aux_hidden_state_layer_ids,
# sliding_window, markov_rank, mask_token_id); see docs/language.md "Drafters".
model kimi_k3_dspark

const L     = 5         # layers
const H     = 7168      # hidden width (the target's)
const V     = 163840    # vocabulary (the target's)
const NH    = 96        # query heads
const NKV   = 16        # key/value heads
const D     = 64        # head dim
const F     = 14336     # SwiGLU width
const W     = 2048      # context slots (sliding_window)
const MR    = 256       # Markov rank
const MASK  = 163837    # mask_token_id: the block's rows after the anchor
const EPS   = 0.00001
const THETA = 10000.0

# The target layers whose hidden states (each layer's residual stream output) make the context.
const C1    = 24
const C2    = 48
const C3    = 72
const C4    = 88
const C5    = 92
const NC    = 5

# Devices: the target's 32 cores, tensor-parallel 32 as the hand kernel runs it: query heads split
# by device (3 each), each KV head repeated so that every device computes the one its query heads
# share (the loader writes each of the 16 checkpoint heads REP times; the same model), MLP columns
# and fc's input features split, embedding, output head and markov_w2 split by vocabulary rows,
# markov_w1 kept whole for the lookup of the previous token, norms replicated.
const TP    = 32
const REP   = (TP + NKV - 1) // NKV    # copies of each KV head
const NKVR  = NKV * REP                # KV heads as stored
mesh { tp = TP }

dim B in 1 .. 16        # rows: the anchor and the mask tokens (8 for Kimi K3's verify step)

# Pairs with Kimi K3's `mini` profile (vocabulary 1024, hidden 256, 8 layers): the context comes
# from its layers 2, 3, 5, 6 and 7; one device, small enough for TPU interpret mode.
profile mini {
  L = 2
  H = 256
  V = 1024
  NH = 4
  NKV = 2
  D = 64
  F = 512
  W = 64
  MR = 32
  MASK = 1021
  C1 = 2
  C2 = 3
  C3 = 5
  C4 = 6
  C5 = 7
  TP = 1
}

weight embed:       bf16[V @tp, H]
weight fc:          bf16[NC*H @tp, H]
weight hidden_norm: bf16[H]
weight attn_norm:   bf16[H]              per layer
weight wq:          bf16[H, NH*D @tp]    per layer
weight wk:          bf16[H, NKVR*D @tp]  per layer
weight wv:          bf16[H, NKVR*D @tp]  per layer
weight q_norm:      bf16[D]              per layer
weight k_norm:      bf16[D]              per layer
weight wo:          bf16[NH*D @tp, H]    per layer
weight mlp_norm:    bf16[H]              per layer
weight w_gate:      bf16[H, F @tp]       per layer
weight w_up:        bf16[H, F @tp]       per layer
weight w_down:      bf16[F @tp, H]       per layer
weight final_norm:  bf16[H]
weight lm_head:     bf16[H, V @tp]
weight markov_w1:   bf16[V, MR]
weight markov_w2:   bf16[V @tp, MR]

# The context rows this step adds (the target's hidden states of the tokens accepted since the
# last step) and their positions (-1: no row); the host writes both before each step.
state context:      f32[B, NC*H @tp]
state context_pos:  i32[B]
context context at context_pos from layers C1, C2, C3, C4, C5

# Each layer's context cache: keys and values by slot, and the position each slot holds (-1: empty).
state k_cache:      bf16[NKVR @tp, W, D] per layer
state v_cache:      bf16[NKVR @tp, W, D] per layer
state slot_pos:     i32[W]               per layer

block attn(h, c) {
  q = rope(rmsnorm(linear(h, wq), q_norm, heads=NH, eps=EPS), positions, heads=NH, theta=THETA)
  k = rope(rmsnorm(linear(h, wk), k_norm, heads=NKVR, eps=EPS), positions, heads=NKVR, theta=THETA)
  ck = rope(rmsnorm(linear(c, wk), k_norm, heads=NKVR, eps=EPS), context_pos, heads=NKVR, theta=THETA)
  y = block_attention(q, k, linear(h, wv), ck, linear(c, wv), k_cache, v_cache, slot_pos, context_pos, positions,
                      heads=NH, kv_heads=NKVR, window=W)
  return linear(y, wo)
}

block mlp(h) {
  return linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)
}

layer decoder(x, c) {
  x = x + attn(rmsnorm(x, attn_norm, eps=EPS), c)
  return x + mlp(rmsnorm(x, mlp_norm, eps=EPS)), c
}

layers L {
  decoder: otherwise
}

# tokens: the anchor, then MASK in every other row; positions: anchor .. anchor + B - 1.
step(tokens, positions) {
  c = rmsnorm(linear(context, fc), hidden_norm, eps=EPS)
  x, c = layers(embedding(tokens, embed), c)
  logits = linear(rmsnorm(x, final_norm, eps=EPS), lm_head)
  return logits, markov_argmax(logits, tokens, markov_w1, markov_w2)
}

# Where each weight comes from in the published drafter checkpoint (RedHatAI/Kimi-K3-speculator.dspark,
# safetensors): matrices stored [out, in] (the spec's are [in, out]); each of the NKV key/value
# heads of k_proj and v_proj written REP times in a row (`repeat_groups`), as the spec stores them.
# The field names `fc`, `hidden_norm`, `k_norm`, `markov_w1` and `markov_w2` are the checkpoint's
# (facts/kimi_k3.md); the layer prefixes and the other names are inferred from the Qwen3-style
# layer (Hugging Face's names), and the Markov matrices, [V, MR] each, are read as stored.
# transformers has no class for this model: `KimiK3DSparkForCausalLM` is mkdsl's stand-in, built
# from transformers' Qwen3 layers with the drafter's context cache and Markov bias
# (mkdsl/verify/dspark.py; the oracle: README). The config fields are the published config.json's
# (facts: transformer_layer_config, aux_hidden_state_layer_ids, sliding_window, markov_rank,
# mask_token_id); the field names inside transformer_layer_config are inferred (Qwen3's).
checkpoint hf {
  config {
    architecture = "KimiK3DSparkForCausalLM"
    transformer_layer_config.vocab_size = V
    transformer_layer_config.hidden_size = H
    transformer_layer_config.intermediate_size = F
    transformer_layer_config.num_hidden_layers = L
    transformer_layer_config.num_attention_heads = NH
    transformer_layer_config.num_key_value_heads = NKV
    transformer_layer_config.head_dim = D
    transformer_layer_config.rms_norm_eps = EPS
    transformer_layer_config.rope_theta = THETA
    aux_hidden_state_layer_ids = [C1, C2, C3, C4, C5]
    sliding_window = W
    markov_rank = MR
    mask_token_id = MASK
  }
  embed       = "embed_tokens.weight"
  fc          = "fc.weight" | transpose
  hidden_norm = "hidden_norm.weight"
  attn_norm   = "layers.{l}.input_layernorm.weight"
  wq          = "layers.{l}.self_attn.q_proj.weight" | transpose
  wk          = "layers.{l}.self_attn.k_proj.weight" | repeat_groups(groups=NKV, times=REP) | transpose
  wv          = "layers.{l}.self_attn.v_proj.weight" | repeat_groups(groups=NKV, times=REP) | transpose
  q_norm      = "layers.{l}.self_attn.q_norm.weight"
  k_norm      = "layers.{l}.self_attn.k_norm.weight"
  wo          = "layers.{l}.self_attn.o_proj.weight" | transpose
  mlp_norm    = "layers.{l}.post_attention_layernorm.weight"
  w_gate      = "layers.{l}.mlp.gate_proj.weight" | transpose
  w_up        = "layers.{l}.mlp.up_proj.weight" | transpose
  w_down      = "layers.{l}.mlp.down_proj.weight" | transpose
  final_norm  = "norm.weight"
  lm_head     = "lm_head.weight" | transpose
  markov_w1   = "markov_w1.weight"
  markov_w2   = "markov_w2.weight"
}
