"""int4 at any group size (issue 27). Group 128 at Qwen2.5-7B's K = 3584 was refused: a bf16
scale window must be 16 rows or all of them, so a K tile up to 2048 would be a multiple of 2048
dividing 3584. Now (mkdsl/backends/tpu/lowerings/linear.py `stream_layout`) an int4 matrix takes
K tiles up to 4096 (4-bit codes: half a bf16 tile's bytes), in which 3584 is one tile; and where
no such tile windows its scales either (K = 4736, Qwen2.5-7B's MLP width per device at tp 4), it
streams with its scales whole along K, the kernel picking each tile's rows in VMEM (`_int4_whole`,
runtime/scales.py.jinja). Proven in TPU interpret mode at K = 4480 (35 x 128: a K tile of 2240,
which 128 does not divide) and compiled with libtpu at 3584 and 4736."""

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
    """At K = 4480 each of the four has no legal K tile with per-tile scale windows (the old
    refusal, reproduced through the per-tile format below); each streams K tiles of 2240 rows with
    the scale rows of the whole K, and the traffic counts those rows with every tile."""
    path = tmp_path / "int4groups.mk"
    path.write_text(_spec(4480), encoding="utf-8")
    spec = load(str(path))
    m = spec.model
    for name in ("w_a", "w_b", "w_c", "w_d"):
        t = m.tensor(name)
        assert stream_tiles(t, TILE_K, TILE_N) == (None, 256), name  # per-tile scale windows: refused
        assert stream_tiles(t, 2 * TILE_K, TILE_N) == (None, 256), name  # even with tiles up to 4096
        sf, tk, tn = stream_layout(t, TILE_K, TILE_N)
        assert (sf.fmt.endswith("_whole"), tk, tn) == (True, 2240, 256), name
    out, _ = compile_source(path.read_text(encoding="utf-8"), str(path), None, None)
    moved = {i.what: i.bytes for i in out.plan.schedule_items if i.what.startswith("linear `w_")}
    for name, group, size in (("w_a", 32, 2), ("w_b", 64, 4), ("w_c", 128, 2), ("w_d", 128, 4)):
        codes, scales = 4480 * 256 // 2, 4480 // group * 256 * size
        assert moved[f"linear `{name}`"] == codes + 2 * scales, name  # two K tiles, each with all scales


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernel_with_whole_scales_matches_the_reference(tmp_path):
    """bf16 and f32 scales, groups 32, 64 and 128 (128 does not divide the K tile of 2240): the
    kernel in TPU interpret mode (race detector on) equals the reference within check_batch's
    tolerances, over two decode steps."""
    out, _ = compile_source(_spec(4480), str(tmp_path / "int4groups.mk"), None, None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "int4groups_kernel")
    fmts = {st.ref: st.fmt for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")}
    assert fmts["w_a"] == fmts["w_c"] == "int4_whole" and fmts["w_b"] == fmts["w_d"] == "int4_f32_whole", fmts
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=2, seed=3)
    assert not result.failures, result.failures


def test_int4_k_without_a_64_row_tile_is_refused_with_the_layout_that_streams(tmp_path):
    """A K of 32 x 129 has no K tile of whole 8-row nibble words: `check` names the line and says
    what streams."""
    text = _spec(4128).replace("int4(group=64, scale=f32)", "int4(group=32, scale=f32)")
    text = text.replace("int4(group=128)", "int4(group=32)").replace("int4(group=128, scale=f32)", "int4(group=32)")
    path = tmp_path / "int4odd.mk"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as err:
        compile_source(text, str(path), None, None)
    shown = err.value.render(str(path), text)
    assert {d.span.line for d in err.value.diagnostics} == {12, 13, 14, 15}, shown  # each int4 weight's line
    assert "has 4128 rows" in shown and "a multiple of 64" in shown, shown


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_qwen2_5_width_int4_group_128_compiles_with_libtpu(tmp_path):
    """Qwen2.5-7B's int4 shapes with group 128, bf16 and f32 scales, compiled for one TPU7x core by
    the real compiler (Mosaic's layout rules included): K = 3584 (its hidden width, [H, F]) in one
    K tile with per-tile scales, and K = 4736 (its MLP width per device at tp 4, [F, H]) with the
    scales whole along K."""
    text = _spec(4736).replace("const H = 256", "const H = 3584").replace("const V = 256", "const V = 1024")
    text = text.replace(
        "weight lm_head:",
        "weight w_e: int4(group=128)[H, F] per layer\nweight w_f: int4(group=128, scale=f32)[H, F] per layer\nweight lm_head:",
    )
    text = text.replace("h = silu(linear(x, w_up))", "h = silu(linear(x, w_up)) + linear(x, w_e) * linear(x, w_f)")
    out, _ = compile_source(text, str(tmp_path / "int4q25.mk"), None, None)
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    module = load_module(path, "int4q25")
    fmts = {
        st.ref: (st.fmt, st.tk) for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")
    }
    assert fmts["w_c"] == ("int4_whole", 2368) and fmts["w_d"] == ("int4_f32_whole", 2368), fmts
    assert fmts["w_e"] == ("int4", 3584) and fmts["w_f"] == ("int4_f32", 3584), fmts
    compiled, seconds = compile_one_core(module, tpu7x_devices(topology_for(module))[0], 8, 256)
    assert compiled is not None
    print(f"\nint4 group 128 at K = 3584 and 4736: compiled in {seconds:.1f} s")
