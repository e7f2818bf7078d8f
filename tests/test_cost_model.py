"""The cost model built from measured components (issue 12, point 4): each phase at its measured
stream rate, compute from the static schedule or a documented estimate, the ring's tiles in flight
landing during exchanges, the dispatch per device call. Hand-worked figures; all modeled."""

from __future__ import annotations

from pathlib import Path

import pytest

from mkdsl.lang.elaborate import load
from mkdsl.plan import make_plan, measured
from mkdsl.plan.cost_model import Phase, bandwidth, compute_us, simulate
from mkdsl.spmd.shard import shard

ROOT = Path(__file__).resolve().parent.parent
RATE = measured.RING_STREAM_BYTES_PER_S / 1e6  # ring bytes per us
MB = 1_000_000


def ring_op(nbytes: float, compute: float = 0.0, tile: float = RATE) -> Phase:
    """A `linear` on the ring: `nbytes` in tiles of `tile` bytes (default 1 us of stream)."""
    return Phase("k", "linear", 1, "linear", int(nbytes), RATE, compute, "", "RING", ring=True, tile_bytes=int(tile))


def exchange(us: float) -> Phase:
    return Phase("k", "all_reduce", 2, "all_reduce", 0, 1.0, 0.0, "", "", exchange_us=us)


def total(phases, slots) -> float:
    return sum(c.stream_us + c.compute_us + c.comm_us for c in simulate([phases], slots))


def test_tiles_in_flight_land_during_an_exchange():
    op = ring_op(2 * RATE)  # 2 us of ring bytes, in two tiles of 1 us
    assert total([op], 0) == pytest.approx(2.0)  # nothing ahead: the op waits for all its bytes
    # A 5 us exchange first: with 2 tiles in flight, all of the op's bytes land meanwhile.
    assert total([exchange(5), op], 2) == pytest.approx(5.0)
    # With 1 tile in flight only 1 us of bytes lands: the op still waits 1 us.
    assert total([exchange(5), op], 1) == pytest.approx(6.0)
    # Small tiles: 4 slots of quarter-us tiles hold 1 us of bytes.
    assert total([exchange(5), ring_op(2 * RATE, tile=RATE / 4)], 4) == pytest.approx(6.0)
    # Nothing streams after the exchange: nothing to land, nothing gained.
    assert total([exchange(5)], 8) == pytest.approx(5.0)


def test_compute_hides_the_stream_within_a_phase_and_refills_the_ring():
    assert total([ring_op(2 * RATE, compute=3.0)], 0) == pytest.approx(3.0)
    # The first op computes 3 us over 1 us of bytes: the next op's 2 us of bytes land meanwhile.
    assert total([ring_op(RATE, compute=3.0), ring_op(2 * RATE)], 4) == pytest.approx(3.0)


def test_each_stream_moves_at_its_measured_rate():
    assert bandwidth("experts", False, False, False)[1] == measured.EXPERT_STREAM_BYTES_PER_S  # routed experts
    assert bandwidth("", False, True, True)[1] == measured.INT8_BANK_BYTES_PER_S  # int8 ring tiles
    assert bandwidth("", True, True, False)[1] == measured.LONG_STREAM_BYTES_PER_S  # the output head
    assert bandwidth("", False, True, False)[1] == measured.RING_STREAM_BYTES_PER_S  # ring tiles
    assert bandwidth("", False, False, False)[1] == measured.RING_STREAM_BYTES_PER_S  # KV, state


