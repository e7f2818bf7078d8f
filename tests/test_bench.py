"""`mkdsl bench`: on a CPU it times the kernel in interpret mode and says those are not TPU
timings; its figures are consistent (tokens/s from ms/step, the floor from the plan)."""

from __future__ import annotations

import re

import pytest

from mkdsl.cli import main
from mkdsl.run.bench import BenchRow, parse_batches


def test_bench_on_a_cpu_runs_interpret_mode_and_says_so(capsys):
    assert main(["bench", "specs/tiny.mk", "--batch", "2", "--steps", "1"]) == 0
    out = capsys.readouterr()
    assert "not TPU timings" in out.out and "interpret mode" in out.err
    row = re.search(r"^\s+2\s+255\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%$", out.out, re.M)
    assert row, out.out
    ms, tokens, floor_us, share = map(float, row.groups())
    assert ms > 0 and tokens == pytest.approx(2e3 / ms, rel=1e-2)
    assert share == pytest.approx(100 * floor_us / (ms * 1e3), abs=1e-3)


def test_bench_figures():
    row = BenchRow(batch=4, context=255, ms_per_step=2.0, floor_us=500.0)
    assert row.tokens_per_s == 2000.0 and row.floor_share == 0.25


@pytest.mark.parametrize(
    "values,want", [(None, [1]), (["3"], [3]), (["1..4"], [1, 2, 3, 4]), (["2", "1..2", "8"], [1, 2, 8])]
)
def test_batches_parse(values, want):
    assert parse_batches(values, 1, 8, [1]) == want


@pytest.mark.parametrize("args", [["--batch", "9"], ["--batch", "x"], ["--batch", "3..2"], ["--context", "100"]])
def test_bench_usage_errors_exit_2(args, capsys):
    assert main(["bench", "specs/tiny.mk", *args]) == 2
    assert "mkdsl: error:" in capsys.readouterr().err


def test_on_a_tpu_bench_prints_the_model_beside_the_measured_step():
    from types import SimpleNamespace

    from mkdsl.run.bench import BenchRow, render

    row = BenchRow(batch=8, context=1152, ms_per_step=9.0, floor_us=4000.0, model_us=7500.0)
    assert row.model_ratio == pytest.approx(1.2)  # 9000 us measured over 7500 us modeled: the model is optimistic
    text = render(SimpleNamespace(path="specs/x.mk", profile=None), [row], native=True)
    assert "measured/model" in text and "7500.0" in text and "1.200" in text
    assert "measured/model" not in render(SimpleNamespace(path="specs/x.mk", profile=None), [row], native=False)
