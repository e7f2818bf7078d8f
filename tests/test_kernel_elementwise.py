"""Kernels that use the elementwise constructs, in TPU interpret mode against the reference.

One spec calls every elementwise op added with them (each math op, the scalar forms of the
operators, the three broadcasts, `repeat`, `rowsum`, `clamp`) and `rmsnorm(..., offset=1.0)`,
in a block with constant parameters. `mkdsl.verify.kernel` runs a decode step and compares the
kernel with the reference layer by layer, with its derived bounds (mkdsl/verify/kernel.py: carries
2^-6 of the layer's update, logits 2^-7 of the row's largest entry), and the interpreter's race
detector on. The same spec split over 2 devices (`w1`, `b1` by columns, `w2` by rows: a split
bias, a row sum of a split value, a partial sum through `mul_scalar`) runs sharded. A mutated
kernel whose `repeat` gives every head the first head's gate must fail the check, so the
comparison can fail. (A subtler mutation, tanh for erf in `gelu`, moves this spec's carries by
only ~0.1 of the bound: the final norm and the many summed terms dilute it; the op oracle in
tests/test_ops_elementwise.py is what pins gelu.) Both kernels also compile with libtpu for a
compile-only TPU7x (Mosaic lowers every op they use: erf, log1p, clip, the lane-iota selects of
`repeat`, a `[rows, 1]` buffer and its all-reduce).
"""

from __future__ import annotations

import pytest

from mkdsl.backends.tpu import libtpu as tpu_compile
from mkdsl.compiler import compile_source
from mkdsl.ops import OPS
from mkdsl.ops import elementwise as ew
from mkdsl.verify import kernel as verify

SPEC = """\
model ew_kernel

const L = 2
const H = 256
const NH = 2
const D = H // NH
const V = 256
const SCALE = 1.0 / sqrt(D) * 4.0
const LO = -ln(4.0)

dim B in 1 .. 8

{mesh}

weight embed:    bf16[V, H]
weight norm1:    bf16[H]             per layer
weight w1:       bf16[H, H{cols}]    per layer
weight b1:       bf16[H{cols}]       per layer
weight w2:       bf16[H{rows}, H]    per layer
weight head_w:   bf16[H, 128]        per layer
weight gate_w:   bf16[H]             per layer
weight norm_out: bf16[H]             per layer
weight norm_f:   bf16[H]
weight lm_head:  bf16[H, V]

block body(x, k, cap=30.0) {{
  h = rmsnorm(x, norm1, offset=1.0)
  y = linear(h, w1) + b1
  y = gelu(y) * SCALE - tanh(y) / 4.0 + 1.0 - softplus(-y) + gelu_tanh(y) / 8.0 + (1.0 - sigmoid(y))
  y = clamp(y, lo=LO * k, hi=cap) + maximum(y, 0.5) - minimum(0.0, relu(y)) + clamp(y, hi=1.0)
  y = y + sqrt(abs(y)) * rsqrt(1.0 + square(y)) + exp(-abs(y)) + log(1.0 + abs(y)) + 1.0 / (2.0 + y ** 2)
  y = y / (1.5 + abs(y)) + minimum(y, b1) - maximum(b1, y) * 0.5
  g = sigmoid(rowsum(y * gate_w) / 16.0 - 0.25)
  s = slice(linear(h, head_w), start=0, size=NH)
  y = y * repeat(tanh(s * 4.0), each=D) * g
  z = linear(y, w2) * 0.5
  return x + rmsnorm(z, norm_out) / 2.0
}}

layer dense(x) {{
  return body(x, k=2)
}}

layers L {{ dense: otherwise }}

step(tokens, positions) {{
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, norm_f), lm_head) * 0.5
  return logits, argmax(logits)
}}
"""
ONE = SPEC.format(mesh="", cols="", rows="")
SHARDED = SPEC.format(mesh="mesh { tp = 2 }", cols=" @tp", rows=" @tp")
NEW_OPS = {"sub", "div", "minimum", "maximum", "neg", "abs", "square", "exp", "log", "sqrt", "rsqrt"} | {
    "tanh",
    "relu",
    "softplus",
    "gelu",
    "gelu_tanh",
    "clamp",
    "repeat",
    "rowsum",
    "add_scalar",
    "sub_scalar",
    "mul_scalar",
    "div_scalar",
    "rsub_scalar",
    "rdiv_scalar",
    "pow_scalar",
    "minimum_scalar",
    "maximum_scalar",
}


def build(text: str, tmp_path, name: str, mutate=None):
    out, _ = compile_source(text, f"{name}.mk", None)
    source = out.files["kernel.py"]
    if mutate is not None:
        assert mutate[0] in source, f"the mutation's target `{mutate[0]}` is not in the kernel"
        source = source.replace(mutate[0], mutate[1])
    module = verify.import_generated(source, tmp_path, name)
    return out.model, module, verify.LayerChecker(out.model)


def test_the_spec_uses_every_new_elementwise_op():
    out, _ = compile_source(ONE, "ew.mk", None)
    used = {n.op for n in out.model.kind("dense").nodes}
    new = {name for name, op in OPS.items() if op.reference.__module__ == ew.__name__} - {
        "add",
        "mul",
        "sigmoid",
        "silu",
        "swiglu",
        "situ",
        "softcap",
        "softmax",
        "floor",  # with `to_f32`: the position-dependent temperature, run by tests/test_families2.py's kernel
        "to_f32",  # (a floor here would sit on rounding edges of this spec's random values)
    }
    assert new <= used, f"ops the kernel test does not run: {sorted(new - used)}"
    assert NEW_OPS <= new


@pytest.mark.timeout(300)
def test_elementwise_kernel_matches_the_reference(tmp_path):
    model, module, checker = build(ONE, tmp_path, "ew_one")
    result = verify.check_batch(model, module, checker, batch=3, steps=1, seed=1)
    assert not result.failures, result.failures
    assert set(result.worst) >= {"carries", "logits"}
    print(f"\nworst error / bound: {result.worst}")


@pytest.mark.timeout(300)
def test_elementwise_kernel_sharded_over_two_devices(tmp_path):
    model, module, checker = build(SHARDED, tmp_path, "ew_tp2")
    assert tuple(module.MESH_SHAPE) == (2,)
    result = verify.check_batch(model, module, checker, batch=2, steps=1, seed=2)
    assert not result.failures, result.failures
    print(f"\nworst error / bound (2 devices): {result.worst}")


@pytest.mark.timeout(300)
def test_a_wrong_repeat_fails_the_check(tmp_path):
    bug = ("jnp.where(col == h, s[:, h : h + 1], out)", "jnp.where(col == h, s[:, 0:1], out)")
    model, module, checker = build(ONE, tmp_path, "ew_bad", mutate=bug)
    result = verify.check_batch(model, module, checker, batch=3, steps=1, seed=1)
    assert result.failures, "a kernel whose repeat ignores the head passed the layer check"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", [ONE, SHARDED], ids=["one_device", "two_devices"])
def test_elementwise_kernel_compiles_with_libtpu(text, tmp_path):
    _, module, _ = build(text, tmp_path, "ew_tpu")
    devices = tpu_compile.tpu7x_devices(tpu_compile.topology_for(module))
    _, seconds = tpu_compile.compile_module(module, devices, 8, verify.check_seq_len(module))
    assert seconds > 0
