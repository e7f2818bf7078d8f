"""General MoE pieces through the kernel, in TPU interpret mode over 2 devices (race detector on),
against the reference layer by layer (mkdsl.verify.kernel.LayerChecker; bounds derived there): a
DeepSeek-V3-style layer (group-limited top-k of sigmoid scores plus a selection bias, the unbiased
scores read back with `take`, renormalised and scaled by 2.5, plus a shared expert gated by
`sigmoid(rowsum(h * s_gate))`) and a gpt-oss-style layer (top-k of the biased logits, softmax over
the chosen ones), both with expert biases, fp8 experts with DeepSeek-V3's 128 x 128 block scales split by columns
(so the down bias is added by one device only), and gpt-oss's clamped SwiGLU written as a spec
block (`act=oss_act`); then int4, int8 and fp8 group-scaled experts on one device (two latent decode
chunks, padded expert columns). bf16 experts run in tests/test_qwen3.py's kernel, MXFP4 in Kimi K3's.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from mkdsl.compiler import compile_source
from mkdsl.lang.diagnostics import SpecError
from mkdsl.run.random_params import random_params
from mkdsl.verify import kernel as verify

SPEC = """\
# Two MoE layer kinds sharing experts, sharded over 2 devices by expert columns.
model moe_mix

const L = 2
const H = 256
const E = 32
const EP = 128
const F = 256
const K = 4
const V = 256
const EPS = 0.000001

mesh { tp = 2 }
dim B in 1 .. 8

weight embed:    bf16[V, H]
weight norm:     bf16[H]            per layer
weight router:   bf16[H, EP]        per layer
weight r_bias:   f32[E]             per layer
weight w1:       fp8_e4m3(block=128)[E, H, F @tp]  per layer
weight w3:       fp8_e4m3(block=128)[E, H, F @tp]  per layer
weight w2:       fp8_e4m3(block=128)[E, F @tp, H]  per layer
weight b1:       bf16[E, F @tp]     per layer
weight b3:       bf16[E, F @tp]     per layer
weight b2:       bf16[E, H]         per layer
weight sg:       bf16[H, F @tp]     per layer
weight su:       bf16[H, F @tp]     per layer
weight sd:       bf16[F @tp, H]     per layer
weight s_gate:   bf16[H]            per layer
weight out_norm: bf16[H]
weight lm_head:  bf16[H, V]

block oss_act(g, u) {
  g = clamp(g, hi=7.0)
  u = clamp(u, lo=-7.0, hi=7.0)
  return g * sigmoid(g * 1.702) * (u + 1.0)
}

block shared(h) {
  return linear(swiglu(linear(h, sg), linear(h, su)), sd) * sigmoid(rowsum(h * s_gate))
}

# DeepSeek-V3-style: group-limited selection by sigmoid scores + bias, unbiased weights, x 2.5
layer ds(x) {
  h = rmsnorm(x, norm, eps=EPS)
  s = sigmoid(slice(linear(h, router), start=0, size=E))
  c, ids = group_topk(s + r_bias, k=K, groups=4, topk_groups=2)
  w = take(s, ids)
  return x + moe_experts(h, w / rowsum(w) * 2.5, ids, w1, w3, w2, b1, b3, b2, act=oss_act) + shared(h)
}

# gpt-oss-style: top-k of the biased logits, softmax over the chosen ones
layer oss(x) {
  h = rmsnorm(x, norm, eps=EPS)
  v, ids = topk(slice(linear(h, router), start=0, size=E) + r_bias, k=K)
  return x + moe_experts(h, softmax(v), ids, w1, w3, w2, b1, b3, b2, act=oss_act)
}

layers L {
  ds: l == 0
  oss: otherwise
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}
"""


@pytest.mark.timeout(600)
def test_routing_forms_biases_and_act_block_match_reference_sharded(tmp_path):
    out, _ = compile_source(SPEC, "moe_mix.mk", None, None)
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    spec = importlib.util.spec_from_file_location("moe_mix_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "fmt='fp8_block'" in path.read_text() and "b2_here=" in path.read_text()
    batch = 3
    weights, state = random_params(out.model, {"B": batch}, seed=3)
    step = module.build_decode_step(batch, module.KV_TILE, interpret=verify.interpret_params(), layer_trace=True)
    pltpu.reset_tpu_interpret_mode_state()
    tokens, positions = np.asarray([5, 77, 200], np.int32), np.zeros(batch, np.int32)
    kernel_out = verify.run_kernel(step, weights, state, tokens, positions, sharded=True)
    assert not verify.races_found(), "the race detector reported a race"
    result = verify.LayerChecker(out.model).check(weights, state, tokens, positions, kernel_out)
    assert result.ok, "; ".join(result.failures[:8])


INT4_SPEC = """\
# group-scaled experts, one device: two decode chunks of the latent, padded expert columns.
model moe_int4

const H = 1024
const E = 8
const F = 192
const V = 256
const EPS = 0.000001

dim B in 1 .. 8

weight embed:    bf16[V, H]
weight norm:     bf16[H]            per layer
weight router:   bf16[H, E]         per layer
weight w1:       {fmt}[E, H, F]  per layer
weight w3:       {fmt}[E, H, F]  per layer
weight w2:       {fmt}[E, F, H]  per layer
weight out_norm: bf16[H]
weight lm_head:  bf16[H, V]

layer moe(x) {{
  h = rmsnorm(x, norm, eps=EPS)
  v, ids = topk(linear(h, router), k=2)
  return x + moe_experts(h, softmax(v), ids, w1, w3, w2, act=swiglu)
}}

layers 1 {{
  moe: otherwise
}}

step(tokens, positions) {{
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}}
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("fmt", "emitted"),
    [
        ("int4(group=32)", "fmt='int4', group=32"),
        ("int8(group=64)", "fmt='group', group=64"),
        ("fp8_e4m3(group=32)", "fmt='group', group=32"),
    ],
)
def test_group_scaled_experts_match_reference(tmp_path, fmt, emitted):
    """int4 (two exact bf16 halves) and int8/fp8 (bf16 codes per group slab, times the scale row)."""
    out, _ = compile_source(INT4_SPEC.format(fmt=fmt), "moe_int4.mk", None, None)
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    assert emitted in path.read_text()
    spec = importlib.util.spec_from_file_location("moe_int4_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    batch = 3
    weights, state = random_params(out.model, {"B": batch}, seed=5)
    step = module.build_decode_step(batch, module.KV_TILE, interpret=verify.interpret_params(), layer_trace=True)
    pltpu.reset_tpu_interpret_mode_state()
    tokens, positions = np.asarray([5, 77, 200], np.int32), np.zeros(batch, np.int32)
    kernel_out = verify.run_kernel(step, weights, state, tokens, positions, sharded=False, pad=module.pad_weights)
    assert not verify.races_found(), "the race detector reported a race"
    result = verify.LayerChecker(out.model).check(weights, state, tokens, positions, kernel_out)
    assert result.ok, "; ".join(result.failures[:8])


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ("fp8_e4m3", "must all be mxfp4, bf16, fp8 with block=128 scales, or int4, int8 or fp8 with one group=G"),
        ("int4(group=64)", "decoded 512 rows at a time: the group must divide 32, got 64"),
        ("int8(group=16)", "an int8/fp8 expert group must be a multiple of 32"),
    ],
)
def test_unsupported_expert_formats_are_diagnosed(fmt, message):
    with pytest.raises(SpecError) as err:
        compile_source(INT4_SPEC.format(fmt=fmt), "moe_int4.mk", None, None)
    assert "moe_experts cannot be lowered" in str(err.value) and message in str(err.value)
