"""Model drafters wired into speculative decoding (`mkdsl.generate`, `mkdsl run --draft`): an MTP
head declared in the target spec (tests/data/tiny_mtp.mk: tiny with DeepSeek-V3's head) and a
draft spec reading target hidden states (tests/data/tiny_draft.mk: DSpark's drafter at tiny's
sizes, context from tiny's layers 0 and 1). Random weights, the reference target (fast).

Greedy speculative decoding with either drafter gives plain greedy decoding's tokens exactly, in
one R-row verify step per verify step. The hidden states the drafter hears are those of the
accepted rows only: each row's equals the prefill's hidden state of the final sequence at its
position, within the verify step's rounding against the prefill's (both run each op's prefill
rule, over other row groupings: f32 sums in another order, which can flip a bf16 rounding of a
matmul input; bounded, as tests/test_spec_verify.py argues, by (l + 1) x STATE_RTOL of the
vector's largest |value| after layer l). A row from a rejected draft, or one missing, is off by
O(1), and the count of rows is checked exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mkdsl
from mkdsl import cli
from mkdsl.api import make_drafter
from mkdsl.run.spec_drafters import DraftSpecError, MtpDrafter, SpecDrafter
from mkdsl.verify.kernel import STATE_RTOL

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny.mk")
TINY_MTP = str(ROOT / "tests" / "data" / "tiny_mtp.mk")
TINY_DRAFT = str(ROOT / "tests" / "data" / "tiny_draft.mk")
PROMPT = [5, 17, 200, 9, 33, 5, 17, 200, 9]


class Heard:
    """A drafter wrapper recording the hidden states it is given (prompt, then per accept)."""

    def __init__(self, inner):
        self.inner, self.rows, self.context_layers, self.draft_probs = inner, inner.rows, inner.context_layers, None
        self.contexts: list[np.ndarray] = []
        self.accepted: list[int] = []

    def start(self, prompt_tokens, context):
        self.contexts.append(np.asarray(context))
        self.inner.start(prompt_tokens, context)

    def propose(self, anchor_token, position):
        return self.inner.propose(anchor_token, position)

    def accept(self, tokens, context):
        assert np.asarray(context).shape[0] == len(tokens), "one hidden state per accepted row"
        self.contexts.append(np.asarray(context))
        self.accepted += list(tokens)
        self.inner.accept(tokens, context)


def _check_heard(spec, weights, heard: Heard, tokens: list[int]) -> None:
    """The recorded hidden states against the prefill's over the sequence they belong to."""
    got = np.concatenate(heard.contexts)  # [T, len(layers), H], T = prompt + accepted rows
    seq = PROMPT + tokens[: got.shape[0] - len(PROMPT)]
    assert got.shape[0] == len(PROMPT) + len(heard.accepted)
    layers = tuple(heard.context_layers)
    from mkdsl.run.sampling import Sampling
    from mkdsl.run.speculative import reference_fns, zero_state

    prefill = reference_fns(spec.model, Sampling(), layers)[0]
    *_, want = prefill(weights, zero_state(spec.model, 64), np.asarray([seq], np.int32))
    want = np.asarray(want)[0]
    assert want.shape == got.shape and not np.isnan(got).any()
    for i, layer in enumerate(layers):
        scale = np.abs(want[:, i]).max(axis=-1, keepdims=True)
        assert (np.abs(got[:, i] - want[:, i]) <= (layer + 1) * STATE_RTOL * scale).all(), layer


def _plain_then_draft(path, draft, rows, n=20, **kw):
    spec = mkdsl.load(path)
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=8, seed=3)
    plain = mkdsl.generate(spec, weights, PROMPT, max_tokens=n)
    return spec, weights, plain, draft(spec, weights)


def test_mtp_drafter_greedy_speculation_is_plain_greedy():
    """tiny_mtp's own head drafts R - 1 = 2 tokens a step from the target's last hidden state."""
    spec, weights, plain, drafter = _plain_then_draft(
        TINY_MTP, lambda s, w: Heard(make_drafter("mtp", s, w, rows=3, seq_len=64)), 3
    )
    assert isinstance(drafter.inner, MtpDrafter) and drafter.context_layers == (1,)
    out = mkdsl.generate(spec, weights, PROMPT, max_tokens=20, draft=drafter, seq_len=64)
    assert out.tokens == plain.tokens
    assert out.calls == len(out.steps) < len(plain.steps) + 1
    _check_heard(spec, weights, drafter, out.tokens)


def test_draft_spec_greedy_speculation_is_plain_greedy():
    """tiny_draft (random weights) drafts blocks of R - 1 = 3 from tiny's layers 0 and 1."""
    spec, weights, plain, drafter = _plain_then_draft(
        TINY, lambda s, w: Heard(make_drafter(TINY_DRAFT, s, rows=4, seed=1)), 4
    )
    assert isinstance(drafter.inner, SpecDrafter) and drafter.context_layers == (0, 1)
    out = mkdsl.generate(spec, weights, PROMPT, max_tokens=20, draft=drafter, seq_len=64)
    assert out.tokens == plain.tokens and out.calls == len(out.steps)
    _check_heard(spec, weights, drafter, out.tokens)


