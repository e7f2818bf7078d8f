"""`mkdsl run --draft` and `mkdsl plan --draft`: argument errors before any loading, the modeled
speculative figure and its parts, and (slow) the real SmolLM2 run with the n-gram drafter
printing exactly the plain run's text."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from xla_cpu import optimised

from mkdsl import cli
from mkdsl.api import load
from mkdsl.plan import make_plan
from mkdsl.plan.speculative import ACCEPT_US

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny.mk")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--draft", "mtp"], "tiny (" + TINY + ") declares no `mtp` head"),
        (["--draft", "specs/kimi_k3_dspark.mk"], "reads layers [24, 48, 72, 88, 92] of tiny, which has 2"),
        (["--draft", "bogus"], "expected one of ngram, mtp"),
        (["--draft", "ngram", "--draft-weights", "x"], "the n-gram drafter has no weights"),
        (["--draft", "ngram", "--draft-rows", "1"], "--draft-rows must be in 2 .. 16"),
        (["--draft", "ngram", "--batch", "2"], "one sequence"),
        (["--draft-rows", "4"], "need --draft"),
    ],
)
def test_run_draft_arguments_are_usage_errors_before_loading(capsys, extra, message):
    # the weights do not exist: a check after loading would say so instead
    code = cli.main(["run", TINY, "--weights", "/nonexistent.gguf", "--prompt", "x", *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_emulation_notice_of_a_draft_run_says_its_verify_rows_and_bounds_the_time():
    from mkdsl.run.prompts import emulation_notice

    plain, draft = emulation_notice(2**26, 16, 1), emulation_notice(2**26, 16, 1, verify_rows=4)
    assert "(1 row;" in plain and "at most" not in plain
    assert "(one sequence, 4 rows a verify step;" in draft
    assert re.search(r"[\d.]+ s per step, at most \d+ s for 16 tokens", draft), draft


def _committed(path: str):
    """The static costs `mkdsl plan` reads with no flag: the spec's committed specs/costs file."""
    from mkdsl.plan.static_costs import default_costs

    return default_costs(path, None)[0]


def _parts(out: str) -> dict[str, float]:
    m = re.search(
        r"= (?:[0-9]+ x )?([0-9.]+) / \(verify ([0-9.]+) us \+ drafter ([0-9.]+) us \+ accept ([0-9.]+) us\) = "
        r"([0-9.]+) accepted",
        out,
    )
    assert m, out
    return dict(zip(("a", "verify", "draft", "accept", "tps"), map(float, m.groups())))


def test_plan_draft_ngram_prints_the_figure_and_its_parts(capsys):
    assert cli.main(["plan", TINY, "--draft", "ngram", "--draft-rows", "4", "--acceptance", "2.5"]) == 0
    out = capsys.readouterr().out
    p = _parts(out)
    spec, static = load(TINY), _committed(TINY)
    wide = make_plan(spec.local, batch=spec.model.dims[0].high, static=static)
    verify = make_plan(spec.local, batch=4, ring_depth=wide.ring_depth, static=static).timing.modeled_us  # B x R = 4
    assert p["a"] == 2.5 and p["verify"] == pytest.approx(verify, abs=0.05)  # printed .1f
    assert p["draft"] == 0 and p["accept"] == ACCEPT_US and "n-gram lookup on the host" in out
    assert p["tps"] == pytest.approx(2.5e6 / (p["verify"] + p["accept"]), rel=1e-3)  # .1f of figures > 100


def test_plan_draft_spec_is_planned_at_its_block_of_rows(capsys):
    """A draft spec (tiny itself as a stand-in until the drafter specs land): its step at B x R
    rows is the drafter's time."""
    assert cli.main(["plan", TINY, "--batch", "2", "--draft", TINY, "--draft-rows", "4", "--acceptance", "3"]) == 0
    out = capsys.readouterr().out
    p = _parts(out)
    assert "= 2 x 3 / (verify" in out
    spec = load(TINY)
    assert p["draft"] == pytest.approx(
        make_plan(spec.local, batch=8, static=_committed(TINY)).timing.modeled_us, abs=0.05
    )
    assert p["tps"] == pytest.approx(2 * 3e6 / (p["verify"] + p["draft"] + p["accept"]), rel=1e-3)


