"""Every spec in specs/ compiles with libtpu at its published widths ("a spec that checks
compiles"). The layer count is cut to the fewest layers that still hold every layer kind of the
spec (the widths, meshes and kinds are the published ones; a kernel's code is per kind, so more
layers of a kind add no new code to compile), as Kimi K3's `core` profile does. Specs compiled at
full size by their own tests are listed in ELSEWHERE (checked to name the spec), so that CI
compiles each spec once. Cost: ~10-60 s per spec on the 2-core dev machine (slow-marked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_helpers import load_module

from mkdsl.backends.tpu.libtpu import compile_module, topology_for, tpu7x_devices
from mkdsl.compiler import compile_source
from mkdsl.lang.elaborate import elaborate
from mkdsl.lang.syntax import parse
from mkdsl.verify.kernel import check_seq_len

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
SPECS = sorted((ROOT / "specs").glob("*.mk"))
ELSEWHERE = {  # spec -> the test that compiles it at full size
    "kimi_k3": "test_kimi_compile.py",
    "deepseek_v3": "test_deepseek_v3_compile.py",
    "gpt_oss_120b": "test_gpt_oss_compile.py",
    "qwen3_30b_a3b": "test_qwen3_compile.py",
    "qwen3_next_80b_a3b": "test_qwen3_next_compile.py",
    "llama3_8b": "test_tpu_compile.py",
}
# Specs `mkdsl check` refuses today (so there is no kernel to compile), each with why. The test
# below keeps this list honest: once such a spec checks, it must leave the list and compile here.
REFUSED: dict[str, str] = {}
# Specs compiled with every layer they declare, not cut to the fewest holding every kind, each with why.
WHOLE_STACK = {"kimi_k3_dspark": "a drafter of 5 layers: its whole stack as it runs (~25 s)"}
HERE = [s for s in SPECS if s.stem not in ELSEWHERE and s.stem not in REFUSED]


def test_the_refused_specs_are_still_refused_by_check():
    from mkdsl.api import load
    from mkdsl.lang.diagnostics import SpecError
    from mkdsl.plan import make_plan

    for stem in REFUSED:
        spec = load(str(ROOT / "specs" / f"{stem}.mk"))
        with pytest.raises(SpecError):
            make_plan(spec.local, batch=spec.model.dims[0].high)


def few_layers(text: str) -> tuple[str, int, int]:
    """(the spec with a profile cutting L to the fewest layers holding every kind, that count, L)."""
    full = elaborate(parse(text), None, text)
    kinds = set(full.schedule)
    for n in range(1, len(full.schedule) + 1):
        cut = f"{text}\nprofile ci_layers {{\n  L = {n}\n}}\n"
        if set(elaborate(parse(cut), "ci_layers", cut).schedule) == kinds:
            return cut, n, len(full.schedule)
    raise AssertionError("no layer count holds every kind")


def test_every_spec_is_compiled_at_full_size_somewhere():
    for stem, test in ELSEWHERE.items():
        assert (ROOT / "specs" / f"{stem}.mk").exists(), stem
        assert f'"{stem}.mk"' in (TESTS / test).read_text(encoding="utf-8"), (stem, test)
    assert {s.stem for s in SPECS} == {s.stem for s in HERE} | set(ELSEWHERE) | set(REFUSED)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("spec", HERE, ids=lambda p: p.stem)
def test_spec_compiles_with_libtpu_at_its_widths(spec, tmp_path):
    text, n, total = few_layers(spec.read_text(encoding="utf-8"))
    profile = "ci_layers"
    if spec.stem in WHOLE_STACK:
        text, profile, n = spec.read_text(encoding="utf-8"), None, total
    out, _ = compile_source(text, str(spec), profile, None)
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    module = load_module(path, f"{spec.stem}_ci_layers")
    batch = out.model.dims[0].high
    compiled, seconds = compile_module(module, tpu7x_devices(topology_for(module)), batch, check_seq_len(module))
    assert compiled is not None
    print(
        f"\n{spec.stem}: {n} of {total} layers ({', '.join(sorted(set(out.model.schedule)))}), batch {batch}: {seconds:.0f} s"
    )
