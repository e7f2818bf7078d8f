"""Work run while an exchange travels (mkdsl/spmd/overlap.py): the shard-pass step that moves the nodes
needing none of a group of collectives right after it, the planner's windows, and the cost
model's charge for them (plan/cost_model.py)."""

from pathlib import Path

import pytest

from mkdsl.lang.elaborate import load
from mkdsl.plan import cost_model
from mkdsl.plan.cost_model import Phase
from mkdsl.plan.planner import make_plan
from mkdsl.spmd.overlap import windows
from mkdsl.spmd.ready import closure, direct_deps, is_exchange
from mkdsl.spmd.shard import shard

KIMI = str(Path(__file__).parent.parent / "specs" / "kimi_k3.mk")


@pytest.fixture(scope="module")
def mini():
    return shard(load(KIMI, "mini"))


def test_the_shared_experts_run_during_the_router_and_latent_gathers(mini):
    plan = make_plan(mini, 1, None)
    found = {(g, v): run for g, v, run in windows(mini, plan.collectives)}
    assert set(plan.windows) == {(g, v, r) for (g, v), r in found.items()}
    for kind in ("kda_moe", "mla_moe"):
        g = mini.kind(kind)
        (value, run), *others = [(v, r) for (k, v), r in found.items() if k == kind]
        assert not others, "one window per MoE layer kind"
        head = next(i for i, n in enumerate(g.nodes) if n.outputs and n.outputs[0].name == value)
        ops = [g.nodes[i].op for i in run]
        weights = [r.name for i in run for r in g.nodes[i].inputs if r.kind == "tensor"]
        assert ops == ["linear", "linear", "situ", "linear"]
        assert weights == ["shared_gate", "shared_up", "shared_down"]
        # The window follows the gathers (the router's and the latent's, one exchange) and needs none of them.
        gathers = [i for i in range(head, run[0]) if is_exchange(g.nodes[i])]
        assert gathers == list(range(head, run[0])) and len(gathers) == 2
        needs = closure(direct_deps(g.nodes))
        assert all(not needs[j] & set(gathers) for j in run)
        # route, which needs the router scores, stays after the window.
        route = next(i for i, n in enumerate(g.nodes) if n.op == "route")
        assert route > run[-1]


def test_a_node_that_needs_the_exchange_is_never_in_a_window(mini):
    plan = make_plan(mini, 8, None)
    for graph, value, run in plan.windows:
        g = mini.kind(graph)
        needs = closure(direct_deps(g.nodes))
        c = next(c for c in plan.collectives if c.graph == graph and c.value == value)
        members = {i for i, n in enumerate(g.nodes) if n.outputs and n.outputs[0].name in c.values}
        assert run[0] == max(members) + 1
        assert all(not is_exchange(g.nodes[j]) and not needs[j] & members for j in run)


def _collective(us: float, first: float) -> Phase:
    return Phase("k", "all_gather", 1, "all_gather", 0, 1.0, 0.0, "", "", exchange_us=us, overlap_us=first)


def _op(compute: float, during: bool) -> Phase:
    return Phase("k", "linear", 2, "linear", 0, 1.0, compute, "mxu", "", during=during)


@pytest.mark.parametrize("work, hidden", [(1.0, 1.0), (2.5, 2.5), (4.0, 3.0)])
def test_work_during_an_exchange_hides_up_to_its_first_phase(work, hidden):
    # A 5 us collective whose first phase takes 3 us, then `work` us of compute in its window and
    # 1 us after it: the collective is charged 5 - min(3, work), the ops their own compute.
    order = [[_collective(5.0, 3.0), _op(work / 2, True), _op(work / 2, True), _op(1.0, False)]]
    charges = cost_model.simulate(order, slots=2)
    assert [c.comm_us for c in charges] == pytest.approx([5.0 - hidden, 0, 0, 0])
    assert sum(c.compute_us for c in charges) == pytest.approx(work + 1.0)
    # Without the window, the same phases are charged in a row.
    plain = cost_model.simulate(
        [[_collective(5.0, 3.0), _op(work / 2, False), _op(work / 2, False), _op(1.0, False)]], 2
    )
    total = lambda cs: sum(c.stream_us + c.compute_us + c.comm_us for c in cs)  # noqa: E731
    assert total(plain) - total(charges) == pytest.approx(hidden)


def test_the_plan_report_marks_the_ops_run_during_an_exchange(mini):
    from mkdsl.report.markdown import render_plan

    plan = make_plan(mini, 1, None)
    rows = [line for line in render_plan(mini, plan, KIMI).splitlines() if "(during the exchange of" in line]
    assert len(rows) == sum(len(run) for _, _, run in plan.windows) == 8  # 4 ops in each MoE layer kind
    assert all("shared" in row or "situ" in row or "linear" in row for row in rows)
