"""`mkdsl plan specs/kimi_k3.mk --full` (published dims, 93 layers, 32 devices): bytes per step per core at
batch 1 split into experts / attention / other dense / lm_head / KV-state, the HBM floor, the experts
share checked against the published expert dims, and the 16-chip modeled figures beside the public ones.

The expected experts share is computed here from the published figures, not from mkdsl: at batch 1
a token reads its TOPK = 16 routed experts in each of the 92 MoE layers (every layer but the dense
layer 0); an expert is three [3584, 3072] MXFP4 matrices (w1, w3: LAT x FE; w2: FE x LAT) stored as
4-bit codes plus one E8M0 scale byte per 32 values.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mkdsl.lang.elaborate import load
from mkdsl.plan import make_plan
from mkdsl.report.markdown import traffic_split
from mkdsl.spmd.shard import shard

ROOT = Path(__file__).resolve().parent.parent
SPEC = "specs/kimi_k3.mk"

# Published Kimi K3 dims (independent of the spec's constants).
LAYERS, DENSE_LAYERS = 93, 1
EXPERTS_PER_TOKEN = 16
EXPERT_WIDTH, LATENT = 3072, 3584
MXFP4_BITS, MXFP4_GROUP = 4, 32
EXPERT_PARAMS = 3 * EXPERT_WIDTH * LATENT
EXPERT_BYTES = EXPERT_PARAMS * MXFP4_BITS // 8 + EXPERT_PARAMS // MXFP4_GROUP  # codes + one scale byte per 32
EXPERTS_SHARE = EXPERTS_PER_TOKEN * (LAYERS - DENSE_LAYERS) * EXPERT_BYTES  # 25,829,572,608 bytes
# The published sharded layout: 8 expert-parallel groups x 4 column splits inside each expert. A core
# holds 1/8 of the experts, so on average 16 / 8 = 2 of a token's experts, and 1/4 of their columns.
EP_GROUPS, EXPERT_SPLITS = 8, 4
EXPERTS_SHARE_PER_CORE = EXPERTS_SHARE // (EP_GROUPS * EXPERT_SPLITS)

SHARES = ("experts", "attention", "other dense", "lm_head and embedding", "KV cache and state")
UNITS = {"GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}


@pytest.fixture(scope="module")
def model():
    return shard(load(str(ROOT / SPEC), None))  # what one core runs


@pytest.fixture(scope="module")
def plan(model):
    from mkdsl.plan import static_costs

    static, where = static_costs.default_costs(str(ROOT / SPEC), None)  # as `mkdsl plan SPEC` uses them
    return make_plan(model, batch=1, static=static, static_from=where)


@pytest.fixture(scope="module")
def printed() -> str:
    r = subprocess.run(
        [sys.executable, "-m", "mkdsl", "plan", SPEC, "--full"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def parse_bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def printed_split(printed: str) -> dict[str, tuple[float, float]]:
    """share -> (bytes, percent) from the report's "Bytes per step" table."""
    section = printed.split("## Bytes per step", 1)[1]
    rows = re.findall(r"^\| ([a-zA-Z_ -]+) \| ([0-9.]+ [KMG]?B) \| ([0-9.]+)% \|$", section, re.M)
    return {name: (parse_bytes(size), float(pct)) for name, size, pct in rows}


def test_expert_bytes_from_published_dims():
    assert EXPERT_BYTES == 16_515_072 + 1_032_192
    assert EXPERTS_SHARE == 25_829_572_608


def test_split_is_printed_at_batch_1(printed, model, plan):
    assert "Figures for batch 1 " in printed
    split = printed_split(printed)
    assert tuple(split) == SHARES, f"the Bytes per step table lists {list(split)}"
    exact = traffic_split(model, plan)
    total = sum(exact.values())
    for name, (size, pct) in split.items():
        assert size == pytest.approx(exact[name], rel=0.005), name  # .2f of a unit >= 1: <= 0.005 relative
        assert pct == pytest.approx(100 * exact[name] / total, abs=0.05), name  # printed .1f: half of 0.1
    assert sum(pct for _, pct in split.values()) == pytest.approx(100, abs=0.25)  # 5 shares, each <= 0.05 off


def test_shares_sum_to_weight_and_state_bytes(model, plan):
    split = traffic_split(model, plan)
    assert tuple(split) == SHARES
    assert all(v > 0 for v in split.values()), split
    assert sum(split.values()) == plan.weight_bytes + plan.state_bytes
    assert split["KV cache and state"] == plan.state_bytes


def test_experts_share_matches_published_dims(model, plan, printed):
    split = traffic_split(model, plan)
    assert split["experts"] == EXPERTS_SHARE_PER_CORE
    assert printed_split(printed)["experts"][0] == pytest.approx(
        EXPERTS_SHARE_PER_CORE, rel=0.005
    )  # .2f of a unit >= 1


