"""fp8 experts with 128 x 128 block scales whose width is several expert tiles (1536 = six tiles
of 256): libtpu once refused each tile's scale DMA, a strided [8, 2] slice of the expert's [8, 12]
scale block ("Source and target leading tiles have different trailing dimensions", in
`MoE.issue`). The kernel now fetches an expert's whole scale blocks and reads them at the tile's
columns: it compiles, and equals the reference in interpret mode (race detector on; bounds from
mkdsl/verify/kernel.py; reading the first tile's scales for every tile fails them by ~8x).
Cost: the compile ~15 s, the interpret step ~30 s on the 2-core dev machine (slow-marked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_helpers import compile_one_core, load_module, tpu7x_devices

from mkdsl.compiler import compile_source
from mkdsl.verify import kernel as verify

SPEC = Path(__file__).resolve().parent / "data" / "fp8_wide_experts.mk"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out, _ = compile_source(SPEC.read_text(encoding="utf-8"), str(SPEC), None, None)
    path = tmp_path_factory.mktemp("fp8_wide") / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    return out, path


def test_expert_tiles_are_several_per_expert(compiled):
    out, path = compiled
    assert "tn=256" in path.read_text(encoding="utf-8") and "F=1536" in path.read_text(encoding="utf-8")
    scales = [a for a in out.plan.vmem if a.name.endswith("_w1s")]
    assert scales and all(a.shape[-2:] == (1024 // 128, 1536 // 128) for a in scales), scales  # whole experts'


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiles_with_libtpu(compiled):
    _, path = compiled
    module = load_module(path, "fp8_wide_compile")
    for batch in (1, 8):
        assert compile_one_core(module, tpu7x_devices("tpu7x:2x2x1")[0], batch, 256)[0] is not None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernel_matches_reference(compiled, tmp_path):
    out, path = compiled
    module = verify.import_generated(path.read_text(encoding="utf-8"), tmp_path, "fp8_wide_interpret")
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), 2, steps=1, seed=2)
    assert not result.failures, result.failures
