"""Random valid specs (tests/spec_gen.py): each compiles, and its kernel matches the reference.

CI runs MKDSL_SPECGEN_CASES (default 3) cases of MKDSL_SPECGEN_SEED (default 0) in TPU interpret mode
with the race detector on, and compiles the first COMPILED cases (fast, no kernel run). For a long
run: `MKDSL_SPECGEN_CASES=200 MKDSL_SPECGEN_SEED=7 python -m pytest tests/test_spec_gen.py`, or
`python tests/spec_gen.py --cases 200 --seed 7` (one line per case, no pytest).
"""

from __future__ import annotations

import os

import pytest
import spec_gen

CASES = int(os.environ.get("MKDSL_SPECGEN_CASES", "3"))
SEED = int(os.environ.get("MKDSL_SPECGEN_SEED", "0"))
COMPILED = 60


def test_generated_specs_compile_and_are_reproducible(tmp_path):
    seen = set()
    for index in range(COMPILED):
        case = spec_gen.generate(SEED, index)
        assert spec_gen.generate(SEED, index) == case, "a case must be a function of (seed, index)"
        seen.update(p.split("(")[0] for p in case.summary.split(": ", 1)[1].split("; "))
        spec_gen.compile_case(case, tmp_path)  # SpecError (a diagnostic) fails the test
    assert seen >= {"attn", "mlp", "slice", "compact", "mla", "moe", "kda", "elementwise"}, seen


@pytest.mark.timeout(900)  # a kernel waiting on a DMA nobody started hangs, as on a TPU
@pytest.mark.parametrize("index", range(CASES))
def test_random_spec_kernel_matches_reference(index, tmp_path):
    case = spec_gen.generate(SEED, index)
    failures = spec_gen.check_case(case, tmp_path)
    assert not failures, f"seed {SEED} case {index} ({case.summary}):\n" + "\n".join(failures[:8]) + "\n" + case.text
