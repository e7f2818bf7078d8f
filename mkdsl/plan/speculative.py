"""The modeled speculative-decoding figure (`mkdsl plan --draft`, and plan.md's speculative row):
accepted tokens/s = B x A / (the verify step + the drafter's time + the accept step), per step
of B sequences each verifying R rows and accepting A tokens on average (A includes the target's
own token, so 1 <= A <= R). Every part is modeled:

- verify: the planner's step at B x R rows (the R rows of a sequence share the weight stream as
  batch rows do; the row-by-row causal attention among them is not priced separately), planned
  with `verify_rows=R`: an op whose state runs the rows in series (`OpDef.rows_in_series`, the
  recurrent rules: row r reads the state row r - 1 wrote to HBM) is charged its state stream after
  its compute (`series_us`, shown);
- drafter: a draft spec planned like any spec at its block of B x R rows; the n-gram drafter
  runs on the host, not on the device, counted as 0 (its host cost: NGRAM_HOST);
- accept: ACCEPT_US, an estimate (not measured): the verify step's R tokens per sequence copied
  to the host and compared there, which the next step waits for (the drafter needs them).
"""

from __future__ import annotations

from dataclasses import dataclass

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