def test_compute_from_the_static_schedule_else_an_estimate():
    # 1e9 flops at the peak of one core
    assert compute_us("linear", 10**9, 1.0, 1, 1, None) == (pytest.approx(1e15 / 1153.5e12), "mxu")
    tokens = {"latency": "cached_tokens"}
    assert compute_us("attention", 0, 0.1, 1, 500, None, **tokens) == (pytest.approx(3.0), "latency")  # 2 x 250
    assert compute_us("attention", 0, 0.1, 2, 250, None, **tokens) == (pytest.approx(3.0), "latency")  # 2 rows
    top = compute_us("route", 0, 0.0, 8, 1, None, latency="routing")
    assert top == (pytest.approx(measured.TOPK_ROUTING_US), "latency")
    # The static ratio at the op's weight first, then at the op.
    both = {"linear": 2.0, "linear:wq": 3.0}
    assert compute_us("linear", 0, 1.0, 1, 1, both, "linear:wq") == (pytest.approx(3.0), "static")
    assert compute_us("linear", 0, 1.0, 1, 1, both, "linear:wk") == (pytest.approx(2.0), "static")
    assert compute_us("recurrent", 0, 0.5, 1, 1, {"recurrent": 10.0}) == (pytest.approx(5.0), "static")
    # Where the compiler's schedule is known it replaces the estimate, even below it.
    fast = compute_us("attention", 0, 0.1, 1, 500, {"attention": 2.0}, **tokens)
    assert fast == (pytest.approx(0.2), "static")
    assert compute_us("recurrent", 0, 0.5, 1, 1, None) == (0.0, "")


def test_dispatch_is_charged_per_step_whatever_the_steps_per_call():
    # Measured per decode step in runs of 16 steps per call: several steps per call do not share it.
    model = shard(load(str(ROOT / "specs/tiny.mk")))
    one, many = make_plan(model), make_plan(model, steps_per_call=16)
    assert one.timing.fixed_us == many.timing.fixed_us == pytest.approx(measured.DISPATCH_US)
    assert one.timing.modeled_us == pytest.approx(many.timing.modeled_us)


def test_tiles_land_during_the_measured_share_of_an_exchange_by_default():
    op = ring_op(6 * RATE, tile=RATE)  # 6 us of ring bytes, 1 us tiles, 6 in flight
    share = measured.EXCHANGE_STREAM_OVERLAP  # 7 of 21 us in the hand kernel: 1/3
    assert share == pytest.approx(1 / 3)
    conservative = sum(c.stream_us + c.compute_us + c.comm_us for c in simulate([[exchange(9), op]], 6, share))
    optimistic = total([exchange(9), op], 6)
    assert optimistic == pytest.approx(9.0)  # all 6 us land during the 9 us exchange
    assert conservative == pytest.approx(9.0 + 6 - 9 * share)  # only 3 us of bytes land: 3 us left to wait


def test_every_op_pays_the_vector_estimate_unless_libtpu_gives_the_layer_code():
    from mkdsl.plan.cost_model import vector_us

    # 16 rows x 4096 f32 elements at 4 VALU x [8, 128] per cycle and 1.9 GHz, plus the per-op share
    elements = 16 * 4096
    expect = measured.VECTOR_OP_US + elements / (4 * 1024 * 1.9e9) * 1e6
    assert vector_us(elements) == pytest.approx(expect)
    assert measured.VECTOR_OP_US == pytest.approx(4.8 / measured.VECTOR_OPS_PER_LAYER)
    model = shard(load(str(ROOT / "specs/tiny.mk")))
    est = make_plan(model)
    vec = [p for p in est.phases if p.source == "vector"]
    assert vec and all(p.compute_us >= p.runs * measured.VECTOR_OP_US for p in vec)
    names = {a.name: a for a in est.timing.assumptions}
    assert names["vector_estimate"].effect_us == pytest.approx(sum(p.compute_us for p in vec))
    # libtpu's per-layer code instead: one phase per layer, no vector estimate inside the layers
    code = make_plan(model, static={"layer_code_us": 5.0})
    layer = [p for p in code.phases if p.op == "code"]
    assert [p.compute_us for p in layer] == [pytest.approx(5.0 * len(model.schedule))]
    assert all(p.graph == "step" for p in code.phases if p.source == "vector")