def test_sixteen_chip_figures_beside_the_public_ones(plan, printed):
    """Per-core bytes, floor, modeled step and the 32-core tokens/s, each labelled modeled, next to
    the public measurements (709 on 16 TPU7x chips with speculation, 452 on 16 GB200)."""
    section = printed.split("## Devices and collectives (modeled)", 1)[1].split("\n## ", 1)[0]
    assert "Mesh ep 8 x tp 4 = 32 devices (TPU7x cores; 16 chips of 2 cores)" in section
    t = plan.timing
    m = re.search(r"^\| modeled tokens/s, 32 cores \(16 chips\), batch 1 \| ([0-9.]+) \|$", section, re.M)
    assert m and float(m[1]) == pytest.approx(1e6 / t.modeled_us, rel=1e-3)  # .1f of a figure > 50: < 1e-3
    m = re.search(r"^\| modeled step time \(conservative\) \| ([0-9.]+) us \|$", section, re.M)
    assert m and float(m[1]) == pytest.approx(t.modeled_us, abs=0.05)  # printed .1f: half of 0.1
    assert t.comm_us > 0 and plan.exchange_phases > 0
    # The step is the dispatch plus every phase in order: the phases' charges add up to it (the same
    # float64 terms in another order: ~1e-15), and the exchanges are charged whole but for the time
    # the shared experts run during the router's and the latent's gather (mkdsl/spmd/overlap.py).
    assert t.modeled_us == pytest.approx(t.fixed_us + sum(p.us for p in plan.phases), rel=1e-9)
    assert sum(p.comm_us for p in plan.phases) == pytest.approx(t.comm_us - t.during_us, rel=1e-9)
    assert 0 < t.during_us < t.comm_us
    m = re.search(r"^\| weight \+ state bytes per core per step \| ([0-9.]+ [KMG]?B) \|$", section, re.M)
    assert m and parse_bytes(m[1]) == pytest.approx(
        plan.weight_bytes + plan.state_bytes, rel=0.005
    )  # .2f of a unit >= 1
    assert "| public, measured (not mkdsl) | 709 accepted tokens/s" in section
    assert "| public, measured (not mkdsl) | 452 tokens/s on 16 GB200 GPUs |" in section
    # speculative decoding at the public setting, every part shown: 6 / (verify + drafter + accept)
    step8 = re.search(
        r"^\| modeled step time of the verify step of 8 rows \(one sequence; conservative"
        r"(?:; [0-9.]+ us of it the recurrent state of the rows in series)?\) \| ([0-9.]+) us \|$",
        section,
        re.M,
    )
    m = re.search(
        r"^\| modeled accepted tokens/s, speculative decoding: one sequence, 8 rows verified per step, acceptance 6 "
        r".*\| 6 / \(verify ([0-9.]+) us \+ drafter ([0-9.]+) us \+ accept ([0-9.]+) us\) = ([0-9.]+) accepted tokens/s \|$",
        section,
        re.M,
    )
    assert step8 and m and m[1] == step8[1], section
    parts = sum(float(m[i]) for i in (1, 2, 3))
    assert float(m[3]) > 0 and float(m[4]) == pytest.approx(6e6 / parts, rel=1e-3)  # .1f of figures > 100


def test_hbm_floor_is_the_total_over_bandwidth(plan, printed):
    total = plan.weight_bytes + plan.state_bytes
    t = plan.timing
    assert t.floor_us == pytest.approx(total / t.hbm_bytes_per_s * 1e6, rel=1e-9)  # float64 formula: ~1e-16
    m = re.search(r"^\| HBM floor at ([0-9.]+) TB/s \(modeled\) \| ([0-9.]+) us \|$", printed, re.M)
    assert m, "no HBM floor in the summary"
    assert float(m[1]) == pytest.approx(t.hbm_bytes_per_s / 1e12, abs=0.005)  # printed .2f: half of 0.01
    assert float(m[2]) == pytest.approx(t.floor_us, abs=0.05)  # printed .1f
    m = re.search(r"^\| weight bytes per step \| ([0-9.]+ [KMG]?B) \|$", printed, re.M)
    assert m and parse_bytes(m[1]) == pytest.approx(plan.weight_bytes, rel=0.005)  # .2f of a unit >= 1
    m = re.search(r"^\| state bytes per step \(KV read \+ written\) \| ([0-9.]+ [KMG]?B) \|$", printed, re.M)
    assert m and parse_bytes(m[1]) == pytest.approx(plan.state_bytes, rel=0.005)  # .2f of a unit >= 1
