"""`mkdsl verify`: the layer-by-layer interpret check and the libtpu compile, as a user runs them.

The command must pass on a correct kernel and fail, naming the layer, on kernels whose generated
code was broken by a small, plausible mutation (an MLP scaled by 5 %, rotary frequencies off by
5 %): each moves a layer's output by far more than the
checker's bounds (mkdsl/verify/kernel.py) but leaves the kernel running and finite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mkdsl.compiler import compile_source
from mkdsl.verify import kernel as verify

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.mk"

MUTATIONS = {  # generated text -> a plausible bug; each must occur exactly once in the tiny kernel
    "mlp scaled by 5%": (
        "jax.nn.silu(r.v1_256[...]) * r.v2_256[...]",
        "jax.nn.silu(r.v1_256[...]) * r.v2_256[...] * 1.05",
    ),
    "rope frequencies off by 5%": ("inv = jnp.where(pair == i, f, inv)", "inv = jnp.where(pair == i, f * 1.05, inv)"),
}


@pytest.fixture(scope="module")
def tiny():
    out, _ = compile_source(TINY.read_text(encoding="utf-8"), str(TINY), None, None)
    return out


def test_verify_command_passes_on_tiny():
    run = subprocess.run(
        [sys.executable, "-m", "mkdsl", "verify", str(TINY)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "interpret batch 1, 2 steps  ok" in run.stdout
    assert "libtpu tpu7x:2x2x1 batch 1  ok" in run.stdout and "compiler VMEM" in run.stdout
    assert run.stdout.rstrip().endswith("verified")


def test_verify_rejects_a_bad_batch():
    run = subprocess.run(
        [sys.executable, "-m", "mkdsl", "verify", str(TINY), "--batch", "9", "--no-compile"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--batch 9 is outside `B` in 1 .. 8" in run.stderr


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_verify_catches_a_broken_kernel(tiny, mutation, tmp_path):
    old, new = MUTATIONS[mutation]
    text = tiny.files["kernel.py"]
    assert text.count(old) == 1, f"update the mutation `{mutation}`: its text is not in the tiny kernel"
    module = verify.import_generated(text.replace(old, new), tmp_path, "broken")
    result = verify.check_batch(tiny.model, module, verify.LayerChecker(tiny.model), batch=2, steps=1, seed=3)
    assert result.failures, f"{mutation}: not caught; worst error / bound {result.worst}"
    assert any("layer 0" in f for f in result.failures), result.failures
    table = verify.summary_table([result], None)
    assert "FAIL" in table and "layer 0 (decoder): row" in table


def _delta_rule(s, k, v, g, beta):
    """One delta-rule token per head in float64, written from the published equation
    (S' = exp(g) S; u = beta (v - S'^T k); S = S' + k u^T)."""
    sp = np.exp(g)[:, :, None] * s
    u = beta[:, None] * (v - np.einsum("hk,hkv->hv", k, sp))
    return sp + k[:, :, None] * u[:, None, :]


def test_recurrent_state_bound_is_per_head_and_still_catches_a_wrong_update():
    """The recurrent state's unit is its head's [dk, dv] matrix (`OpDef.state_unit`; the bound's
    derivation is in mkdsl/verify/kernel.py): a flip-sized change of k (2^-12 of its largest
    entry, what one bf16 ulp of a projection input does) stays far inside that bound, although
    it is many times a per-row bound wherever a key channel has decayed to little; a wrong update
    (the decay left out of one head, or beta taken as 1) is caught."""
    from mkdsl.ops import OPS

    assert OPS["recurrent"].state_unit == 2 and OPS["attention"].state_unit == 1
    rng = np.random.default_rng(0)
    heads, dk, dv = 4, 64, 32
    s = rng.standard_normal((heads, dk, dv)) * 0.1
    k = rng.standard_normal((heads, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, beta = rng.standard_normal((heads, dv)), rng.uniform(0.2, 0.9, heads)
    g = rng.uniform(-5.0, -0.01, (heads, dk))  # KDA's gate range: some channels decayed to ~0.7%
    s[:, :8] *= 1e-3  # and a few rows already small
    want = _delta_rule(s, k, v, g, beta)
    flip = _delta_rule(s, k + 2.0**-12 * np.abs(k).max() * rng.standard_normal(k.shape), v, g, beta)
    per_head = verify.state_ratio(want[None], flip[None], np.float32, unit=2)
    per_row = verify.state_ratio(want[None], flip[None], np.float32, unit=1)
    assert per_head.max() < 0.5 and per_row.max() > 1, (per_head, per_row)
    g_off = g.copy()
    g_off[1] = 0.0  # head 1 not decayed
    for bad in (_delta_rule(s, k, v, g_off, beta), _delta_rule(s, k, v, g, np.ones(heads))):
        assert verify.state_ratio(want[None], bad[None], np.float32, unit=2).max() > 1
