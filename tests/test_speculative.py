"""Speculative decoding on the host (mkdsl/run/accept.py, drafters.py, speculative.py,
verify_rows.py): greedy speculation is plain greedy decoding token for token with ONE R-row
verify step per verify step, speculative sampling keeps plain sampling's distribution (a
chi-square test, and the same test failing on a broken accept rule), and the n-gram drafter
drafts what the sequence repeats."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import mkdsl
from mkdsl.run import accept as accept_rules
from mkdsl.run.accept import Accepted, SeededCoins, target_probs
from mkdsl.run.drafters import DrafterUnavailable, NgramDrafter, check_draft
from mkdsl.run.sampling import Sampling, sample_tokens
from mkdsl.run.speculative import speculate

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ greedy: exact, tiny spec


class ScriptedDrafter:
    """Drafts from a known continuation, made wrong on purpose: at step s it proposes s % R right
    tokens and then a wrong one (each accept length 0..R-1 in turn)."""

    context_layers = ()
    draft_probs = None

    def __init__(self, rows: int, truth: list[int], prompt_len: int, vocab: int):
        self.rows, self.truth, self.prompt_len, self.vocab, self.step = rows, truth, prompt_len, vocab, 0

    def start(self, prompt_tokens, context):
        assert list(prompt_tokens) and context is None

    def propose(self, anchor_token, position):
        i = position - self.prompt_len  # the anchor is truth[i]
        assert anchor_token == self.truth[i], "the loop's anchor is not the plain sequence's token"
        right = self.step % self.rows
        self.step += 1
        out = [self.truth[min(i + 1 + j, len(self.truth) - 1)] for j in range(self.rows - 1)]
        if right < self.rows - 1:
            out[right] = (out[right] + 1) % self.vocab  # wrong here: right drafts kept at most
        return out

    def accept(self, tokens, context):
        assert context is None and tokens


def test_greedy_speculation_is_plain_greedy_token_for_token():
    """Tiny spec, random weights, the reference step (jitted) as target: 32 tokens plain, then the
    same prompt with R = 4 and drafts wrong at a chosen place, so that every accept length 0..3
    occurs; the tokens must be identical, and the mean accepted length as the script says."""
    spec = mkdsl.load(ROOT / "specs" / "tiny.mk")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=8, seed=3)
    prompt, n, rows = [5, 17, 200, 9, 33, 5, 17], 32, 4
    plain = mkdsl.generate(spec, weights, prompt, max_tokens=n)
    assert len(plain.tokens) == n and set(plain.accept_lengths()) == {0}
    drafter = ScriptedDrafter(rows, plain.tokens, len(prompt), 256)
    spec_run = mkdsl.generate(spec, weights, prompt, max_tokens=n, draft=drafter)
    assert spec_run.tokens == plain.tokens
    lengths = spec_run.accept_lengths()
    assert set(lengths) == set(range(rows)), lengths
    # the script keeps s % R drafts at step s (the last step may be cut by max_tokens)
    assert lengths[:-1] == [s % rows for s in range(len(lengths) - 1)]
    assert len(spec_run.steps) < len(plain.steps)
    # one call of the R-row step per verify step (a row-by-row emulation would call the one-row
    # step once per row read: 1 + kept drafts per step, more than the steps here)
    assert spec_run.calls == len(spec_run.steps) and plain.calls == len(plain.steps)
    assert sum(n for n, _ in spec_run.steps) > spec_run.calls


def test_greedy_accept_rule_keeps_the_matching_prefix_and_adds_the_targets_token():
    class Fixed:
        def __init__(self, tokens):
            self.tokens = tokens

        def next_token(self, r):
            return self.tokens[r]

        def logits(self, r):
            raise AssertionError("greedy reads no logits")

    assert accept_rules.accept_greedy(Fixed([4, 5, 6, 7]), [4, 5, 9]) == Accepted(2, [4, 5, 6])
    assert accept_rules.accept_greedy(Fixed([4, 5, 6, 7]), [4, 5, 6]) == Accepted(3, [4, 5, 6, 7])
    assert accept_rules.accept_greedy(Fixed([1, 5, 6, 7]), [4, 5, 6]) == Accepted(0, [1])


# ------------------------------------------------------------------ sampling: the distribution

V, ANCHOR, DRAFTS, N, ALPHA = 4, 0, [2, 1], 1000, 1e-4
SAMPLING = Sampling(temperature=0.9, top_k=3, top_p=1.0)


class BigramTarget:
    """A target whose logits after a token depend on that token only (a bigram table): row r's
    logits are TABLE[token r]."""

    def __init__(self, table):
        self.table = table

    def verify(self, tokens, position):
        table = self.table

        class Rows:
            def next_token(self, r):
                return int(np.argmax(table[tokens[r]]))

            def logits(self, r):
                return table[tokens[r]]

            def commit(self, kept):
                assert 1 <= kept <= len(tokens)

        return Rows()


class FixedDrafter:
    """Always drafts DRAFTS (deterministic: q one-hot)."""

    rows, context_layers, draft_probs = 3, (), None

    def start(self, prompt_tokens, context):
        pass

    def propose(self, anchor_token, position):
        return list(DRAFTS)

    def accept(self, tokens, context):
        pass


class SampledDrafter(FixedDrafter):
    """Drafts each token from its own bigram law q (drafter-side randomness seeded per run)."""

    def __init__(self, q_table, seed):
        self.q, self.rng = q_table, np.random.default_rng([seed, 77])

    def propose(self, anchor_token, position):
        out, probs, prev = [], [], anchor_token
        for _ in range(self.rows - 1):
            q = self.q[prev]
            prev = int(self.rng.choice(V, p=q))
            out.append(prev)
            probs.append(q)
        self.draft_probs = np.stack(probs)
        return out


def _tables():
    rng = np.random.default_rng(11)
    logits = (2.0 * rng.standard_normal((V, V))).astype(np.float32)
    q_logits = (2.0 * rng.standard_normal((V, V))).astype(np.float64)
    q = np.exp(q_logits) / np.exp(q_logits).sum(axis=1, keepdims=True)
    return logits, q


def _law(p, resample, drafts=DRAFTS):
    """The exact law of the first two emitted tokens after ANCHOR with the deterministic DRAFTS,
    for a rule keeping draft d with probability p(d) and else drawing from resample(p_row, d)."""
    d1, d2 = drafts
    law = np.zeros((V, V))
    keep1 = p[ANCHOR][d1]
    law[d1] += keep1 * (p[d1][d2] * np.eye(V)[d2] + (1 - p[d1][d2]) * resample(p[d1], d2))
    first = resample(p[ANCHOR], d1)
    for x1 in range(V):  # rejected: x1 drawn, then a new step from anchor x1 drafts d1 again
        second = p[x1][d1] * np.eye(V)[d1] + (1 - p[x1][d1]) * resample(p[x1], d1)
        law[x1] += (1 - keep1) * first[x1] * second
    return law


def _removed(p, d):
    r = p.copy()
    r[d] = 0.0
    return r / r.sum()


def _cells(law, expected):
    """`law` over the cells of `expected` (N x the plain law): each reachable cell expecting at
    least 5 counts on its own, the others pooled into one (so Pearson's statistic is close to
    its chi-square law)."""
    big = expected >= 5
    small = (expected > 0) & ~big
    return np.append(law[big], law[small].sum()) if small.any() else law[big]


def _chi2(counts, expected):
    """Pearson's statistic and df over `_cells`; a count in an impossible cell: inf."""
    if (counts[expected == 0] > 0).any():
        return np.inf, 0
    c, e = _cells(counts, expected), _cells(expected, expected)
    return float(((c - e) ** 2 / e).sum()), len(e) - 1


