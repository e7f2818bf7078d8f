"""The shard pass's deferred norms (mkdsl/spmd/defer_norm.py): where the rewrite applies and where not.

A small two-device layer holds the chain: an MLP's partial output `r` (its down-projection split
by rows over tp), normalised over its whole row, then a projection split by rows (`w_proj`), whose
output is all-reduced at the layer's return (`x + y`), with another partial beside it or not.
Its numerics on devices are checked by tests/test_shard.py (per-device models in lockstep, Kimi
K3 mini), tests/test_comm_deferred.py (the runtime's exchanges) and tests/test_kimi_kernel.py.
"""

from __future__ import annotations

import pytest

from mkdsl.lang.elaborate import elaborate
from mkdsl.lang.ir_text import dump_ir
from mkdsl.lang.syntax import parse
from mkdsl.plan import collectives as co
from mkdsl.plan.planner import make_plan
from mkdsl.spmd.shard import shard

SPEC = """model defer_demo

const H = 256
const F = 512
const V = 256

mesh { tp = 2 }

dim B in 1 .. 8
dim S in 1 .. 256

weight embed:   bf16[V, H]
weight n1:      bf16[H]          per layer
weight w_up:    bf16[H, F @tp]   per layer
weight w_down:  bf16[F @tp, H]   per layer
weight n2:      bf16[H]          per layer
weight w_proj:  bf16[H @tp, H]   per layer
weight w_side:  bf16[F @tp, H]   per layer
weight lm_head: bf16[H, V]

layer mlp(x) {
  u = linear(rmsnorm(x, n1), w_up)
  r = linear(u, w_down)
  y = linear(rmsnorm(r, n2), w_proj)
  return x + y
}

layers 2 { mlp: otherwise }

step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


def local_ops(text: str) -> list[str]:
    local = shard(elaborate(parse(text), None, text))
    return [n.op for n in local.kind("mlp").nodes]


def test_the_chain_becomes_a_reduce_scatter_and_a_scaled_all_reduce():
    ops = local_ops(SPEC)
    assert "reduce_scatter" in ops and "norm_weight_mine" in ops and "all_reduce_scaled" in ops
    assert "rmsnorm" in ops  # the layer's first norm (of a whole value) stays
    assert ops.count("rmsnorm") == 1 and "shard_slice" not in ops and "all_reduce" not in ops
    local = shard(elaborate(parse(SPEC), None, SPEC))
    text = dump_ir(local)
    assert "%r__mine: f32[B, 128] = reduce_scatter(%r) {axes=('tp',), ways=2}" in text
    assert "%y__sum: f32[B, 256] = all_reduce_scaled(%y, %r__mine) {axes=('tp',), eps=1e-05, n=256}" in text


def test_another_partial_rides_along():
    side = SPEC.replace("  return x + y\n", "  return x + (y + linear(u, w_side))\n")
    local = shard(elaborate(parse(side), None, side))
    (node,) = [n for n in local.kind("mlp").nodes if n.op == "all_reduce_scaled"]
    assert len(node.inputs) == 3 and "add" not in [n.op for n in local.kind("mlp").nodes][:-1]


@pytest.mark.parametrize(
    "edit, why",
    [
        ("  return x + y\n", "  return x + y + sigmoid(r)\n"),  # the sum of r used twice (sigmoid needs it whole)
        ("  return x + y\n", "  return x + y + rmsnorm(r, n2)\n"),  # the norm used twice
        ("  return x + y\n", "  return x + (y + y)\n"),  # the projection added to itself (two uses)
    ],
    ids=["sum-used-twice", "norm-used-twice", "projection-doubled"],
)
def test_no_rewrite_where_a_value_of_the_chain_has_another_use(edit, why):
    text = SPEC.replace(edit, why)
    assert text != SPEC
    ops = local_ops(text)
    assert "reduce_scatter" not in ops and "all_reduce_scaled" not in ops
    assert "all_reduce" in ops


def test_the_plan_prices_the_two_exchanges_and_both_batches_meet_their_masks():
    local = shard(elaborate(parse(SPEC), None, SPEC))
    plan = make_plan(local, batch=8)
    found = {c.op: c for c in plan.collectives if c.graph == "mlp"}
    scatter, scaled = found["reduce_scatter"], found["all_reduce_scaled"]
    assert scatter.algorithm == "rs" and len(scatter.phases) == 1
    assert scaled.algorithm == "rs_scale_ag" and len(scaled.phases) == 2
    # f32 wire (no wire_bf16 hint): r's 128 columns per device in one 128-lane message; the scaled
    # all-reduce's first message holds y's 128-column chunk and the 128-lane squares.
    # tp is bit 0: the chip's two cores, one sibling copy per phase.
    assert scatter.phases[0].lanes == 128 and scaled.phases[0].lanes == 256 and scaled.phases[1].lanes == 128
    assert scaled.time_us() == pytest.approx(sum(co.phase_us("sibling", 1, p.bytes) for p in scaled.phases))