def test_the_headline_is_the_conservative_end_of_the_range():
    model = shard(load(str(ROOT / "specs/kimi_k3.mk")))
    plan = make_plan(model, batch=8, context=1152)
    t = plan.timing
    assert t.optimistic_us < t.modeled_us
    (spans,) = [a for a in t.assumptions if a.spans_range]
    assert spans.name == "exchange_overlap" and spans.effect_us == pytest.approx(t.modeled_us - t.optimistic_us)
    names = {a.name for a in t.assumptions}
    # 31 peers on a fit measured over 8 cores; attention at 1153 tokens from 250; dispatch on 32 cores
    assert {"collective_peers", "attention_context", "dispatch_cores"} <= names


def test_static_ratios_slow_the_ops_they_name():
    model = shard(load(str(ROOT / "specs/tiny.mk")))
    base = make_plan(model)
    slow = make_plan(model, static={"attention": 100.0})
    att = [p for p in slow.phases if p.op == "attention"]
    assert att and all(p.source == "static" for p in att)
    assert slow.timing.modeled_us > base.timing.modeled_us


def test_plan_reads_static_costs_and_says_what_is_wrong_with_them(tmp_path):
    import subprocess
    import sys

    def plan(*args):
        cmd = [sys.executable, "-m", "mkdsl", "plan", "specs/tiny.mk", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)

    bad = tmp_path / "bad.json"
    bad.write_text('{"ratios": {}}')
    r = plan("--static-costs", str(bad))
    assert r.returncode == 2 and "compute_over_stream" in r.stderr
    r = plan("--static-costs", str(ROOT / "specs/costs/llama3_8b.json"), "--steps-per-call", "16")
    assert r.returncode == 0, r.stderr
    assert plan("--steps-per-call", "0").returncode == 2


def test_loops_are_matched_to_ops_by_the_bytes_one_iteration_waits_for():
    """plan/static_costs.py on the Kimi K3 mini plan: an MXFP4 expert tile set, an MLA latent tile
    and a linear column block each match their op; bytes that match nothing are skipped."""
    from mkdsl.backends.tpu.bundles import LoopTiming
    from mkdsl.lang.dtypes import storage_bytes
    from mkdsl.plan import static_costs

    model = shard(load(str(ROOT / "specs/kimi_k3.mk"), "mini"))
    plan = make_plan(model)
    units = static_costs.loop_units(model, plan)
    w1 = model.tensor("moe_w1").type
    experts = 3 * storage_bytes(w1.dtype, (w1.shape[1], 128))  # mini: 128-column expert tiles
    latent = plan.kv_tile * 256 * 2  # the 128 + 64 latent columns, padded to 256 lanes, bf16
    assert units[experts] == {"moe_experts"} and units[latent] == {"mla_attention"}
    llama = shard(load(str(ROOT / "specs/llama3_8b.mk")))
    wq = next(st for seq in make_plan(llama).sequences for st in seq.streams if st.tensor == "wq")
    by_tile = static_costs.loop_units(llama, make_plan(llama))
    assert "linear:wq" in by_tile[wq.tk * wq.tn * 2] and "linear:wq" in by_tile[wq.k * wq.tn * 2]  # a tile, a block

    def loop(address, nbytes, ratio):  # 100 bundles, the same number in its own body
        return LoopTiming(address, 2, 100, 100, 100, nbytes, 0, "VALU", 0.5, ratio * 1e-6, 1e-6)

    found, skipped = static_costs.ratios(model, plan, [loop(1, experts, 2.0), loop(2, latent, 9.0), loop(3, 7, 5.0)])
    assert found == {"moe_experts": 2.0, "mla_attention": 9.0}
    assert skipped == [(3, "7 bytes: no op")]


