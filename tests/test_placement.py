"""Placement by the cost model (issue 12, point 5): each weight a core reads above its 1/N share
is re-planned split over the whole mesh; the comparison is the planner's own modeled steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from mkdsl.lang.elaborate import load
from mkdsl.plan import make_plan, placement
from mkdsl.spmd.shard import shard

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mini():
    return load(str(ROOT / "specs/kimi_k3.mk"), "mini")


def test_the_weights_above_their_share_are_the_whole_and_partly_split_ones(mini):
    names = {t.name for t in placement.over_share(mini, shard(mini))}
    assert {"mla_wqa", "mla_wkva", "kda_wfa", "moe_down", "moe_router"} <= names
    assert "kda_wq" not in names  # split over the whole mesh already


def test_each_candidate_is_a_replanned_step(mini):
    table = placement.choose(mini)
    wkva = next(rows for rows in table if rows[0].tensor == "mla_wkva")  # whole in the spec
    spec, *others = wkva
    assert spec.modeled_us == pytest.approx(make_plan(shard(mini)).timing.modeled_us, rel=1e-12)
    ways = {"(ep)": 4, "(tp)": 2, "(ep, tp)": 8}  # the mini mesh: ep 4 x tp 2
    assert len(others) == 2 * len(ways)  # rows or columns over each set of axes
    rejected = [c.split for c in others if c.error]
    assert rejected == ["[256, 256 @(ep)]", "[256, 256 @(ep, tp)]"]  # 64 and 32 columns per device, gathered
    assert all("gathered whole" in c.error for c in others if c.error)
    for c in (c for c in others if not c.error):
        split = next(w for w in ways if f"@{w}" in c.split and f"@{w[:-1]}," not in c.split)
        assert c.core_bytes * ways[split] == pytest.approx(spec.core_bytes, rel=0.01), c.split  # whole / ways
        assert c.exchange_phases > spec.exchange_phases  # the split adds exchanges
    assert placement.best(wkva).modeled_us == min(c.modeled_us for c in wkva if not c.error)
    text = placement.render(mini, table, 1)
    assert "The cost model chooses:" in text and "| `mla_wkva` | [256, 256] |" in text


def test_plan_placement_on_an_unsharded_spec_says_there_is_nothing_to_try():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "mkdsl", "plan", "specs/tiny.mk", "--placement"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "nothing to try" in done.stdout


def test_levers_and_placement_plan_with_the_static_costs_they_are_given(tmp_path, capsys, mini):
    """`--levers` and `--placement` re-plan with the cost model's options `mkdsl plan` was given:
    the levers' `plan` row is the plan's own step with `--static-costs`, not the step without."""
    import re

    from mkdsl.cli import main

    costs = tmp_path / "costs.json"
    costs.write_text('{"compute_over_stream": {"attention": 40.0}}')  # tiny's attention 40x its stream

    def step(*args) -> float:
        assert main(["plan", str(ROOT / "specs/tiny.mk"), *args]) == 0
        out = capsys.readouterr().out
        return float(re.search(r"^Step ([\d.]+) us", out, re.M).group(1))

    def plan_row(*args) -> float:
        assert main(["plan", str(ROOT / "specs/tiny.mk"), "--levers", *args]) == 0
        return float(re.search(r"^\| plan \| [^|]+ \| ([\d.]+) \|", capsys.readouterr().out, re.M).group(1))

    static = ("--static-costs", str(costs), "--steps-per-call", "2")
    assert plan_row(*static) == step(*static) != step()  # the costs change the step, and --levers sees it
    assert plan_row() == step()
    # --placement: each row is the kernel's plan with the same options.
    options = {"static": {"linear:mla_wkva": 30.0}, "steps_per_call": 2}
    wkva = mini.tensor("mla_wkva")
    got = placement.evaluate(mini, "mla_wkva", wkva.sharding, 1, None, **options)
    assert got.modeled_us == pytest.approx(placement.kernel_plan(shard(mini), 1, None, **options).timing.modeled_us)
    assert got.modeled_us != pytest.approx(placement.evaluate(mini, "mla_wkva", wkva.sharding, 1, None).modeled_us)


def test_a_gathered_slice_narrower_than_whole_lane_tiles_is_a_diagnostic(tmp_path):
    """Mosaic exchanges whole 128-lane tiles: `moe_down` split 4 ways over ep unpadded (64 columns
    per device in `mini`) would run in interpret mode but not compile, so the planner says so and
    `--placement` reports such a split as rejected."""
    from mkdsl.lang.diagnostics import SpecError

    text = (ROOT / "specs/kimi_k3.mk").read_text(encoding="utf-8")
    padded, compacted = "bf16[H, TPN*LATW @tp]", "compact(linear(x, moe_down), block=LATW, keep=LAT // TPN)"
    assert padded in text and compacted in text
    text = text.replace(padded, "bf16[H, LAT @ep]").replace(compacted, "linear(x, moe_down)")
    path = tmp_path / "kimi_unpadded.mk"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError, match="over `moe_down` is split over ep into 64 columns per device"):
        make_plan(shard(load(str(path), "mini")))
    make_plan(shard(load(str(ROOT / "specs/kimi_k3.mk"), "mini")))  # the spec's split over tp: 128 per device
