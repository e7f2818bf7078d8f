"""The folded loop of the `recurrent` kernel (`Recurrent.fold`, runtime/kda.py.jinja): value heads
narrower than a lane tile (Mamba-2's 64) whose slot units fill a 128-lane window run as a loop
over trips of `fold` units, each trip's v columns read and its outputs stored as one window at a
loop index, instead of a loop unrolled per unit.

Which layouts fold (fast): the kernel's own Recurrent at a slot of 8 states of [128, 64].
Interpret mode (slow): Mamba-Codestral's mini (4 heads of 64 in 2 key groups, the gated outer
product) and tests/data/delta_narrow.mk (16 heads of 64, 8 key heads, the delta rule with beta) at
batch 8, where a slot holds a head of 8 rows, so fold = 2: 2 and 8 trips, the windows after the
first at lane offsets 128, 256, ...; each of 2 steps checked layer by layer against the reference
by `mkdsl.verify.kernel` (its bounds, derived there, as every kernel test), race detector on.
Cost: ~1 s fast; interpret ~30-90 s each on the 2-core dev machine.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from mkdsl.backends.tpu.lowerings.kda import slot_states
from mkdsl.compiler import compile_source
from mkdsl.verify import kernel as verify

ROOT = Path(__file__).resolve().parent.parent
NARROW = ROOT / "tests" / "data" / "delta_narrow.mk"
MAMBA = ROOT / "specs" / "mamba_codestral_7b.mk"


def _kernel(spec: Path, profile: str | None, tmp: Path, name: str):
    out, _ = compile_source(spec.read_text(encoding="utf-8"), str(spec), profile, None)
    return out, verify.import_generated(out.files["kernel.py"], tmp, name)


@pytest.mark.parametrize(
    "heads, batch, dk, dv, fold, unrolled",
    [
        (128, 8, 128, 64, 2, True),  # Mamba-Codestral / Nemotron-H at batch 8: a head per row
        (128, 1, 128, 64, 1, True),  # batch 1: 8 heads per row, 512 columns a unit
        (4, 8, 128, 64, 2, True),  # the minis at batch 8
        (4, 4, 128, 64, 1, True),  # 2 heads per row: a unit is one window already, unrolled as before
        (4, 2, 128, 64, 1, True),
        (16, 8, 128, 64, 2, True),  # delta_narrow
        (12, 8, 128, 32, 4, True),  # 4 heads of 32 a window
        (6, 8, 128, 32, 1, True),  # 6 units are not whole windows of 4
        (16, 8, 64, 64, 1, True),  # keys not lane-aligned
        (8, 8, 128, 128, 1, False),  # lane-aligned heads: the plain loop
    ],
)
def test_which_layouts_fold(heads, batch, dk, dv, fold, unrolled, tmp_path):
    _, module = _kernel(NARROW, None, tmp_path, "fold_layouts")
    s_in = SimpleNamespace(shape=(3, 8, dk, dv))  # 3 slots of 8 states, as `slot_states` sizes them
    rec = module.Recurrent(None, None, s_in, None, None, batch, heads)
    assert (rec.fold, rec.unrolled) == (fold, unrolled)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "spec, profile, trips",
    [(MAMBA, "mini", 2), (NARROW, None, 8)],
    ids=["mamba_codestral_mini", "delta_narrow"],
)
def test_folded_kernel_matches_the_reference_in_interpret_mode(spec, profile, trips, tmp_path):
    out, module = _kernel(spec, profile, tmp_path, f"{spec.stem}_fold")
    (layer,) = set(out.model.schedule)
    (node,) = [n for n in out.model.kind(layer).nodes if n.op == "recurrent"]
    state = node.arg("state").name
    _, heads, dk, dv = out.model.tensor(state).type.shape
    s_in = SimpleNamespace(shape=(3, slot_states(heads, dk, dv, out.model.dims[0].high), dk, dv))
    rec = module.Recurrent(None, None, s_in, None, None, 8, heads)
    assert rec.fold == 2 and rec.units // rec.fold == trips  # the path under test is the folded one
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=8, steps=2, seed=5)
    assert not result.failures, result.failures
    assert f"state {state}" in result.worst, result.worst  # the recurrent state was compared
    print(f"\n{spec.stem} batch 8 (fold 2, {trips} trips): worst error / bound {result.worst} ({result.seconds:.0f} s)")
