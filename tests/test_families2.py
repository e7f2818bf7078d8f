"""The general capabilities Llama 4 needed, each in one small spec built on specs/tiny.mk, its kernel
against the reference in TPU interpret mode (race detector on), layer by layer: attention's
`chunk` mask with prefix-global tokens, position-dependent scalars (`to_f32`, `floor`, `log` on the step's positions), the
weightless `rmsnorm`, `layernorm` with and without a bias, a `linear` whose input stays f32
(`input="f32"`), and a per-head weight `[NH]` broadcast over the head dim (`repeat` of a
declared weight). Decode steps, and verify rows (R = 2 per sequence, each row at its own
position). The float64 oracles of each op are in tests/test_ops_*.py; the Llama 4 spec that uses
them all, sharded, is tests/test_llama4.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mkdsl.compiler import compile_source
from mkdsl.lang.elaborate import elaborate
from mkdsl.lang.syntax import parse
from mkdsl.verify import kernel as verify

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "specs" / "tiny.mk").read_text(encoding="utf-8")
LAYER = """  q = rope(linear(h, wq), pos, heads=NH)
  k = rope(linear(h, wk), pos, heads=NKV)
  a = attention(q, k, linear(h, wv), k_cache, v_cache, pos, heads=NH, kv_heads=NKV)
  x = x + linear(a, wo)"""
FAMILIES = """  t = 1.0 + 0.1 * log(floor((to_f32(pos) + 1.0) / 4.0) + 1.0)
  q = rmsnorm(rope(linear(h, wq), pos, heads=NH), heads=NH, eps=0.00001) * t
  k = rmsnorm(rope(linear(h, wk), pos, heads=NKV), heads=NKV, eps=0.00001)
  a = attention(q, k, linear(h, wv), k_cache, v_cache, pos, heads=NH, kv_heads=NKV, chunk=CHUNK, global_tokens=4)
  x = x + linear(a * repeat(head_scale, each=D), wo)"""


def load_text(text: str):
    return elaborate(parse(text), None, text)


def families_spec(chunk: int) -> str:
    assert LAYER in TINY and "h = rmsnorm(x, norm2)" in TINY and "rmsnorm(x, out_norm)" in TINY
    text = TINY.replace(LAYER, FAMILIES).replace(
        "weight wo:", "weight head_scale: bf16[NH] per layer   # a per-head output scale\nweight wo:"
    )
    text = text.replace("weight w_gate:", "weight ln_bias: bf16[H] per layer\nweight w_gate:")
    text = text.replace("h = rmsnorm(x, norm2)", "h = layernorm(x, norm2, ln_bias)")  # LayerNorm with a bias
    text = text.replace("rmsnorm(x, out_norm)", "layernorm(x, out_norm, eps=0.000001)")  # and without
    assert "linear(h, w_up)" in text
    text = text.replace("linear(h, w_up)", 'linear(h, w_up, input="f32")')  # the input kept f32
    return text.replace("const V = 256", f"const V = 256\nconst CHUNK = {chunk}")


def test_the_spec_says_each_capability():
    model = load_text(families_spec(16))
    ops = {n.op: n for n in model.kinds[0].nodes}
    assert (ops["attention"].attr["chunk"], ops["attention"].attr["global_tokens"]) == (16, 4)
    assert {"to_f32", "floor", "log", "repeat"} <= set(ops)
    norms = [n for n in model.kinds[0].nodes if n.op == "rmsnorm"]
    assert sum(len(n.inputs) == 1 for n in norms) == 2  # the weightless q and k norms
    assert [len(n.inputs) for n in model.kinds[0].nodes if n.op == "layernorm"] == [3]
    assert [len(n.inputs) for n in model.step.nodes if n.op == "layernorm"] == [2]


def test_the_chunk_kernel_text_is_the_one_adding_an_op_shows():
    doc = (ROOT / "docs" / "adding-an-op.md").read_text(encoding="utf-8")
    shown = doc.split("```python chunk kernel\n", 1)[1].split("```", 1)[0].strip()
    text = TINY.replace(
        "heads=NH, kv_heads=NKV)\n  x = x + linear(a, wo)",
        "heads=NH, kv_heads=NKV, chunk=CHUNK)\n  x = x + linear(a, wo)",
    )
    out, _ = compile_source(text.replace("const V = 256", "const V = 256\nconst CHUNK = 8"), "spec.mk", None, None)
    assert "chunk=CHUNK" in text and shown in out.files["kernel.py"]
    plain = compile_source(TINY, "tiny.mk", None, None)[0].files["kernel.py"]
    ctor = next(line for line in plain.splitlines() if "= Attention(r, positions_ref" in line)
    assert ctor.endswith("window=None)")  # a kernel without chunks is built as before


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    text = families_spec(16) + "\nhints { kv_tile = 16 }\n"
    out, _ = compile_source(text, "families.mk", None, None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path_factory.mktemp("families"), "families2_kernel")
    return out.model, module


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("rows", [2])
def test_kernel_matches_reference_in_interpret_mode(kernel, rows):
    """Batch 2, two steps from one token before a chunk boundary (verify's start rule: 15 and 18),
    so the second step's rows start a new chunk, in a new KV tile (16 tokens), past the global
    tokens' tile, and a new temperature step. Verify rows (R = 2) only, to
    keep CI's time: one-row decode of the same lowerings (the chunk among them) is
    tests/test_llama4.py's kernel test, and the ops' float64 oracles show each attribute is read."""
    model, module = kernel
    checker = verify.LayerChecker(model, rows=rows) if rows > 1 else verify.LayerChecker(model)
    result = verify.check_batch(model, module, checker, 2, 2, seed=3, rows=rows)
    assert not result.failures, "; ".join(result.failures[:8])
    assert "cross the smallest window or chunk (16 tokens" in result.note


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_families_kernel_compiles_with_libtpu(tmp_path):
    """ "A spec that checks compiles": Mosaic accepts every new lowering (the chunk tables with
    global tokens, the positions in SMEM as f32 rows, the weightless and the bias-free norms, the f32-input matmul,
    a per-head weight widened by lanes) at the largest batch."""
    from compile_helpers import load_module

    from mkdsl.backends.tpu.libtpu import compile_module, topology_for, tpu7x_devices

    out, _ = compile_source(families_spec(16), "families.mk", None, None)
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    module = load_module(path, "families2_libtpu")
    batch = out.model.dims[0].high
    compiled, _ = compile_module(module, tpu7x_devices(topology_for(module)), batch, verify.check_seq_len(module))
    assert compiled is not None
