"""specs/nemotron_h_8b.mk (NVIDIA Nemotron-H-8B, a Mamba2 / attention / MLP hybrid): the full-size
spec is the published layer pattern and widths; the Mamba2 mixer's pieces that are new to the
language against float64 equations written here (the grouped gated RMSNorm with a weight per
channel, and the checkpoint's per-head D repeated per channel); its mini kernel against the
reference in TPU interpret mode. Its agreement with transformers' `nemotron_h` is in
tests/test_oracle_transformers.py, its full-size libtpu compile in tests/test_specs_compile.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mkdsl.checkpoint.steps import STEPS
from mkdsl.compiler import compile_source
from mkdsl.lang.elaborate import load
from mkdsl.ops.norm import rmsnorm
from mkdsl.verify import kernel as verify

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "nemotron_h_8b.mk"
PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"  # hybrid_override_pattern
KIND = {"M": "mamba", "-": "mlp", "*": "attn"}


def test_full_size_spec_is_the_published_model():
    m = load(str(SPEC))
    assert m.schedule == tuple(KIND[c] for c in PATTERN)
    assert m.tensor("ssm_wx").type.shape == (4096, 128 * 64)
    assert m.tensor("ssm_wb").type.shape == (4096, 8 * 128)
    assert m.tensor("ssm").type.shape[1:] == (128, 128, 64)
    assert m.tensor("w_up").type.shape == (4096, 21504) and m.tensor("embed").type.shape == (131072, 4096)
    mini = load(str(SPEC), "mini")
    assert mini.schedule == tuple(KIND[c] for c in PATTERN[:8])  # the published first 8 layers


def test_grouped_gated_norm_with_a_weight_per_channel():
    """rmsnorm(y, w, heads=G) with w as wide as the row: each group of I/G channels normalised
    alone, then every channel times its own weight (NemotronHRMSNormGated, n_groups = G)."""
    rng = np.random.default_rng(0)
    b, g, width = 3, 4, 64
    y = rng.standard_normal((b, g * width)).astype(np.float32)
    w = rng.standard_normal(g * width).astype(np.float32)
    y64 = y.astype(np.float64).reshape(b, g, width)
    want = (y64 / np.sqrt((y64**2).mean(-1, keepdims=True) + 1e-5)).reshape(b, -1) * w
    got = np.asarray(rmsnorm(y, w, 1e-5, heads=g))
    # f32 arithmetic on O(1) values: a few f32 ulps relative
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    shared = np.asarray(rmsnorm(y, w[:width], 1e-5, heads=g))  # the per-head weight form is unchanged
    np.testing.assert_allclose(
        shared, ((want / w).reshape(b, g, width) * w[:width]).reshape(b, -1), rtol=1e-4, atol=1e-5
    )


def test_repeat_step_stores_a_per_head_vector_per_channel():
    d = np.array([0.5, -1.0, 2.0], np.float32)
    dim, idx = STEPS["repeat"].select((3,), {"each": 4, "dim": 0})
    assert dim == 0
    np.testing.assert_array_equal(np.take(d, idx), np.repeat(d, 4))
    assert "each >= 1" in STEPS["repeat"].select((3,), {"each": 0, "dim": 0})


@pytest.mark.slow
def test_mini_kernel_matches_the_reference_in_interpret_mode(tmp_path):
    """A step of the 8-layer mini (every kind; 4 Mamba heads in 2 groups) at batch 2, checked layer by layer."""
    out, _ = compile_source(SPEC.read_text(encoding="utf-8"), str(SPEC), "mini", None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "nemotron_mini")
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=1, seed=0)
    assert not result.failures, result.failures
    assert "state ssm" in result.worst and "state cx" in result.worst  # the Mamba2 state was compared


GROUPED = """
model grouped
const H = 256
dim B in 1 .. 8
mesh {{ tp = 2 }}
weight embed: bf16[512, H]
weight w_in: bf16[H, 512 @tp] per layer
weight g_norm: bf16[{norm}] per layer
weight w_out: bf16[512 @tp, H] per layer
layer l(x) {{ return x + linear(rmsnorm(linear(x, w_in), g_norm, heads=4), w_out) }}
layers 1 {{ l: otherwise }}
step(tokens, positions) {{
  logits = linear(layers(embedding(tokens, embed)), embed, transposed=true)
  return logits, argmax(logits)
}}
"""


def test_a_per_channel_norm_weight_splits_with_its_groups(tmp_path):
    """Under a mesh the grouped norm's per-channel weight is split like its input (each device
    its groups' channels); left whole, the check names it."""
    ok = GROUPED.format(norm="512 @tp")
    out, _ = compile_source(ok, str(tmp_path / "g.mk"), None, tmp_path / "ok")
    assert "rmsnorm(" in out.files["kernel.py"]
    with pytest.raises(Exception) as e:
        compile_source(GROUPED.format(norm="512"), str(tmp_path / "g.mk"), None, tmp_path / "bad")
    assert "`g_norm` (one weight per channel) must be split like" in str(e.value)