def _run(drafter_for, rule=None):
    """Counts [V, V] of the first two tokens after ANCHOR over N seeded speculative runs."""
    logits, _ = _tables()
    counts = np.zeros((V, V))
    target = BigramTarget(logits)
    for seed in range(N):
        out = speculate(target, drafter_for(seed), [7, ANCHOR], ANCHOR, 3, sampling=SAMPLING, seed=seed)
        counts[out.tokens[1], out.tokens[2]] += 1
    return counts


def test_speculative_sampling_keeps_plain_samplings_distribution(monkeypatch):
    """The first two tokens after an anchor under speculative sampling (R = 3, a fixed drafter
    and a sampling one) against their law under plain sampling, P(x1, x2) = p'_a(x1) p'_x1(x2),
    p' = softmax(mask(logits / T)) (top_k = 3 of V = 4: one token of each row is impossible, and
    must never appear).

    Test: Pearson's chi-square over the k cells of `_cells` (reachable cells expecting >= 5
    counts, the rest pooled: 9 cells here, df = 8), rejecting above the (1 - ALPHA) quantile,
    ALPHA = 1e-4: a correct rule fails one seed set in 10^4 (the seeds are fixed, so the outcome
    is too). Sample size: against the alternative of a rule that on rejection draws from p'
    itself (the rejected draft not removed: the classic bug), the statistic is noncentral
    chi-square with lambda = N sum (P_alt - P)^2 / P over the same cells; N = 1000 gives power
    >= 0.99 (asserted below from the exact laws; lambda ~ 300 against a critical 31.8). Always
    accepting (the test of the test) moves far more mass and must fail too."""
    from scipy.stats import chi2, ncx2

    logits, q = _tables()
    p = target_probs(logits, SAMPLING)
    plain = p[ANCHOR][:, None] * p
    assert np.allclose(_law(p, _removed), plain, atol=1e-12)  # the rule's exact law is plain's
    alt, expected = _law(p, lambda row, d: row), N * plain
    lam, df = _chi2(N * alt, expected)  # Pearson's statistic at the expected counts of the alternative
    crit = chi2.ppf(1 - ALPHA, df)
    assert df == 8 and ncx2.sf(crit, df, lam) >= 0.99, (lam, crit)

    # plain sampling's own draw (the module's Gumbel-max) follows p': the law is the right one
    draws = np.asarray(sample_tokens(np.tile(logits[ANCHOR], (N, 1)), np.arange(N), 5, SAMPLING))
    stat, df1 = _chi2(np.bincount(draws, minlength=V).astype(float), N * p[ANCHOR])
    assert stat < chi2.ppf(1 - ALPHA, df1), stat

    for drafter_for in (lambda seed: FixedDrafter(), lambda seed: SampledDrafter(q, seed)):
        stat, df2 = _chi2(_run(drafter_for), expected)
        assert df2 == df and stat < crit, (stat, crit)

    # the test of the test: always accepting the drafts must be rejected
    def always(rows, drafts, sampling, coins, draft_probs=None):
        return Accepted(len(drafts), [*drafts, int(np.argmax(rows.logits(len(drafts))))])

    monkeypatch.setattr("mkdsl.run.speculative.accept_sampled", always)
    stat, _ = _chi2(_run(lambda seed: FixedDrafter()), expected)
    assert stat > crit, stat


