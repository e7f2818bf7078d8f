"""The Python API (docs/python-api.md) and the generated module's own guard rails: its docstring
example runs, and every malformed input to its step is a plain ValueError before tracing."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mkdsl

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny.mk")


@pytest.fixture(scope="module")
def spec() -> mkdsl.Spec:
    return mkdsl.load(TINY)


@pytest.fixture(scope="module")
def kernel(spec):
    return mkdsl.load_kernel(spec)


def test_load_gives_the_model_and_its_profiles():
    llama = mkdsl.load(ROOT / "specs" / "llama3_8b.mk", "mini")
    assert (llama.name, llama.profile, llama.profiles) == ("llama3_8b", "mini", ("mini",))
    assert llama.batch_range == (1, 8)
    kimi = mkdsl.load(ROOT / "specs" / "kimi_k3.mk", "mini")
    assert kimi.local is not kimi.model  # sharded: the per-device model differs
    assert kimi.profiles == ("mini", "core")


def test_unknown_profile_is_a_value_error_listing_the_profiles():
    with pytest.raises(mkdsl.ProfileError, match=r"its profiles: mini, core \(did you mean `core`\?\)"):
        mkdsl.load(ROOT / "specs" / "kimi_k3.mk", "cores")
    assert issubclass(mkdsl.ProfileError, ValueError)


def test_spec_errors_render_as_the_cli_does(tmp_path):
    bad = tmp_path / "bad.mk"
    bad.write_text(Path(TINY).read_text().replace("rmsnorm(x, norm2)", "rmsnorm(x, norm3)"))
    with pytest.raises(mkdsl.SpecError) as e:
        mkdsl.load(bad)
    text = e.value.render(e.value.path, e.value.source)
    assert re.search(rf"^{re.escape(str(bad))}:\d+:\d+: error: unknown name `norm3`", text, re.M), text


def test_compile_text_is_what_compile_writes(spec, tmp_path):
    files = mkdsl.compile_text(spec)
    committed = ROOT / "generated" / "tiny"
    assert files == {p.name: p.read_text(encoding="utf-8") for p in sorted(committed.iterdir())}
    out = mkdsl.compile_to(spec, tmp_path / "tiny")
    assert out == tmp_path / "tiny"
    assert {p.name: p.read_text(encoding="utf-8") for p in out.iterdir()} == files


def test_random_inputs_follow_the_layouts(spec, kernel):
    weights, state = mkdsl.random_inputs(spec, batch=3, seq_len=256, seed=1)
    kw = mkdsl.kernel_weights(weights)
    assert {k: (v.shape, jnp.dtype(v.dtype)) for k, v in kw.items()} == {
        k: (s.shape, s.dtype) for k, s in kernel.weight_layout().items()
    }
    assert {k: v.shape for k, v in state.items()} == {k: s.shape for k, s in kernel.state_layout(3, 256).items()}
    again, _ = mkdsl.random_inputs(spec, batch=3, seq_len=256, seed=1)
    assert all(np.array_equal(np.asarray(weights[k]), np.asarray(again[k])) for k in weights)


def test_module_docstring_example_runs(kernel, monkeypatch):
    """The five indented lines of the module's docstring, run as written (one interpret-mode step)."""
    lines = [line[4:] for line in kernel.__doc__.splitlines() if line.startswith("    ")]
    assert len(lines) == 5, lines
    monkeypatch.setitem(sys.modules, "kernel", kernel)
    scope: dict = {}
    exec("\n".join(lines), scope)
    assert scope["logits"].shape == (1, 256) and scope["next_tokens"].shape == (1,)
    assert not np.isnan(np.asarray(scope["logits"])).any()


# ---------------------------------------------------------------- input validation, before tracing


def good_inputs(kernel, batch: int = 2, seq_len: int = 256):
    weights = {n: np.zeros(s.shape, s.dtype) for n, s in kernel.weight_layout().items()}
    state = {n: np.zeros(s.shape, s.dtype) for n, s in kernel.state_layout(batch, seq_len).items()}
    return weights, state, np.array([1, 2], np.int32), np.array([0, 255], np.int32)


def without(d: dict, name: str) -> dict:
    return {k: v for k, v in d.items() if k != name}


def replaced(d: dict, name: str, value) -> dict:
    return {**d, name: value}


