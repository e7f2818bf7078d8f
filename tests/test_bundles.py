"""`mkdsl plan --static`: the bundle parser on a committed dump of the tiny kernel, and the CLI
compiling a kernel with libtpu (compile-only TPU7x) and timing its loops."""

import gzip
import re
import subprocess
import sys
from pathlib import Path

from mkdsl.backends.tpu import bundles

DATA = Path(__file__).parent / "data" / "static"
ROOT = Path(__file__).parent.parent


def _dump():
    # Written by libtpu 0.0.42.1 for generated/tiny at batch 1, seq_len 256 (one KV tile).
    text = gzip.decompress((DATA / "tiny-final_bundles.txt.gz").read_bytes()).decode()
    util = gzip.decompress((DATA / "tiny-utilization.txt.gz").read_bytes()).decode()
    return bundles.parse_bundles(text), bundles.parse_utilization(util)


def test_every_bundle_is_parsed_and_matches_the_utilization_rows():
    found, util = _dump()
    # The compiler's own count, from the schedule analysis of the same compile.
    assert len(found) == 5539
    assert len(util.rows) == len(found)
    assert util.units[:3] == ("MXU", "XLU", "VALU") and util.capacity[:3] == (2, 2, 4)
    assert [b.address for b in found] == list(range(len(found)))


def test_loops_nest_and_the_kv_tile_loop_waits_for_one_k_and_one_v_tile():
    found, util = _dump()
    loops = bundles.find_loops(found)
    layer = max(loops, key=lambda lp: lp.bundles)  # the fori_loop over the 2 layers
    assert layer.depth == 1 and layer.inner, "the layer loop holds the attention tile loop"
    timings = {t.address: t for t in bundles.time_loops(found, util)}
    waiting = [t for t in timings.values() if t.depth == 2 and t.self_bytes]
    assert len(waiting) == 1
    kv = waiting[0]
    kernel = (ROOT / "generated" / "tiny" / "kernel.py").read_text()
    kv_tile = int(re.search(r"^KV_TILE = (\d+)", kernel, re.M)[1])
    dk = int(re.search(r"dk=(\d+)", kernel)[1])
    # One bf16 K tile and one V tile of [KV_TILE, dk]: checks the 32-byte granule.
    assert kv.self_bytes == 2 * kv_tile * dk * 2
    assert kv.matmuls > 0 and kv.self_bundles == kv.bundles
    outer = timings[found[layer.first].address]
    assert outer.code_bundles == layer.bundles - sum(loops[k].bundles for k in layer.inner)


def test_times_follow_the_stated_clock_and_stream():
    found, util = _dump()
    slow = bundles.time_loops(found, util, clock_hz=1e9, stream=1e12)
    fast = bundles.time_loops(found, util, clock_hz=2e9, stream=1e12)
    for a, b in zip(slow, fast, strict=True):
        assert abs(a.compute_s - 2 * b.compute_s) <= 1e-15
        assert a.stream_s == a.self_bytes / 1e12


def test_plan_static_compiles_tiny_and_reports_its_loops():
    # --context 100: the kernel is compiled for the 101 tokens in whole KV tiles (it takes no other length)
    done = subprocess.run(
        [sys.executable, "-m", "mkdsl", "plan", str(ROOT / "specs" / "tiny.mk"), "--static", "--context", "100"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "tpu7x:2x2x1" in done.stdout and "MB generated code" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 0x")]
    waited = [int(r.split("|")[6]) for r in rows]
    assert any(n > 0 for n in waited), "the KV tile loop waits for its tiles"


def test_static_compiles_the_context_in_whole_kv_tiles():
    from mkdsl.backends.tpu.static_run import seq_len

    assert seq_len(1152, 256) == 1280 and seq_len(255, 256) == 256 and seq_len(256, 256) == 512
    assert seq_len(None, 256) == 0  # the default: two tiles


def test_plan_static_rejects_a_bad_clock():
    done = subprocess.run(
        [sys.executable, "-m", "mkdsl", "plan", str(ROOT / "specs" / "tiny.mk"), "--static", "--clock-ghz", "0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--clock-ghz" in done.stderr


def test_the_kv_tile_loop_gives_attention_its_static_ratio(tmp_path):
    """`--save-costs`: loops matched to ops by their bytes per iteration, ratios for --static-costs."""
    import json

    from mkdsl.compiler import compile_source
    from mkdsl.plan import static_costs

    found, util = _dump()
    timings = bundles.time_loops(found, util)
    out, _ = compile_source((ROOT / "specs" / "tiny.mk").read_text(), str(ROOT / "specs" / "tiny.mk"), None)
    ratios, skipped = static_costs.ratios(out.model, out.plan, timings)
    kv = next(t for t in timings if t.depth == 2 and t.self_bytes)
    assert ratios == {"attention": kv.ratio}  # the one loop that waits for a K and a V tile
    assert skipped and all("no op" in why for _, why in skipped)  # the layer loop's small fetches
    path = tmp_path / "costs.json"
    static_costs.save(path, ratios, skipped, bundles.ASSUMED_CLOCK_HZ, "test")
    assert json.loads(path.read_text())["compute_over_stream"] == {"attention": kv.ratio}
    done = subprocess.run(
        [sys.executable, "-m", "mkdsl", "plan", str(ROOT / "specs" / "tiny.mk"), "--static-costs", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_save_costs_needs_static():
    done = subprocess.run(
        [sys.executable, "-m", "mkdsl", "plan", str(ROOT / "specs" / "tiny.mk"), "--save-costs", "x.json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--static" in done.stderr