def test_generate_by_name_pairs_the_drafter_with_the_target():
    tiny = mkdsl.load(TINY)
    weights, _ = mkdsl.random_inputs(tiny, batch=1, seq_len=8, seed=3)
    with pytest.raises(DraftSpecError, match="declares no `mtp` head"):
        mkdsl.generate(tiny, weights, PROMPT, max_tokens=4, draft="mtp")
    mtp = mkdsl.load(TINY_MTP)  # a target of the same vocabulary and width, but whose layers 0, 1 ...
    out = mkdsl.generate(mtp, mkdsl.random_inputs(mtp, 1, 8, seed=3)[0], PROMPT, max_tokens=3, draft=TINY_DRAFT)
    assert len(out.tokens) == 3  # ... are there: it pairs


def _write(tmp_path, text: str, old: str, new: str) -> str:
    assert old in text
    path = tmp_path / "draft.mk"
    path.write_text(text.replace(old, new), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("const C2    = 1", "const C2    = 5", "reads layers [5] of tiny, which has 2"),
        ("const V     = 256", "const V     = 512", "vocabulary 512 is not tiny's 256"),
        ("const MASK  = 255", "const MASK  = 255\nconst oops = ", "not a valid spec"),
    ],
)
def test_run_draft_spec_that_does_not_pair_is_a_usage_error_before_loading(tmp_path, capsys, old, new, message):
    draft = _write(tmp_path, Path(TINY_DRAFT).read_text(encoding="utf-8"), old, new)
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"not read: the pairing is checked first")
    code = cli.main(["run", TINY, "--weights", str(weights), "--prompt", "x", "--draft", draft])
    assert code == 2
    assert message in capsys.readouterr().err


def test_run_draft_mtp_without_a_head_is_a_usage_error_before_loading(tmp_path, capsys):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"not read")
    assert cli.main(["run", TINY, "--weights", str(weights), "--prompt", "x", "--draft", "mtp"]) == 2
    assert "declares no `mtp` head" in capsys.readouterr().err
    argv = ["run", TINY, "--weights", str(weights), "--prompt", "x", "--draft", "mtp", "--draft-weights", "/nope"]
    assert cli.main(argv) == 2
    assert "--draft-weights /nope: no such file" in capsys.readouterr().err


def test_run_draft_spec_prints_the_plain_text(tmp_path, monkeypatch, capsys):
    """`mkdsl run` of Llama 3 mini (a synthetic checkpoint, as tests/test_run.py writes it) with
    `--draft tests/data/tiny_draft.mk` (its `mini` profile, the target's: random drafter weights)
    and --decode reference: the plain run's text, one target call per verify step."""
    import re

    from checkpoint_writers import hf_tensors
    from safetensors.numpy import save_file
    from test_run import write_tokenizer

    monkeypatch.setenv("MKDSL_CACHE", str(tmp_path / "cache"))
    llama = mkdsl.load(ROOT / "specs" / "llama3_8b.mk", "mini")
    weights, _ = mkdsl.random_inputs(llama, batch=1, seq_len=8, seed=5)
    save_file(hf_tensors(weights, 2), str(tmp_path / "model.safetensors"))
    write_tokenizer(tmp_path, llama.model.const["V"])
    argv = ["run", str(ROOT / "specs" / "llama3_8b.mk"), "-p", "mini", "--weights", str(tmp_path)]
    argv += ["--prompt", "the hello the hello", "--max-tokens", "10", "--temperature", "0", "--decode", "reference"]
    assert cli.main(argv) == 0
    plain, _ = capsys.readouterr()
    assert cli.main([*argv, "--draft", TINY_DRAFT, "--draft-rows", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and len(out) > len("the hello the hello\n"), (out, plain)
    assert "random drafter weights" in err
    m = re.search(r"(\d+) verify steps; (\d+) target calls, mean accepted ([0-9.]+) tokens/step", err)
    assert m and m[1] == m[2], err


def test_run_draft_weights_that_do_not_fit_are_an_error_before_loading(tmp_path, capsys):
    """--draft-weights is planned against the draft spec before the target loads: tiny_draft
    declares no checkpoint mapping, so a safetensors file is refused (exit 1), the target's
    weights (which do not exist) never looked at."""
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "w.safetensors"))
    argv = ["run", TINY, "--weights", "/nonexistent", "--prompt", "x", "--draft", TINY_DRAFT]
    assert cli.main([*argv, "--draft-weights", str(tmp_path / "w.safetensors")]) == 1
    assert "tiny_draft has no `checkpoint hf` section" in capsys.readouterr().err
