"""Language and compiler changes made while writing real models not in issue 10's list (Gemma 3,
Mixtral, Qwen2.5) exactly as published: each is general, tested here at the checker; the models'
own numerics are in tests/test_gemma3.py, tests/test_mixtral.py and tests/test_qwen2_5.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mkdsl.lang.diagnostics import SpecError
from mkdsl.lang.elaborate import elaborate, load
from mkdsl.lang.syntax import parse

ROOT = Path(__file__).resolve().parent.parent


def attention_attrs(model, kind: str) -> dict:
    (node,) = [n for n in model.kind(kind).nodes if n.op == "attention"]
    return dict(node.attrs)


def test_window_zero_is_no_window_so_one_block_serves_local_and_global_layers():
    """Gemma 3's `decoder(x, theta, scaling="none", factor=1.0, window=0)`: the local kind passes
    its window, the global kind leaves the default, which the op reads as no window at all."""
    mini = load(str(ROOT / "specs" / "gemma3_27b.mk"), "mini")
    assert attention_attrs(mini, "local")["window"] == 32
    assert attention_attrs(mini, "global")["window"] is None
    rope = [dict(n.attrs) for n in mini.kind("global").nodes if n.op == "rope"]
    assert {(a["theta"], a["scaling"], a["factor"]) for a in rope} == {(1000000.0, "linear", 8.0)}


SPEC = """\
model m
const H = 256
dim B in 1 .. 8
dim S in 1 .. 64
weight embed: bf16[V, H]
weight wq: bf16[H, H] per layer
state kc: bf16[B, 2, S, 128] per layer
state vc: bf16[B, 2, S, 128] per layer
const V = 256
layer a(x) {
  return x + attention(linear(x, wq), slice(x, start=0, size=256), slice(x, start=0, size=256),
                       kc, vc, positions, heads=2, kv_heads=2, window=WINDOW)
}
layers 1 { a: otherwise }
step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  return linear(x, embed, transposed=true), argmax(linear(x, embed, transposed=true))
}
"""


@pytest.mark.parametrize("window, want", [("0", None), ("5", 5), ("-1", "error"), ("1.0", "error"), ("false", "error")])
def test_attention_window_values(window, want):
    text = SPEC.replace("WINDOW", window)
    if want != "error":
        assert attention_attrs(elaborate(parse(text), None, text), "a")["window"] == want
        return
    with pytest.raises(SpecError) as info:
        elaborate(parse(text), None, text)
    (d,) = info.value.diagnostics
    assert d.message.startswith("attention: window must be a positive number of tokens (or 0: none), got ")


# ---------------------------------------------------------------- a whole-row norm of a split row

SPLIT_NORM = """\
model split_norm
const H = 256
const NH = 4
const D = 128
const V = 512
mesh { tp = 2 }
dim B in 1 .. 4
dim S in 1 .. 64
weight embed:  bf16[V, H]
weight wq:     bf16[H, NH*D @tp]
weight wk:     bf16[H, NH*D @tp]
weight wv:     bf16[H, NH*D @tp]
weight q_norm: bf16[NH*D @tp]
weight k_norm: bf16[NH*D @tp]
weight wo:     bf16[NH*D @tp, H]
state k_cache: bf16[B, NH @tp, S, D] per layer
state v_cache: bf16[B, NH @tp, S, D] per layer
layer attn(x) {
  q = rope(rmsnorm(linear(x, wq), q_norm, eps=0.000001, offset=1.0), positions, heads=NH)
  k = rope(rmsnorm(linear(x, wk), k_norm, eps=0.000001), positions, heads=NH)
  a = attention(q, k, linear(x, wv), k_cache, v_cache, positions, heads=NH, kv_heads=NH)
  return x + linear(a, wo)
}
layers 1 { attn: otherwise }
hints { kv_tile = 16 }
step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, embed, transposed=true)
  return logits, argmax(logits)
}
"""


def test_a_full_width_norm_of_split_heads_sums_squares_across_devices():
    """OLMo 2's q/k norm over all heads, q and k split by heads over 2 devices: each device sums its
    columns' squares, one [B, 1] all-reduce per norm adds them, no gather; the (1 + w) form adds
    the offset to the device's weight slice. (The OLMo 2 mini kernel runs this in interpret mode:
    tests/test_olmo2.py.)"""
    from mkdsl.spmd.shard import shard

    local = shard(elaborate(parse(SPLIT_NORM), None, SPLIT_NORM))
    nodes = local.kind("attn").nodes
    sums = [n.outputs[0].type.shape[1] for n in nodes if n.op == "all_reduce"]
    assert sums.count(1) == 2 and not [n for n in nodes if n.op in ("all_gather", "rmsnorm")]
    assert [n.inputs[0].name for n in nodes if n.op == "add_scalar" and n.inputs[0].kind == "tensor"] == ["q_norm"]


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_the_row_split_chain_computes_rmsnorm(offset):
    """The chain `OpDef.row_split` writes, evaluated op by op with the ops' references, equals the
    rmsnorm reference (f32 rounding only: 2^-20 relative of the row's largest output)."""
    import numpy as np

    from mkdsl.lang.diagnostics import Span
    from mkdsl.lang.dtypes import F32
    from mkdsl.lang.ir import Node, Ref, TensorType, Value
    from mkdsl.ops import OPS

    rng = np.random.default_rng(7)
    env = {"x": rng.standard_normal((3, 384)).astype(np.float32), "w": rng.uniform(-0.5, 1.5, 384).astype(np.float32)}
    span = Span(1, 1, 1)
    out = Value("y", TensorType(F32, (3, 384)), span)
    attrs = (("eps", 1e-6), ("heads", 1), ("offset", offset))
    node = Node("rmsnorm", (Ref("value", "x"), Ref("tensor", "w")), attrs, (out,), (), span)
    for n in OPS["rmsnorm"].row_split(node):
        ins = [env[r.name] for r in n.inputs]
        kw = {k: v for k, v in n.attrs if k in OPS[n.op].attrs}
        (env[n.outputs[0].name],) = OPS[n.op].reference(*ins, **kw)
    want = np.asarray(OPS["rmsnorm"].reference(env["x"], env["w"], 1e-6, 1, offset)[0])
    assert np.abs(np.asarray(env["y"]) - want).max() <= 2.0**-20 * np.abs(want).max()


def test_the_split_norm_kernel_compiles_with_libtpu(tmp_path):
    """The [B, 1] all-reduce of the sums of squares is narrower than a lane tile: the collectives
    runtime sends it padded to 128 lanes (Mosaic cannot DMA a partial lane tile into the wide
    receive slots; interpret mode does not see that). Compiled for 2 TPU7x cores."""
    from mkdsl.backends.tpu.libtpu import compile_sharded, tpu7x_devices
    from mkdsl.compiler import compile_source
    from mkdsl.verify import kernel as verify

    out, _ = compile_source(SPLIT_NORM, "split_norm.mk", None, None)
    assert re.search(r"comm\.all_reduce\w*\(", out.files["kernel.py"]), "no all-reduce emitted"  # any algorithm
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "split_norm_tpu")
    compiled, _ = compile_sharded(module, tpu7x_devices("tpu7x:2x2x1"), 4, 64)
    assert compiled is not None


def test_an_unstacked_kv_cache_is_a_diagnostic_not_a_kernel_crash():
    """A cache declared without `per layer` passed `mkdsl check` and failed when the kernel was
    traced (it indexes caches by layer slot); now `check` says so at the declaration."""
    from mkdsl.compiler import compile_source

    text = SPLIT_NORM.replace("S, D] per layer", "S, D]")
    with pytest.raises(SpecError) as info:
        compile_source(text, "spec.mk", None, None)
    got = [(d.span.line, d.message) for d in info.value.diagnostics]
    assert got == [
        (line, f"KV cache `{name}` must be declared `per layer` for the kernel")
        for line, name in ((16, "k_cache"), (17, "v_cache"))
    ]