def test_sliding_window_attention_computes_over_its_window_only():
    # gpt-oss alternates 128-token sliding layers and full layers (18 each); at 4096 cached
    # tokens the full layers' attention reads 4097 tokens a row, the sliding ones 128.
    model = shard(load(str(ROOT / "specs/gpt_oss_120b.mk")))
    plan = make_plan(model, batch=1, context=4096)
    att = {p.graph: p for p in plan.phases if p.op == "attention"}
    per_token = measured.ATTENTION_250_TOKENS_US / 250  # batch 1: one row
    assert att["sliding"].source == att["full"].source == "latency"
    assert att["sliding"].compute_us == pytest.approx(18 * 128 * per_token)
    assert att["full"].compute_us == pytest.approx(18 * 4097 * per_token)


def test_collective_phases_name_the_algorithm_the_planner_chose():
    model = shard(load(str(ROOT / "specs/gpt_oss_120b.mk")))
    plan = make_plan(model, batch=1, context=4096)
    named = {(c.graph, c.label) for c in plan.collectives}
    # a phase says "<the algorithm's label> of <the value as the spec wrote it>"
    exchanged = {(p.graph, p.what.rsplit(" of ", 1)[0]) for p in plan.phases if p.comm_us}
    assert exchanged and exchanged <= named
    algorithms = {c.algorithm for c in plan.collectives}
    assert all(any(f"({a}" in what for _, what in exchanged) for a in algorithms)


def test_ready_together_collectives_fuse_into_one_exchange():
    from mkdsl.plan import collectives, fusion

    assert collectives.union_peers([0b11100]) == 7 and collectives.union_peers([0b11100, 0b00011]) == 10  # ep, tp
    model = shard(load(str(ROOT / "specs/kimi_k3.mk")))
    plan = make_plan(model, batch=1, context=1152)
    moe = next(k for k in model.kinds if k.name == "kda_moe")
    (shared,) = [c for c in plan.collectives if c.graph == "kda_moe" and c.joined]
    # The router scores (over ep) and the latent activation (over tp) both come from x alone: the
    # plan runs them as one exchange, the router's carrying the latent's.
    a, b = shared.apart()
    assert (a.axes, b.axes) == (("ep",), ("tp",)) and len(shared.phases) == 1
    one = collectives.phase_us("direct", 10, a.phases[0].bytes + b.phases[0].bytes)
    assert shared.time_us() == pytest.approx(one) and one < a.time_us() + b.time_us()
    # The shard pass put them next to each other, after the latent's projection.
    names = [n.outputs[0].name for n in moe.nodes]
    assert names.index(b.value) == names.index(a.value) + 1 < names.index("w")
    # The attention output's all-reduce feeds the rest of the layer: it never joins a group.
    assert all(len(g) == 1 for g in fusion.groups(moe, list(plan.collectives)))
    # Pulled: the lever's what-if (every phase of every group together) changes nothing left.
    what_if = make_plan(model, batch=1, context=1152, fuse_ready=True)
    assert what_if.timing.modeled_us == pytest.approx(plan.timing.modeled_us, rel=1e-12)
    n = model.schedule.count("kda_moe") + model.schedule.count("mla_moe")
    assert plan.exchange_phases == fusion.fused_phases(model, list(plan.collectives))
    apart = sum(len(m.phases) for c in plan.collectives if c.graph == "kda_moe" for m in c.apart())
    assert apart - sum(len(c.phases) for c in plan.collectives if c.graph == "kda_moe") == 1 and n == 92


def test_plan_levers_prices_each_lever_with_the_model():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "mkdsl", "plan", "specs/tiny.mk", "--levers"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "| dispatch |" not in r.stdout  # per step: several steps per call save nothing the model knows
    assert "| fuse |" in r.stdout
    assert "| placement | nothing moves |" in r.stdout  # tiny is not sharded