def test_seeded_coins_depend_on_seed_and_position_only():
    a, b = SeededCoins(3, 10), SeededCoins(3, 10)
    assert a.u() == b.u() and np.array_equal(a.gumbel(5), b.gumbel(5))
    assert SeededCoins(3, 11).u() != SeededCoins(3, 10).u() != SeededCoins(4, 10).u()


# ------------------------------------------------------------------ the n-gram drafter


def test_ngram_drafter_copies_what_followed_the_longest_earlier_suffix():
    d = NgramDrafter(rows=4, max_n=3)
    d.start([1, 2, 3, 4, 9, 2, 3], None)
    assert d.propose(4, 7) == [9, 2, 3]  # "2 3 4" occurred at 1..3, followed by 9 2 3
    d.accept([9, 8], None)  # kept 9, target said 8: the sequence is now ... 4 9, anchor 8
    assert d.seq == [1, 2, 3, 4, 9, 2, 3, 4, 9]
    assert d.propose(8, 9) == [8, 8, 8]  # 8 never seen: the anchor repeated
    d.accept([5], None)
    assert d.propose(2, 11)[:1] == [3]  # "2" -> its latest earlier occurrence is followed by 3


def test_ngram_drafter_continues_a_repeating_pattern_past_the_end():
    d = NgramDrafter(rows=8)
    d.start([7, 1, 2, 1, 2], None)
    assert d.propose(1, 5) == [2, 1, 2, 1, 2, 1, 2]  # an LZ77 copy runs into itself
    with pytest.raises(ValueError):
        NgramDrafter(rows=0)