def test_kimi_k3_speculative_figure_beside_the_public_ones(capsys):
    """Kimi K3 at the public setting (one sequence, R = 8, A = 6, context 1152, 32 cores) with its
    DSpark drafter, specs/kimi_k3_dspark.mk, planned (its kernel lowers: not the OPTIMISTIC HBM
    floor). Every part is printed, labelled modeled, beside the public 709 and 452."""
    kimi, stand_in = str(ROOT / "specs" / "kimi_k3.mk"), str(ROOT / "specs" / "kimi_k3_dspark.mk")
    argv = ["plan", kimi, "--batch", "1", "--context", "1152", "--draft", stand_in, "--draft-rows", "8"]
    assert cli.main([*argv, "--acceptance", "6"]) == 0
    out = capsys.readouterr().out
    p = _parts(out)
    spec, draft, static = load(kimi), load(stand_in), _committed(kimi)
    wide = make_plan(spec.local, batch=spec.model.dims[0].high, context=1152, static=static)
    verify = make_plan(  # the verify step: its recurrent state's 8 rows in series (OpDef.rows_in_series)
        spec.local, batch=8, context=1152, ring_depth=wide.ring_depth, static=static, verify_rows=8
    ).timing.modeled_us
    assert p["verify"] == pytest.approx(verify, abs=0.05)  # printed .1f
    drafted = make_plan(draft.local, batch=8, context=1152, static=_committed(stand_in)).timing.modeled_us
    assert p["draft"] == pytest.approx(drafted, abs=0.05)
    assert "planned at 8 rows" in out and "OPTIMISTIC" not in out
    assert p["tps"] == pytest.approx(6e6 / (p["verify"] + p["draft"] + p["accept"]), rel=1e-3)
    assert "speculative decoding (modeled)" in out and "accept: 20.0 us (estimate, not measured" in out
    assert "public, measured (not mkdsl): 709 accepted tokens/s" in out
    assert "public, measured (not mkdsl): 452 tokens/s on 16 GB200 GPUs" in out


