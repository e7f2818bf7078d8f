"""`mkdsl calibrate` (issue 23): the microbenchmarks run in TPU interpret mode with their results
checked; constants are derived from timed runs by differences; a calibration file replaces the
constants of plan/measured.py in `mkdsl plan --calibration`, and the plan moves as the model says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mkdsl.backends.tpu import calibrate
from mkdsl.backends.tpu.calibrate import suite
from mkdsl.plan import measured

ROOT = Path(__file__).resolve().parent.parent


def mkdsl(*args):
    return subprocess.run([sys.executable, "-m", "mkdsl", *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_every_microbenchmark_runs_in_interpret_mode_and_its_result_is_checked(tmp_path):
    out = tmp_path / "cal.json"
    r = mkdsl("calibrate", "--interpret", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["schema"] == calibrate.SCHEMA and data["timed"] is False and data["constants"] == {}
    assert {"device_kind", "topology", "jax", "libtpu"} <= set(data)
    benches = data["benchmarks"]
    assert benches and all(b["checked"] and not b["error"] for b in benches)
    forms = {b["params"].get("form") for b in benches if b["group"] == "exchange"}
    assert forms == {"sibling", "cross-chip", "direct 3 peers", "hierarchical 4 cores"}
    groups = {b["group"] for b in benches}
    assert groups == {"ring", "long", "experts", "exchange", "dispatch", "decode_attention", "routing", "vector"}
    assert {b["params"]["dtype"] for b in benches if b["group"] == "ring"} == {"bf16", "fp8"}
    assert {b["params"]["slots"] for b in benches if b["group"] == "experts"} == {1, 2, 4}
    # The file is one `mkdsl plan --calibration` reads (no constant timed here: the figure stays).
    base = json.loads(mkdsl("plan", "specs/tiny.mk", "--json").stdout)["plan"]["timing"]
    cal = json.loads(mkdsl("plan", "specs/tiny.mk", "--json", "--calibration", str(out)).stdout)["plan"]["timing"]
    assert cal["modeled_us"] == base["modeled_us"] and cal["constants"] == f"calibration {out}"


def test_a_wrong_result_fails_its_microbenchmark():
    r = np.random.default_rng(0)
    x, g = (r.standard_normal((8, 256)).astype(np.float32) for _ in range(2))
    w = r.standard_normal((1, 256)).astype(np.float32)

    def wrong():
        fn, args, expected = suite.local.vector(x, w, g, 1, None)
        off = 1e-3 * max(1.0, float(np.abs(expected).max()))  # 10x the check's 1e-4 of the largest value
        return (lambda *a: np.asarray(expected) + off), args, expected

    b = suite.Bench("broken", "vector", {}, wrong)
    suite.run(b, timed=False)
    assert not b.checked and "AssertionError" in b.error


def test_the_ring_benchmark_checks_x_times_w_within_its_rounding_bound():
    """The ring microbenchmark's check (x @ W within K * 2^-24 * sum |products|) fails a result
    one bound past it, and passes the exact one."""
    r = np.random.default_rng(1)
    x = r.standard_normal((16, 256)).astype(suite.local.tile_dtype("bf16"))
    w = r.standard_normal((256, 128)).astype(suite.local.tile_dtype("bf16"))
    fn, args, expected = suite.local.ring(x, w, 128, 128, 4, None)
    for shift, ok in ((0.0, True), (2.0, False)):
        b = suite.Bench(
            "ring", "ring", {}, lambda s=shift: ((lambda *a: expected.value + s * expected.bound), args, expected)
        )
        suite.run(b, timed=False)
        assert b.checked is ok, b.error


def test_the_microbenchmarks_run_the_kernels_own_runtime_rendered_from_its_templates():
    """calibrate/runtime.py renders templates/runtime/*.py.jinja (the parts a generated module
    carries) with the module constants they read; the benchmarks call its `linear`, `Comm`,
    `topk_into`, `rmsnorm`, `MoE` and `Attention`, the same text as every generated kernel's."""
    from mkdsl.backends.tpu.calibrate import runtime

    text = runtime.source(4)
    gen = (ROOT / "generated/qwen3_30b_a3b/kernel.py").read_text()  # a MoE model: it routes
    parts = ("def linear(", "def ring_issue(", "def topk_into(", "def rmsnorm(", "class Stream:", "class MoE:")
    for fn in (*parts, "class Attention:", "class Comm:"):
        at = gen.index(fn)
        body = gen[at : gen.index("\n\n\n", at)]
        assert body in text, fn  # the generated kernel's own code, verbatim
    assert "RING_DEPTH = 4" in text and runtime.module(4).RING_DEPTH == 4
    assert "class Comm:" in text and "class QStream(" in text


def timed(group: str, seconds: float, **params) -> suite.Bench:
    return suite.Bench("t", group, params, None, seconds=seconds, checked=True)


def test_constants_are_derived_from_differences_of_timed_runs():
    bank = {"dtype": "bf16", "tk": 1024, "tn": 1024}
    mb2 = 2 * 2**20
    runs = [
        # 32 more 2 MiB tiles take 22 us more: 3.05e12 B/s whatever the call's own 100 us
        timed("ring", 100e-6 + 32 * mb2 / 3.05e12, **bank, bytes=32 * mb2, tiles=32),
        timed("ring", 100e-6 + 64 * mb2 / 3.05e12, **bank, bytes=64 * mb2, tiles=64),
        # sibling: 2.2 us + bytes / 663 GB/s per exchange, at 2 sizes and 2 repetition counts
        *(
            timed("exchange", 50e-6 + reps * (2.2e-6 + size / 663e9), form="sibling", bytes=size, reps=reps)
            for size in (32768, 262144)
            for reps in (4, 36)
        ),
        timed("dispatch", 80e-6, steps=1),
        timed("dispatch", 80e-6 + 15 * 30e-6, steps=16),  # 30 us per step beyond the first
        timed("decode_attention", 5e-6 + 256 * 2e-9, tokens=256),
        timed("decode_attention", 5e-6 + 4096 * 2e-9, tokens=4096),  # 2 ns per token: 0.5 us per 250
    ]
    c = suite.derive(runs, devices=8)
    assert c["RING_STREAM_BYTES_PER_S"] == pytest.approx(3.05e12)
    assert c["SIBLING_COPY_US"] == pytest.approx(2.2) and c["SIBLING_COPY_BYTES_PER_S"] == pytest.approx(663e9)
    assert c["DISPATCH_US"] == pytest.approx(30.0) and c["DISPATCH_MEASURED_CORES"] == 8
    assert c["ATTENTION_250_TOKENS_US"] == pytest.approx(0.5) and c["ATTENTION_MEASURED_TOKENS"] == 4096
    assert "CROSS_CHIP_COPY_US" not in c  # not timed: stays borrowed


def test_a_changed_constant_moves_the_plan_as_the_model_says(tmp_path):
    def step(*extra):
        r = mkdsl("plan", "specs/tiny.mk", "--json", *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["plan"]["timing"]

    base = step()
    path = tmp_path / "cal.json"
    calibrate.write(path, {"DISPATCH_US": measured.DISPATCH_US + 30.0}, {"device_kind": "test"}, [])
    slower = step("--calibration", str(path))
    assert slower["fixed_us"] == pytest.approx(base["fixed_us"] + 30.0)  # dispatch is charged once per step
    assert slower["modeled_us"] == pytest.approx(base["modeled_us"] + 30.0)
    # Half the ring's rate doubles the floor (bytes that must move / the ring's rate).
    calibrate.write(path, {"RING_STREAM_BYTES_PER_S": measured.RING_STREAM_BYTES_PER_S / 2}, {}, [])
    assert step("--calibration", str(path))["floor_us"] == pytest.approx(2 * base["floor_us"])
    calibrate.write(path, {"NOT_A_CONSTANT": 1.0}, {}, [])
    r = mkdsl("plan", "specs/tiny.mk", "--calibration", str(path))
    assert r.returncode == 2 and "NOT_A_CONSTANT" in r.stderr
    path.write_text("{}")
    assert mkdsl("plan", "specs/tiny.mk", "--calibration", str(path)).returncode == 2


def test_a_calibration_replaces_constants_for_one_plan_and_restores_them():
    old = measured.apply({"DIRECT_FIT_CORES": 16.0, "UNEXPLAINED_LAYER_US": 8.0}, "calibration t.json")
    try:
        assert measured.DIRECT_FIT_CORES == 16 and isinstance(measured.DIRECT_FIT_CORES, int)  # counts stay ints
        assert measured.VECTOR_OP_US == pytest.approx(8.0 / measured.VECTOR_OPS_PER_LAYER)  # derived ones follow
        assert measured.SOURCE == "calibration t.json"
    finally:
        measured.restore(old)
    assert measured.DIRECT_FIT_CORES == 8 and measured.VECTOR_OP_US == pytest.approx(4.8 / 40)
    with pytest.raises(ValueError, match="unknown constants NOPE"):
        measured.apply({"NOPE": 1.0}, "x")