def test_ngram_drafter_drives_the_loop_to_plain_greedy_on_a_repeating_target():
    """A target that counts 0, 1, 2, 0, 1, 2 ...: the n-gram drafter finds the cycle, so steps keep
    all three drafts once it has been seen, and the output is what the target says."""

    class Cycle:
        def verify(self, tokens, position):
            class Rows:
                def next_token(self, r):
                    return (tokens[r] + 1) % 3

                def logits(self, r):
                    raise AssertionError

                def commit(self, kept):
                    pass

            return Rows()

    out = speculate(Cycle(), NgramDrafter(4), [0, 1, 2, 0], 1, 20, sampling=Sampling())
    assert out.tokens == [(1 + i) % 3 for i in range(20)]
    assert out.accept_lengths()[1:-1] == [3] * (len(out.steps) - 2) and out.mean_accepted > 3


def test_drafter_names_are_checked():
    for name in ("ngram", "mtp", "specs/kimi_k3_dspark.mk"):
        check_draft(name)
    for name in ("bogus", "specs/tiny.txt"):
        with pytest.raises(DrafterUnavailable, match="expected one of ngram, mtp or a draft spec"):
            check_draft(name)


def test_summary_sets_the_speculative_figures_beside_the_plain_ones():
    """Mean accepted tokens per verify step (all steps), then, without the first (trace and
    compile) step: ms per step, accepted tokens/s, and the tokens/s of one token per step."""
    from mkdsl.run.speculative import Speculation

    out = Speculation([1] * 6, 4, [(1, 9.0), (3, 0.5), (2, 0.5)], calls=3).summary("ngram")
    assert "3 verify steps; 3 target calls, mean accepted 2.00 tokens/step" in out
    assert "500.0 ms/step, 5.00 accepted tokens/s (2 timed steps)" in out
    assert "2.00 tokens/s if each step kept only the target's token (drafts: x2.50)" in out


def test_stop_token_ends_the_generation_and_is_kept():
    out = speculate(_CountTarget(), NgramDrafter(3), [1, 2, 3], 4, 30, sampling=Sampling(), stop=frozenset({9}))
    assert out.tokens == [4, 5, 6, 7, 8, 9]


class _CountTarget:
    def verify(self, tokens, position):
        class Rows:
            def next_token(self, r):
                return tokens[r] + 1

            def logits(self, r):
                raise AssertionError

            def commit(self, kept):
                pass

        return Rows()


def test_all_cells_reachable_by_plain_are_reachable_by_the_rule():
    logits, _ = _tables()
    p = target_probs(logits, SAMPLING)
    assert ((p > 0).sum(axis=1) == 3).all()  # top_k = 3 of 4: the mask is in force
    assert list(itertools.chain(*(np.flatnonzero(r == 0) for r in p)))  # impossible tokens exist