def test_a_draft_spec_the_kernel_cannot_lower_is_priced_at_its_floor(tmp_path, capsys):
    """A draft spec `check` refuses (here: an embedding of the positions) has no planned step: its
    HBM floor stands in, labelled OPTIMISTIC, with the first diagnostic as the reason."""
    text = Path(TINY).read_text(encoding="utf-8")
    old = "  return x + linear(swiglu"
    assert old in text
    draft = tmp_path / "draft.mk"
    draft.write_text(text.replace(old, "  x = x + embedding(pos, embed)\n" + old, 1), encoding="utf-8")
    argv = ["plan", TINY, "--draft", str(draft), "--draft-rows", "4", "--acceptance", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "at its HBM floor for 4 rows (OPTIMISTIC" in out and "not by the positions" in out


def test_plan_draft_mtp_plans_the_target_s_head_r_minus_1_times(capsys):
    """DeepSeek-V3's `mtp` head (specs/deepseek_v3.mk, full size) as the drafter: one head step
    planned at --batch rows by the target's own cost rules (its body a layer, its logits and the
    target's sampling the epilogue), charged R - 1 = 7 times per verify step, with its parts."""
    from mkdsl.plan.speculative import mtp_model
    from mkdsl.spmd.shard import shard

    dsv3 = str(ROOT / "specs" / "deepseek_v3.mk")
    argv = ["plan", dsv3, "--batch", "1", "--context", "1152", "--draft", "mtp", "--draft-rows", "8"]
    assert cli.main([*argv, "--acceptance", "6"]) == 0
    out = capsys.readouterr().out
    p = _parts(out)
    spec, static = load(dsv3), _committed(dsv3)
    head = make_plan(shard(mtp_model(spec.model)), batch=1, context=1152, static=static)
    moved = {t.name for t in head.traffic if t.bytes}
    assert {"mtp_eh_proj", "mtp_wq_a", "mtp_cache", "lm_head", "embed"} <= moved  # the head's and the shared ones
    assert not moved & {"wq_a", "kv_cache", "final_norm"}  # none of the target's layers or its own norm
    assert p["draft"] == pytest.approx(7 * head.timing.modeled_us, abs=0.05)  # printed .1f
    assert f"the target's `mtp` head, 7 steps of {head.timing.modeled_us:.1f} us" in out
    assert "each head step: dispatch 70.0 us" in out and "      linear `mtp_eh_proj`: " in out
    wide = make_plan(spec.local, batch=spec.model.dims[0].high, context=1152, static=static)
    verify = make_plan(spec.local, batch=8, context=1152, ring_depth=wide.ring_depth, static=static, verify_rows=8)
    assert p["verify"] == pytest.approx(verify.timing.modeled_us, abs=0.05)
    assert p["tps"] == pytest.approx(6e6 / (p["verify"] + p["draft"] + p["accept"]), rel=1e-3)


def test_plan_draft_mtp_head_the_kernel_cannot_lower_is_at_its_floor(capsys):
    """tests/data/tiny_mtp.mk's head keeps a cache not declared `per layer`, which the kernel
    refuses: R - 1 head steps at its HBM floor, labelled OPTIMISTIC with `check`'s reason."""
    from mkdsl.plan.speculative import mtp_model
    from mkdsl.run.spec_drafters import drafter_floor_us

    tiny_mtp = str(ROOT / "tests" / "data" / "tiny_mtp.mk")
    assert cli.main(["plan", tiny_mtp, "--draft", "mtp", "--draft-rows", "4", "--acceptance", "2"]) == 0
    out = capsys.readouterr().out
    floor = drafter_floor_us(mtp_model(load(tiny_mtp).model), 1, 64)[0]  # the default context: 256 // 4
    assert floor > 0 and _parts(out)["draft"] == pytest.approx(3 * floor, abs=0.05)
    assert "3 steps at its HBM floor" in out and "OPTIMISTIC" in out and "`per layer`" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--draft", "mtp"], "--draft mtp: tiny (" + TINY + ") declares no `mtp` head"),
        (["--draft", "ngram", "--acceptance", "9"], "--acceptance must be in 1 .. --draft-rows (8)"),
        (["--draft", "ngram", "--batch", "2"], "outside `B`"),
        (["--draft", "/nonexistent.mk"], "cannot read"),
        (["--draft", "ngram", "--json"], "does not combine with --json"),
    ],
)
def test_plan_draft_argument_errors(capsys, extra, message):
    assert cli.main(["plan", TINY, *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_smollm2_ngram_speculation_prints_the_plain_text():
    """The issue's command, as written, with and without `--draft ngram --draft-rows 4`: the same
    text, and a mean accepted length above 1, each verify step ONE call of the kernel's 4-row
    step (mkdsl/run/verify_rows.py): as many target calls as verify steps, fewer than the tokens.
    About 2 minutes of CPU each run (load, XLA prefill, the kernel's trace and its interpret
    steps), measured; on a loaded 2-core machine 9-12 minutes each, hence the longer timeout."""
    from smollm2_gguf import smollm2_gguf

    gguf = str(smollm2_gguf())
    command = [
        *(sys.executable, "-m", "mkdsl", "run", "specs/smollm2_135m.mk", "--weights", gguf),
        *("--prompt", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "--max-tokens", "16", "--temperature", "0"),
        "--interpret",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": optimised(os.environ.get("XLA_FLAGS", ""))}
    plain = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    assert plain.returncode == 0, plain.stderr
    spec = subprocess.run(
        [*command, "--draft", "ngram", "--draft-rows", "4"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and len(plain.stdout) > len("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,") + 8
    m = re.search(r"(\d+) verify steps; (\d+) target calls, mean accepted ([0-9.]+) tokens/step", spec.stderr)
    assert m and float(m[3]) > 1, spec.stderr
    assert m[1] == m[2], spec.stderr  # one R-row step per verify step, not one per row
