"""`mkdsl serve --draft`: speculative decoding behind the HTTP front, one request at a time.

The engine's one row runs a request's whole generation as `mkdsl run --draft` does
(mkdsl/run/speculative.py `run_decoder`: the prefill, then per verify step the drafter's R - 1
tokens, ONE R-row verify step of the target, the accept rule, the commit at the accepted
length), each step's accepted tokens streamed to the request as they come. The verify step
decodes one sequence (as `run --draft`), so requests take the row in turn; each starts from a
zeroed state and a drafter that has heard only its own prompt. Greedy requests get plain greedy
decoding's tokens exactly; sampled ones plain sampling's distribution (exact speculative
sampling, mkdsl/run/accept.py).

What a request accepted per verify step is kept on it (`Request.accepted`) for the response's
usage, and logged on standard error when it ends (a streamed response carries no usage).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from mkdsl.run.decode import Decoder
from mkdsl.run.drafters import Drafter
from mkdsl.run.engine import Engine, Request, Row


class _Left(Exception):
    """The request's client went away (or the server stops) mid-generation."""


class SpeculativeEngine(Engine):
    """An Engine of one row whose steps are speculative: `drafter()` makes a request's drafter
    (R = its `rows`), `name` says which it is (ngram, mtp, a draft spec's path)."""

    def __init__(self, decoder: Decoder, batch_axes: dict[str, int], drafter: Callable[[], Drafter], name: str):
        if decoder.batch != 1:
            raise ValueError(f"speculative serving decodes one sequence (batch 1), not {decoder.batch}")
        super().__init__(decoder, batch_axes)
        self.make_drafter, self.draft = drafter, name
        self.draft_rows = drafter().rows
        self.ahead = self.draft_rows  # a verify step writes up to R - 1 positions past its anchor

    def _prefill(self, new: list[tuple[int, Request]]) -> None:
        """Admitted: the request's whole generation, on the row."""
        ((i, r),) = new
        self.rows[i] = Row(r, len(r.prompt), 0)
        try:
            self._generate(r)
        finally:
            self.rows[i] = None

    def _generate(self, r: Request) -> None:
        from mkdsl.run.speculative import run_decoder

        d = self.decoder
        d.use_sampling(r.sampling)
        d.seed = r.seed
        d.zero_state()  # the last request's verify layout, or the first request's zeros

        def heard(tokens: list[int]) -> None:
            if r.cancelled.is_set() or self.stopped.is_set():
                raise _Left
            for t in tokens:
                if t in r.stop_ids:
                    r.finish = "stop"
                    return
                r.out.put(t)

        try:
            prompt, drafter = list(r.prompt), self.make_drafter()
            out, _, _ = run_decoder(d, drafter, prompt, r.max_tokens, r.stop_ids, heard, bucket=self.bucket)
            r.accepted[:] = [n for n, _ in out.steps]  # what each verify step accepted
            self._log(r)
        except _Left:
            self.left += 1
        finally:
            d.state = None  # run_decoder leaves it so too; the next request zeroes it
        r.out.put(None)

    def _log(self, r: Request) -> None:
        mean = sum(r.accepted) / len(r.accepted) if r.accepted else 0.0
        print(
            f"mkdsl serve: speculative ({self.draft}, {self.draft_rows} rows per verify step): {len(r.accepted)} "
            f"verify steps, mean accepted {mean:.2f} tokens/step",
            file=sys.stderr,
            flush=True,
        )


def usage(engine: Engine, r: Request) -> dict:
    """The speculative part of a response's usage (empty for a plain engine): OpenAI's
    `completion_tokens_details` (`accepted_prediction_tokens`: drafted tokens kept;
    `rejected_prediction_tokens`: drafted tokens the target refused), and `speculative`: the
    drafter, R, the verify steps and the mean tokens accepted per step (kept drafts + 1)."""
    if engine.draft is None:
        return {}
    steps = len(r.accepted)
    kept = sum(r.accepted) - steps
    rejected = steps * (engine.draft_rows - 1) - kept
    details = {"accepted_prediction_tokens": kept, "rejected_prediction_tokens": rejected}
    mean = sum(r.accepted) / steps if steps else 0.0
    spec = {"drafter": engine.draft, "rows": engine.draft_rows, "verify_steps": steps, "mean_accepted_per_step": mean}
    return {"completion_tokens_details": details, "speculative": spec}