def test_a_batch_and_context_that_do_not_fit_in_hbm_are_refused_with_the_largest_that_fits():
    import subprocess
    import sys

    from mkdsl.lang.diagnostics import SpecError

    llama = shard(load(str(ROOT / "specs/llama3_8b.mk")))
    make_plan(llama, batch=8, context=74991)  # a cache of 74992 tokens per row fits (weights + caches + state)
    with pytest.raises(SpecError, match="largest context that fits at batch 8 is 74991 tokens"):
        make_plan(llama, batch=8, context=74992)
    cmd = [sys.executable, "-m", "mkdsl", "plan", "specs/llama3_8b.mk", "--batch", "8", "--context", "131072"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "does not fit in HBM" in r.stderr and "74991 tokens" in r.stderr
    cmd = [sys.executable, "-m", "mkdsl", "bench", "specs/llama3_8b.mk", "--batch", "8", "--context", "131071"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)  # refused before any weight is built
    assert r.returncode == 1 and "74991 tokens" in r.stderr


def test_plan_uses_the_specs_committed_static_costs_and_says_when_the_spec_changed_since(tmp_path):
    import shutil

    from mkdsl.plan import static_costs

    static, where = static_costs.default_costs(str(ROOT / "specs/tiny.mk"), None)
    assert static and "layer_code_us" in static and where == "libtpu's schedule, costs/tiny.json"
    assert static_costs.default_costs(str(ROOT / "specs/tiny.mk"), "mini")[0] is None  # other shapes
    (tmp_path / "costs").mkdir()
    shutil.copy(ROOT / "specs/costs/tiny.json", tmp_path / "costs/tiny.json")
    (tmp_path / "tiny.mk").write_text((ROOT / "specs/tiny.mk").read_text() + "\n// edited\n")
    again, note = static_costs.default_costs(str(tmp_path / "tiny.mk"), None)
    assert again == static and "earlier version of the spec" in note


def test_every_spec_that_checks_has_its_committed_static_costs_of_its_current_text():
    """`mkdsl static-costs` writes specs/costs/<spec>.json; each spec in specs/ that checks has one,
    read from its current text (a spec edited since is stale), and no file outlives its spec. A
    spec check refuses (test_specs_compile.REFUSED) has no kernel to schedule."""
    from test_specs_compile import REFUSED

    from mkdsl.plan import static_costs

    specs = sorted((ROOT / "specs").glob("*.mk"))
    missing, stale = [], []
    for spec in specs:
        if spec.stem in REFUSED:
            continue
        found, where = static_costs.default_costs(str(spec), None)
        if found is None:
            missing.append(spec.name)
        elif "earlier version" in where:
            stale.append(spec.name)
    assert not missing, f"no specs/costs file (run `python -m mkdsl static-costs SPEC`): {missing}"
    assert not stale, f"static costs of an earlier spec text (run `python -m mkdsl static-costs SPEC`): {stale}"
    orphans = {p.stem for p in (ROOT / "specs/costs").glob("*.json")} - {s.stem for s in specs}
    assert not orphans, f"static costs of no spec: {orphans}"


def test_verify_rows_run_the_recurrent_state_in_series_and_the_plan_says_what_it_costs():
    """A verify step's R rows of a sequence run a recurrent state one after the other (row r reads
    the state row r - 1 wrote to HBM), so `recurrent` (OpDef.rows_in_series) is charged its state
    stream after its compute: the verify plan of B x R rows costs more than the batch plan of as
    many rows, by at most the smaller of the two per such phase (the ring refills during the
    compute), and names that as `rows_in_series`. Ops without the trait (attention's KV, the short
    convolutions' windows) charge the rows as batch rows."""
    from mkdsl.ops import OPS

    assert OPS["recurrent"].rows_in_series and not OPS["attention"].rows_in_series
    assert not OPS["short_conv"].rows_in_series
    model = shard(load(str(ROOT / "specs/qwen3_next_80b_a3b.mk"), profile="mini"))
    batch = make_plan(model, batch=8, context=100)
    verify = make_plan(model, batch=8, context=100, verify_rows=8)
    rec = [p for p in verify.phases if p.op == "recurrent"]
    assert rec and all(p.stream_us > 0 and p.compute_us > 0 for p in rec)
    extra = sum(min(p.stream_us, p.compute_us) for p in rec)  # every run of a phase is the same
    (named,) = [a for a in verify.timing.assumptions if a.name == "rows_in_series"]
    assert named.effect_us == pytest.approx(extra, rel=1e-9)
    assert batch.timing.modeled_us < verify.timing.modeled_us <= batch.timing.modeled_us + extra + 1e-9
    assert not [a for a in batch.timing.assumptions if a.name == "rows_in_series"]
    # the same phases without the trait's rule: each the larger of its stream and compute
    assert sum(max(p.stream_us, p.compute_us) for p in batch.phases if p.op == "recurrent") < sum(
        p.stream_us + p.compute_us for p in rec
    )
    dense = shard(load(str(ROOT / "specs/tiny.mk")))  # no recurrent state: the same step either way
    one, rows = make_plan(dense, batch=4, context=32), make_plan(dense, batch=4, context=32, verify_rows=4)
    assert rows.timing.modeled_us == one.timing.modeled_us
    with pytest.raises(ValueError, match="must divide the batch"):
        make_plan(dense, batch=4, context=32, verify_rows=3)


def test_a_serial_phase_charges_its_stream_after_its_compute():
    state = Phase("k", "recurrent", 3, "recurrent", int(2 * RATE), RATE, 1.5, "mxu", "RING")
    assert total([state], 0) == pytest.approx(2.0)  # max(2 us of state, 1.5 us of compute)
    from dataclasses import replace

    assert total([replace(state, serial=True)], 0) == pytest.approx(3.5)  # one after the other


QSPEC = """
model decode_cost

const H = 256
const K = 4096

dim B in 1 .. 8

weight embed: bf16[H, H]
weight w:     q4_k[H, K] per layer
weight w2:    q4_k[K, H] per layer

layer mlp(x) {
  return x + linear(linear(x, w), w2)
}

layers 1 { mlp: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  return x, argmax(x)
}
"""


def test_the_vector_estimate_charges_decoding_quantised_tiles(tmp_path):
    """A q4_k matrix pays its stated operations per weight at the vector unit's width (an
    assumption named in the plan); the same spec in bf16 pays none."""
    from mkdsl.ops.linear import DECODE_OPS_PER_WEIGHT
    from mkdsl.plan.cost_model import vector_us

    plans = {}
    for dtype in ("q4_k", "bf16"):
        (tmp_path / f"{dtype}.mk").write_text(QSPEC.replace("q4_k[", f"{dtype}["))
        plans[dtype] = make_plan(shard(load(str(tmp_path / f"{dtype}.mk"))))
    (w2,) = [p for p in plans["q4_k"].phases if p.what == "linear `w2`"]
    (plain,) = [p for p in plans["bf16"].phases if p.what == "linear `w2`"]
    decode = 4096 * 256 * DECODE_OPS_PER_WEIGHT["q4_k"]
    assert DECODE_OPS_PER_WEIGHT["q4_k"] == 15
    rows = 16  # batch 1 padded to the bf16 row tile: [16, 4096] in, [16, 256] out
    assert w2.source == "vector" and w2.compute_us == pytest.approx(vector_us(rows * (4096 + 256) + decode))
    # bf16: its small estimate hides under its stream; q4_k's decode outlasts the bf16 stream (modeled)
    assert plain.compute_us <= vector_us(rows * (4096 + 256)) and w2.compute_us > 3 * (
        plain.stream_us + plain.compute_us
    )
    names = {a.name: a.effect_us for a in plans["q4_k"].timing.assumptions}
    assert names["quantised_decode"] == pytest.approx(2 * (vector_us(decode) - vector_us(0)))
    assert "quantised_decode" not in {a.name for a in plans["bf16"].timing.assumptions}
