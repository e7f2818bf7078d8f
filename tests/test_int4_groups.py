"""int4 at any group size (issue 27): a group whose scale rows no K tile can window legally (128
at Qwen2.5-7B's K = 3584: a bf16 window must be 16 rows or all of them, so the K tile would be a
multiple of 2048 dividing 3584) streams with its scales whole along K, and the kernel picks each
tile's rows in VMEM (mkdsl/backends/tpu/lowerings/linear.py `_int4_whole`,
runtime/scales.py.jinja). Proven in TPU interpret mode at a mini K of 2176 (17 x 128: the same
refusal, and a K tile of 1088 that 128 does not divide) and compiled with libtpu at 3584."""

from __future__ import annotations

import pytest
from compile_helpers import compile_one_core, load_module, tpu7x_devices

from mkdsl.api import load
from mkdsl.backends.tpu.libtpu import topology_for
from mkdsl.backends.tpu.lowerings.linear import TILE_K, TILE_N, stream_layout, stream_tiles
from mkdsl.compiler import compile_source
from mkdsl.lang.diagnostics import SpecError
from mkdsl.verify import kernel as verify

SPEC = """
model int4groups

const H = 256
const F = FW
const V = 256

dim B in 1 .. 8

weight embed:   bf16[V, H]
weight w_up:    bf16[H, F]                             per layer
weight w_a:     int4(group=32)[F, H]                   per layer
weight w_b:     int4(group=64, scale=f32)[F, H]        per layer
weight w_c:     int4(group=128)[F, H]                  per layer
weight w_d:     int4(group=128, scale=f32)[F, H]       per layer
weight lm_head: bf16[H, V]

layer mlp(x) {
  h = silu(linear(x, w_up))
  return x + linear(h, w_a) + linear(h, w_b) + linear(h, w_c) + linear(h, w_d)
}

layers 1 { mlp: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


def _spec(k: int) -> str:
    return SPEC.replace("FW", str(k))


def test_groups_no_k_tile_windows_stream_with_whole_scales(tmp_path):
    """At K = 2176 each of the four had no legal K tile before (the old refusal, reproduced
    through the per-tile format below); now each streams K tiles of 1088 rows with the scale rows
    of the whole K, and the traffic counts those rows with every tile."""
    path = tmp_path / "int4groups.mk"
    path.write_text(_spec(2176), encoding="utf-8")
    spec = load(str(path))
    m = spec.model
    for name in ("w_a", "w_b", "w_c", "w_d"):
        t = m.tensor(name)
        assert stream_tiles(t, TILE_K, TILE_N) == (None, 256), name  # per-tile scale windows: refused
        sf, tk, tn = stream_layout(t, TILE_K, TILE_N)
        assert (sf.fmt.endswith("_whole"), tk, tn) == (True, 1088, 256), name
    out, _ = compile_source(path.read_text(encoding="utf-8"), str(path), None, None)
    moved = {i.what: i.bytes for i in out.plan.schedule_items if i.what.startswith("linear `w_")}
    for name, group, size in (("w_a", 32, 2), ("w_b", 64, 4), ("w_c", 128, 2), ("w_d", 128, 4)):
        codes, scales = 2176 * 256 // 2, 2176 // group * 256 * size
        assert moved[f"linear `{name}`"] == codes + 2 * scales, name  # two K tiles, each with all scales


def test_kernel_with_whole_scales_matches_the_reference(tmp_path):
    """bf16 and f32 scales, groups 32, 64 and 128 (128 does not divide the K tile of 1088): the
    kernel in TPU interpret mode (race detector on) equals the reference within check_batch's
    tolerances, over two decode steps."""
    out, _ = compile_source(_spec(2176), str(tmp_path / "int4groups.mk"), None, None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "int4groups_kernel")
    fmts = {st.ref: st.fmt for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")}
    assert fmts["w_a"] == fmts["w_c"] == "int4_whole" and fmts["w_b"] == fmts["w_d"] == "int4_f32_whole", fmts
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=2, seed=3)
    assert not result.failures, result.failures


def test_int4_k_without_a_64_row_tile_is_refused_with_the_layout_that_streams(tmp_path):
    """A K of 32 x 65 has no K tile of whole 8-row nibble words: `check` names the line and says
    what streams."""
    text = _spec(2080).replace("int4(group=64, scale=f32)", "int4(group=32, scale=f32)")
    text = text.replace("int4(group=128)", "int4(group=32)").replace("int4(group=128, scale=f32)", "int4(group=32)")
    path = tmp_path / "int4odd.mk"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as err:
        compile_source(text, str(path), None, None)
    shown = err.value.render(str(path), text)
    assert {d.span.line for d in err.value.diagnostics} == {12, 13, 14, 15}, shown  # each int4 weight's line
    assert "has 2080 rows" in shown and "a multiple of 64" in shown, shown


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_qwen2_5_width_int4_group_128_compiles_with_libtpu(tmp_path):
    """K = 3584 (Qwen2.5-7B's hidden width) with group 128, bf16 and f32 scales, compiled for one
    TPU7x core by the real compiler (Mosaic's layout rules included)."""
    text = _spec(3584).replace("const H = 256", "const H = 3584").replace("const V = 256", "const V = 1024")
    out, _ = compile_source(text, str(tmp_path / "int4q25.mk"), None, None)
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    module = load_module(path, "int4q25")
    fmts = {st.fmt for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")}
    assert {"int4_whole", "int4_f32_whole"} <= fmts, fmts
    compiled, seconds = compile_one_core(module, tpu7x_devices(topology_for(module))[0], 8, 256)
    assert compiled is not None
    print(f"\nint4 group 128 at K = 3584: compiled in {seconds:.1f} s")
