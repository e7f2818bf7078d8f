"""Kimi K3's DSpark block drafter as a spec (specs/kimi_k3_dspark.mk) and its host drafter
(mkdsl/run/spec_drafters.py): the `context ... from layers` declaration, pairing with Kimi K3,
and drafting through the reference with the context fed in steps."""

from __future__ import annotations

import numpy as np
import pytest

import mkdsl
from mkdsl.lang.diagnostics import SpecError
from mkdsl.run.spec_drafters import DraftSpecError, SpecDrafter, make_drafter, random_drafter_weights

DSPARK = "specs/kimi_k3_dspark.mk"


def test_full_size_declares_the_published_drafter():
    """The sizes the checkpoint's config gives, and the five target layers of its context."""
    m = mkdsl.load(DSPARK).model
    c = m.const
    assert (len(m.schedule), c["H"], c["V"], c["NH"], c["NKV"], c["D"], c["F"]) == (5, 7168, 163840, 96, 16, 64, 14336)
    assert (c["W"], c["MR"], c["MASK"], c["EPS"], c["THETA"]) == (2048, 256, 163837, 1e-5, 10000.0)
    assert m.context == ("context", "context_pos", (24, 48, 72, 88, 92))
    assert m.tensor("context").type.shape[1] == 5 * 7168
    assert m.tensor("fc").type.shape == (5 * 7168, 7168)


def test_mini_pairs_with_kimi_mini():
    """Same vocabulary and width as Kimi K3's mini; its context layers exist there."""
    kimi = mkdsl.load("specs/kimi_k3.mk", profile="mini").model
    draft = mkdsl.load(DSPARK, profile="mini").model
    assert (draft.const["V"], draft.const["H"]) == (kimi.const["V"], kimi.const["H"])
    assert all(lay < len(kimi.schedule) for lay in draft.context[2])


@pytest.mark.parametrize(
    "line, message",
    [
        ("context context at context_pos from layers 1, 1", "name a layer twice"),
        ("context nothing at context_pos from layers 1", "not a declared state tensor"),
        ("context context at slot_pos from layers 1, 2", "must be a state i32[B]"),
        ("context context at context_pos from layers 1, 2, 3", "do not hold 3 layers"),
    ],
)
def test_context_declaration_errors(tmp_path, line, message):
    text = open(DSPARK, encoding="utf-8").read()
    text = text.replace("context context at context_pos from layers C1, C2, C3, C4, C5", line)
    text = text.replace("const NC    = 5", "const NC    = 2")
    path = tmp_path / "bad.mk"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as e:
        mkdsl.load(path, profile="mini")
    assert message in str(e.value)


@pytest.mark.parametrize("profile", [["--profile", "mini"], []])
def test_check_says_what_the_kernel_cannot_lower_yet(profile, capsys):
    """`check` names each missing piece at its line (exit 1) instead of failing inside the planner;
    at full size the sharding rules of both drafter ops hold (no sharding error)."""
    from mkdsl.cli import main

    assert main(["check", DSPARK, *profile]) == 1
    err = capsys.readouterr().err
    for what in (
        "op `block_attention` has no TPU lowering yet: it needs",
        "op `markov_argmax` has no TPU lowering yet",
    ):
        assert what in err
    assert "reads the state `context` as its `x`" in err
    assert "sharding" not in err and "internal error" not in err


def _context(rng, n, layers, width):
    return rng.standard_normal((n, layers, width)).astype(np.float32)


def test_drafts_from_context_fed_in_steps():
    """A prompt longer than the block goes in several steps: the block's rows are causal and the
    Markov bias reads left to right, so a 4-row drafter's 3 drafts equal the first 3 of a 16-row
    drafter that takes the whole prompt in one step. Then accepted rows move the context on."""
    target = mkdsl.load("specs/kimi_k3.mk", profile="mini")
    spec = mkdsl.load(DSPARK, profile="mini")
    weights = random_drafter_weights(spec, seed=3)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 1000, 13)]
    ctx = _context(rng, 13, 5, 256)
    small, big = SpecDrafter(spec, weights, 4, target.model), SpecDrafter(spec, weights, 16, target.model)
    for d in (small, big):
        d.start(prompt, ctx)
    got = small.propose(7, 13)
    want = big.propose(7, 13)
    assert len(got) == 3 and len(want) == 15
    assert got == want[:3]
    assert all(0 <= t < 1024 for t in want)
    # the target kept 2 drafts: 3 rows of context (the anchor and the 2), the next anchor at 16
    more = _context(rng, 3, 5, 256)
    for d in (small, big):
        d.accept([got[0], got[1], 5], more)
    again = small.propose(5, 16)
    assert again == big.propose(5, 16)[:3]
    # the drafts read the context: another prompt context changes the slot caches and the logits
    other = SpecDrafter(spec, weights, 4, target.model)
    other.start(prompt, _context(rng, 13, 5, 256))
    other.propose(7, 13)
    assert not np.array_equal(np.asarray(other.state["k_cache"]), np.asarray(small.state["k_cache"]))


def test_make_drafter_checks_pairing_first():
    target = mkdsl.load("specs/qwen3_30b_a3b.mk", profile="mini")
    with pytest.raises(DraftSpecError, match="vocabulary|wide|layers"):
        make_drafter(DSPARK, target, rows=4, profile="mini")
    d = make_drafter(DSPARK, mkdsl.load("specs/kimi_k3.mk", profile="mini"), rows=4)
    assert (d.rows, d.context_layers) == (4, (2, 3, 5, 6, 7))
