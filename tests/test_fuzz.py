"""A mutation fuzzer over every spec in specs/: no mutant makes mkdsl fail internally.

Hypothesis mutates a spec's tokens (deletes, duplicates or swaps tokens, changes numbers to
edge values, swaps identifiers) and runs `mkdsl compile -o DIR` in-process on the mutant. Every
mutant must end in exit 0 (the output written), exit 1 with a positioned first diagnostic and
nothing written, or exit 2; never exit 3 (an internal error) and never past TIME_BOUND seconds.

CI runs a fixed, derandomised slice (MKDSL_FUZZ_CASES per spec, default 100). For a long run:
`MKDSL_FUZZ_CASES=3400 MKDSL_FUZZ_SEED=1 python -m pytest tests/test_fuzz.py` (any seed: a
random one per run instead of the fixed CI slice).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from mkdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.mk"))
CASES = int(os.environ.get("MKDSL_FUZZ_CASES", "100"))
SEED = os.environ.get("MKDSL_FUZZ_SEED")
OUTCOMES: Counter[int] = Counter()  # exit code -> mutants, for the summary line
TIME_BOUND = 60  # seconds per mutant; a real spec compiles in under 1 s
TOKEN = re.compile(r"#[^\n]*|\s+|[A-Za-z_]\w*|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|\*\*|//|==|!=|<=|>=|\.\.|.", re.S)
NUMBERS = ["0", "1", "2", "3", "7", "128", "1000", "2 ** 31", "2 ** 62", "10 ** 400", "1e400", "0.5", "1e-50", "-1"]


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def significant(toks: list[str]) -> list[int]:
    return [i for i, t in enumerate(toks) if not t.isspace() and not t.startswith("#")]


@st.composite
def mutants(draw, text: str) -> str:
    toks = tokens(text)
    for _ in range(draw(st.integers(1, 3))):
        idx = significant(toks)
        i = draw(st.sampled_from(idx))
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "number", "number", "number", "name"]))
        if kind == "delete":
            toks[i] = " "
        elif kind == "duplicate":
            toks[i] = f"{toks[i]} {toks[i]}"
        elif kind == "swap":
            j = draw(st.sampled_from(idx))
            toks[i], toks[j] = toks[j], toks[i]
        elif kind == "number":
            nums = [k for k in idx if toks[k][0].isdigit()]
            toks[draw(st.sampled_from(nums))] = draw(st.sampled_from(NUMBERS))
        else:
            names = [k for k in idx if toks[k][0].isalpha() or toks[k][0] == "_"]
            a, b = draw(st.sampled_from(names)), draw(st.sampled_from(names))
            toks[a] = toks[b]
    return "".join(toks)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def compile_mutant(text: str, where: Path, capsys) -> None:
    spec, out = where / "spec.mk", where / "out"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    spec.write_text(text, encoding="utf-8")
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_BOUND)
    try:
        code = main(["compile", str(spec), "-o", str(out)])
    except _Timeout:
        pytest.fail(f"a mutant ran longer than {TIME_BOUND} s:\n{text}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    captured = capsys.readouterr()
    OUTCOMES[code] += 1
    assert code in (0, 1, 2), f"exit {code}:\n{captured.err}\n--- mutant:\n{text}"
    if code == 0:
        assert sorted(os.listdir(out)) == ["kernel.py", "plan.md", "plan.svg"]
        return
    assert not out.exists(), "a failed compile wrote output"
    if code == 1:
        first = captured.err.splitlines()[0]
        m = re.match(rf"{re.escape(str(spec))}:(\d+):(\d+): error: ", first)
        assert m, f"unpositioned diagnostic: {first}\n--- mutant:\n{text}"
        assert 1 <= int(m[1]) <= text.count("\n") + 1, first


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_mutants_never_fail_internally(spec, tmp_path, capsys):
    text = spec.read_text(encoding="utf-8")

    @settings(
        max_examples=CASES,
        derandomize=SEED is None,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(mutant=mutants(text))
    def check(mutant):
        compile_mutant(mutant, tmp_path / "case", capsys)

    if SEED is not None:
        check = seed(int(SEED))(check)
    OUTCOMES.clear()
    check()
    print(f"\n{spec.name}: {sum(OUTCOMES.values())} mutants, exit codes {dict(sorted(OUTCOMES.items()))}")