BAD_INPUTS = {
    "missing weight": (lambda w, s, t, p: (without(w, "wq"), s, t, p), "weights: missing wq"),
    "unexpected weight": (lambda w, s, t, p: ({**w, "wz": w["wq"]}, s, t, p), "weights: unexpected wz"),
    "weight shape": (
        lambda w, s, t, p: (replaced(w, "wq", w["wq"][:, :, :128]), s, t, p),
        r"weights `wq` is bfloat16\[2, 128, 128\], expected bfloat16\[2, 128, 256\]",
    ),
    "weight dtype": (
        lambda w, s, t, p: (replaced(w, "lm_head", w["lm_head"].astype(np.float32)), s, t, p),
        r"weights `lm_head` is float32\[128, 256\], expected bfloat16\[128, 256\]",
    ),
    "weight not an array": (lambda w, s, t, p: (replaced(w, "wq", [1, 2]), s, t, p), "weights `wq` is a list"),
    "missing state": (lambda w, s, t, p: (w, without(s, "v_cache"), t, p), "state: missing v_cache"),
    "state of another batch": (
        lambda w, s, t, p: (w, replaced(s, "k_cache", s["k_cache"][:, :1]), t, p),
        r"state `k_cache` is bfloat16\[2, 1, 1, 256, 128\], expected bfloat16\[2, 2, 1, 256, 128\]",
    ),
    "state not a dict": (lambda w, s, t, p: (w, list(s.values()), t, p), "state must be a dict"),
    "tokens shape": (lambda w, s, t, p: (w, s, t[:1], p), r"tokens must be an integer array of shape \(2,\)"),
    "tokens dtype": (lambda w, s, t, p: (w, s, t.astype(np.float32), p), r"got float32\[2\]"),
    "token too large": (lambda w, s, t, p: (w, s, np.array([1, 256]), p), r"tokens\[1\] = 256 is outside 0..255"),
    "negative token": (lambda w, s, t, p: (w, s, np.array([-1, 2]), p), r"tokens\[0\] = -1 is outside 0..255"),
    "position past the cache": (
        lambda w, s, t, p: (w, s, t, np.array([0, 256])),
        r"positions\[1\] = 256 is outside 0..255 \(the cache holds 256 tokens\)",
    ),
    "negative position": (lambda w, s, t, p: (w, s, t, np.array([-3, 0])), r"positions\[0\] = -3 is outside"),
    "positions as a list": (lambda w, s, t, p: (w, s, t, [0, 1]), "positions must be an integer array"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_each_bad_input_is_a_value_error_before_tracing(kernel, case):
    """interpret=None compiles for a TPU, which this CPU-only process cannot do: reaching the
    trace would raise something else, so a ValueError proves the check ran first."""
    mutate, message = BAD_INPUTS[case]
    step = kernel.build_decode_step(2, 256)
    with pytest.raises(ValueError, match=message):
        step(*mutate(*good_inputs(kernel)))


def test_good_inputs_pass_the_checks(kernel):
    kernel.check_inputs(*good_inputs(kernel), 2, 256)
    tokens = jnp.array([255, 0], jnp.int16)  # any integer dtype; the step casts to int32
    weights, state, _, positions = good_inputs(kernel)
    kernel.check_inputs(weights, state, tokens, positions, 2, 256)


def test_abstract_inputs_are_checked_by_shape_only(kernel):
    abstract = [kernel.weight_layout(), kernel.state_layout(2, 256)]
    ids = jax.ShapeDtypeStruct((2,), jnp.int32)
    kernel.check_inputs(*abstract, ids, ids, 2, 256)  # no values: nothing else to check
    step = kernel.build_decode_step(2, 256)
    with pytest.raises(ValueError, match=r"tokens must be an integer array of shape \(2,\)"):
        step.lower(*abstract, jax.ShapeDtypeStruct((3,), jnp.int32), ids)


@pytest.mark.parametrize(
    "batch, seq_len, message",
    [
        (0, 256, r"batch must be an int in 1..8, got 0"),
        (9, 256, r"batch must be an int in 1..8, got 9"),
        (2.0, 256, r"batch must be an int in 1..8, got 2.0"),
        (2, 512, r"seq_len must be an int in 1..256, got 512"),
        (2, 0, r"seq_len must be an int in 1..256, got 0"),
        (2, 128, r"seq_len must be a multiple of the KV tile \(256\), got 128"),
    ],
)
def test_bad_sizes_are_value_errors(kernel, batch, seq_len, message):
    with pytest.raises(ValueError, match=message):
        kernel.build_decode_step(batch, seq_len)


def test_sharded_module_checks_global_inputs():
    kimi = mkdsl.load_kernel(mkdsl.load(ROOT / "specs" / "kimi_k3.mk", "mini"))
    weights, state = kimi.weight_layout(), kimi.state_layout(1, 1024)
    ids = jax.ShapeDtypeStruct((1,), jnp.int32)
    kimi.check_inputs(weights, state, ids, ids, 1, 1024)
    local = kimi.local_weight_layout()
    assert local != weights
    with pytest.raises(ValueError, match="weights `"):
        kimi.check_inputs(local, state, ids, ids, 1, 1024)  # one device's slices are not the step's input
    with pytest.raises(ValueError, match=rf"outside 0..{kimi.VOCAB_SIZE - 1}"):
        kimi.check_inputs(weights, state, np.array([kimi.VOCAB_SIZE]), np.array([0]), 1, 1024)


def test_docstring_example_is_the_documented_contract():
    text = textwrap.dedent(mkdsl.load_kernel(mkdsl.load(ROOT / "specs" / "kimi_k3.mk", "mini")).__doc__)
    assert "make_mesh" in text  # a sharded module says where its step runs
