"""The modeled speculative-decoding figure (`mkdsl plan --draft`, and plan.md's speculative row):
accepted tokens/s = B x A / (the verify step + the drafter's time + the accept step), per step
of B sequences each verifying R rows and accepting A tokens on average (A includes the target's
own token, so 1 <= A <= R). Every part is modeled:

- verify: the planner's step at B x R rows (the R rows of a sequence share the weight stream as
  batch rows do; the row-by-row causal attention among them is not priced separately), planned
  with `verify_rows=R`: an op whose state runs the rows in series (`OpDef.rows_in_series`, the
  recurrent rules: row r reads the state row r - 1 wrote to HBM) is charged its state stream after
  its compute (`series_us`, shown);
- drafter: a draft spec planned like any spec at its block of B x R rows; the target's `mtp`
  head planned as a step of B rows (`mtp_model`: the planner prices its ops as it prices the
  target's) and charged R - 1 times, one head step per draft, each after the last (a draft is
  the next one's input); the n-gram drafter runs on the host, not on the device, counted as 0
  (its host cost: NGRAM_HOST);
- accept: ACCEPT_US, an estimate (not measured): the verify step's R tokens per sequence copied
  to the host and compared there, which the next step waits for (the drafter needs them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mkdsl.lang.ir import Graph, Model, Node, Ref, Value

ACCEPT_US = 20.0  # estimate, not measured: device -> host copy of B x R tokens and the host's compare
NGRAM_HOST = (
    "n-gram lookup on the host, none on the device (host cost: ~0.25 ms per step at 1152 tokens, measured in "
    "numpy on a shared 2-core CPU; not counted)"
)
PUBLIC_ROWS, PUBLIC_ACCEPTANCE = 8, 6  # the public Kimi K3 setting: rows verified per step, tokens accepted


@dataclass(frozen=True)
class Speculative:
    batch: int  # B sequences
    rows: int  # R rows per sequence per verify step
    acceptance: float  # A: mean tokens accepted per sequence per step
    verify_us: float
    draft_us: float
    draft: str  # what the drafter is and how its time was found
    accept_us: float = ACCEPT_US
    series_us: float = 0.0  # of verify_us: recurrent state charged row after row (OpDef.rows_in_series)
    draft_parts: tuple[str, ...] = ()  # what the drafter's time is made of, shown under it

    @property
    def step_us(self) -> float:
        return self.verify_us + self.draft_us + self.accept_us

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.acceptance * 1e6 / self.step_us

    def formula(self) -> str:
        """`B x A / (verify + drafter + accept)` with the figures."""
        lead = f"{self.batch} x {self.acceptance:g}" if self.batch > 1 else f"{self.acceptance:g}"
        return (
            f"{lead} / (verify {self.verify_us:.1f} us + drafter {self.draft_us:.1f} us + accept "
            f"{self.accept_us:.1f} us) = {self.tokens_per_s:.1f} accepted tokens/s"
        )

    def lines(self) -> list[str]:
        """The figure and its parts, for the terminal (every figure modeled)."""
        return [
            f"speculative decoding (modeled): {self.batch} sequence(s) x {self.rows} rows per verify step, "
            f"acceptance {self.acceptance:g}",
            f"  verify step, the planner at {self.batch * self.rows} rows: {self.verify_us:.1f} us",
            *(
                [
                    f"    of which {self.series_us:.1f} us: the recurrent state of the {self.rows} rows in series "
                    "(row r reads the state row r - 1 wrote to HBM; its stream charged after its compute)"
                ]
                if self.series_us
                else []
            ),
            f"  drafter: {self.draft}: {self.draft_us:.1f} us",
            *(f"    {part}" for part in self.draft_parts),
            f"  accept: {self.accept_us:.1f} us (estimate, not measured: tokens to the host and compared)",
            f"  modeled accepted tokens/s = {self.formula()}",
        ]


def verify_plan(model, context: int | None, depth: int, **options):
    """The verify step of PUBLIC_ROWS rows of one sequence (plan.md's and `plan --full`'s
    speculative row), when an op runs verify rows in series (`OpDef.rows_in_series`); None when
    none does, or the batch cannot hold the rows: then it is the batch plan at that many rows."""
    from mkdsl.ops import OPS
    from mkdsl.plan.planner import make_plan

    series = any(OPS[n.op].rows_in_series for k in model.kinds for n in k.nodes if n.op in OPS)
    if not series or model.dims[0].high < PUBLIC_ROWS:
        return None
    rows = PUBLIC_ROWS
    return make_plan(model, batch=rows, context=context, ring_depth=depth, verify_rows=rows, **options)


def check_acceptance(rows: int, acceptance: float) -> None:
    """ValueError unless 1 <= A <= R (a step accepts at least the target's token, at most R)."""
    if not 1 <= acceptance <= rows:
        raise ValueError(f"--acceptance must be in 1 .. --draft-rows ({rows}), got {acceptance:g}")


def ngram(batch: int, rows: int, acceptance: float, verify_us: float) -> Speculative:
    return Speculative(batch, rows, acceptance, verify_us, 0.0, NGRAM_HOST)


def with_draft_floor(batch: int, rows: int, acceptance: float, verify_us: float, floor_us: float, why: str, path: str):
    """A draft spec whose kernel does not lower yet: its step at its HBM floor (weights, state and
    caches it must read at the ring's measured rate), which no schedule beats. The figure is
    therefore optimistic on the drafter's part, and says so."""
    what = (
        f"the draft spec {path} at its HBM floor for {batch * rows} rows (OPTIMISTIC: no kernel schedule to "
        f"plan, {why})"
    )
    return Speculative(batch, rows, acceptance, verify_us, floor_us, what)


def with_draft_spec(batch: int, rows: int, acceptance: float, verify_us: float, draft_plan, path: str) -> Speculative:
    """A draft spec's step, planned at its block of B x R rows, as the drafter's time."""
    t = draft_plan.timing
    return Speculative(
        batch, rows, acceptance, verify_us, t.modeled_us, f"the draft spec {path} planned at {batch * rows} rows"
    )


def mtp_model(model: Model) -> Model:
    """The target's `mtp` head as a decode step the planner takes, so that its ops are priced by
    the same rules as the target's: its body (the embedding of the token, the projection of the
    normed pair, its transformer layer, up to the hidden state it returns) is the one layer, fed
    the target's hidden state `h` as a step input; the nodes making its logits (its norm, the
    shared output head) and the target's own sampling of them (the step's nodes reading its
    logits) are the epilogue. ValueError for a model without a head."""
    head = model.mtp
    if head is None:
        raise ValueError(f"{model.name} declares no `mtp` head")
    (h,), (hidden, logits) = head.params, head.results
    cut = 1 + next(i for i, n in enumerate(head.nodes) if any(v.name == hidden.name for v in n.outputs))
    body = Graph("mtp", head.params, head.nodes[:cut], (hidden,), head.span)
    out = Value(f"{hidden.name}_out", h.type, head.span)
    writes = tuple(dict.fromkeys(w for n in body.nodes for w in n.writes))
    stack = Node("layers", (Ref("input", h.name),), (), (out,), writes, head.span)

    def renamed(n: Node, old: Ref, new: Ref) -> Node:
        return dataclasses.replace(n, inputs=tuple(new if r == old else r for r in n.inputs))

    logit_nodes = tuple(renamed(n, hidden, Ref("value", out.name)) for n in head.nodes[cut:])
    sampled = [n for n in model.step.nodes if model.step.results[0] in n.inputs]
    sampling = tuple(renamed(n, model.step.results[0], logits) for n in sampled)
    results = (logits, *model.step.results[1:])
    step = Graph(model.step.name, (), (stack, *logit_nodes, *sampling), results, head.span)
    inputs = (*model.mtp_inputs, h, *(v for v in model.inputs if v.name not in {x.name for x in model.mtp_inputs}))
    return dataclasses.replace(
        model, name=f"{model.name}_mtp", kinds=(body,), schedule=("mtp",), step=step, inputs=inputs, mtp=None
    )


def with_mtp(batch: int, rows: int, acceptance: float, verify_us: float, head_plan) -> Speculative:
    """The target's `mtp` head as the drafter: R - 1 of its steps (planned at B rows, one per
    sequence) per verify step, one after the other, each with its own dispatch."""
    t, n = head_plan.timing, rows - 1
    what = f"the target's `mtp` head, {n} steps of {t.modeled_us:.1f} us (the planner at {batch} row(s))"
    top = sorted(head_plan.phases, key=lambda c: -(c.stream_us + c.compute_us + c.comm_us))[:3]
    parts = (
        f"each head step: dispatch {t.fixed_us:.1f} us, then its phases; the longest:",
        *(f"  {c.what}: {c.stream_us + c.compute_us + c.comm_us:.1f} us" for c in top),
    )
    return Speculative(batch, rows, acceptance, verify_us, n * t.modeled_us, what, draft_parts=parts)


def mtp_floor(batch: int, rows: int, acceptance: float, verify_us: float, floor_us: float, why: str) -> Speculative:
    """A head the kernel cannot lower: R - 1 steps at its HBM floor, OPTIMISTIC (as `with_draft_floor`)."""
    what = (
        f"the target's `mtp` head, {rows - 1} steps at its HBM floor of {floor_us:.1f} us for {batch} row(s) "
        f"(OPTIMISTIC: no kernel schedule to plan, `mkdsl check` of the head says: {why})"
    )
    return Speculative(batch, rows, acceptance, verify_us, (rows - 1) * floor_us, what)
