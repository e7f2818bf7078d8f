"""Checkpoint mappings and the loader: synthetic Hugging Face and GGUF checkpoints of the Llama
mini (real tensor names and layouts, random values) load exactly into the spec's layout, and
every mismatch is reported, naming the tensor, before anything is loaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from checkpoint_writers import (
    LLAMA_NAMES,
    decode_blocks,
    gguf_tensors,
    hf_tensors,
    write_gguf,
)
from safetensors.numpy import save_file

import mkdsl
from mkdsl.checkpoint.formats import CheckpointError
from mkdsl.diagnostics import SpecError

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "specs" / "llama3_8b.mk"


@pytest.fixture(scope="module")
def llama():
    spec = mkdsl.load(LLAMA, "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=3)
    return spec, weights


def _hf(tmp_path, tensors) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_safetensors_load_exactly_into_the_spec_layout(llama, tmp_path):
    spec, weights = llama
    loaded, report = mkdsl.load_weights(spec, _hf(tmp_path, hf_tensors(weights, 2)), host=True, progress=False)
    assert set(loaded) == set(weights)
    for name, w in weights.items():
        assert loaded[name].dtype == w.dtype and np.array_equal(loaded[name], w), name
    assert report.tensors == 9 * 2 + 3 and not report.rounded


def test_a_sharded_index_loads_the_same(llama, tmp_path):
    spec, weights = llama
    tensors = hf_tensors(weights, 2)
    names = sorted(tensors)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for f, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / f))
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded, _ = mkdsl.load_weights(spec, tmp_path, host=True, progress=False)
    assert all(np.array_equal(loaded[n], w) for n, w in weights.items())


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """GGUF row 2j + s of a head is Hugging Face row s*d/2 + j."""
    d = x.shape[0] // heads
    out = np.empty_like(x)
    for h in range(heads):
        for j in range(d // 2):
            for s in range(2):
                out[h * d + s * (d // 2) + j] = x[h * d + 2 * j + s]
    return out


def test_gguf_q4_1_q8_0_load_dequantized_unpermuted_and_rounded(llama, tmp_path):
    import gguf

    spec, weights = llama
    c = spec.model.const
    tensors = gguf_tensors(weights, 2, c["NH"], c["NKV"])
    write_gguf(tmp_path / "m.gguf", tensors, block_count=2)
    loaded, report = mkdsl.load_weights(spec, tmp_path / "m.gguf", host=True, progress=False)
    for name, (_, gg, matrix) in LLAMA_NAMES.items():
        for layer in range(2) if "{l}" in gg else [None]:
            x, kind = tensors[gg.format(l=layer)]
            if kind != "F32":
                x = decode_blocks(gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind]), kind, x.shape)
            x = _unpermute(x, {"wq": c["NH"], "wk": c["NKV"]}[name]) if name in ("wq", "wk") else x
            want = (x.T if matrix else x).astype(ml_dtypes.bfloat16)
            got = loaded[name][layer] if layer is not None else loaded[name]
            assert np.array_equal(got, want), (name, layer)
    assert dict(report.rounded) == {"Q4_1": 7 * 2 + 1, "Q8_0": 1, "F32": 2 * 2 + 1}
    assert "rounded to nearest" in report.summary() and "Q4_1 -> bf16" in report.summary()


def test_every_mismatch_is_listed_before_anything_loads(llama, tmp_path):
    spec, weights = llama
    tensors = hf_tensors(weights, 2)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:64]
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float32)
    with pytest.raises(CheckpointError) as e:
        mkdsl.load_weights(spec, _hf(tmp_path, tensors), host=True, progress=False)
    text = str(e.value)
    assert "3 problems" in text, text
    assert re.search(r"missing tensor `model\.layers\.1\.mlp\.up_proj\.weight` for `w_up` \(layer 1\)", text)
    assert re.search(
        r"tensor `model\.layers\.0\.self_attn\.k_proj\.weight` is BF16 \[64, 256\] "
        r"\(after `transpose`: \[256, 64\]\); expected \[256, 128\] for `wk` \(layer 0\)",
        text,
    )
    assert re.search(r"tensor `model\.norm\.weight` is F32, which bf16 cannot hold exactly .*`\| round`", text)


def test_a_checkpoint_with_more_layers_than_the_spec_is_refused(llama, tmp_path):
    spec, weights = llama
    path = _hf(tmp_path, hf_tensors(weights, 2))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    with pytest.raises(CheckpointError, match="the checkpoint has 30 layers; the spec has 2"):
        mkdsl.load_weights(spec, path, host=True, progress=False)


MAPPING_BASE = LLAMA.read_text()


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('  wq         = "model', '  wqq        = "model', r"checkpoint hf: unknown weight `wqq`.*did you mean `wq`"),
        (
            'self_attn.q_proj.weight" | transpose\n',
            'self_attn.q_proj.weight" | transpose | transpos\n',
            r"unknown checkpoint step `transpos`.*did you mean `transpose`",
        ),
        ('"model.layers.{l}.self_attn.v_proj', '"model.layers.{l.self_attn.v_proj', r"bad name pattern"),
        ('"model.layers.{l}.input_layernorm', '"model.layers.input_layernorm', r"has no layer index `\{l\}`"),
        ('"model.norm.weight"', '"model.{l}.norm.weight"', r"uses `\{l\}`, but the weight is not per layer"),
        ("unpermute(heads=NH)", "unpermute(head=NH)", r"`unpermute` takes \(heads\)"),
        ('  lm_head    = "lm_head.weight" | transpose\n', "", r"checkpoint hf does not say where `lm_head` comes from"),
        ("checkpoint gguf", "checkpoint ggml", r"unknown checkpoint format `ggml`"),
        (
            '  final_norm = "model.norm.weight"',
            '  k_cache = "x"\n  final_norm = "model.norm.weight"',
            r"`k_cache` is state, not a weight",
        ),
    ],
)
def test_mapping_mistakes_are_diagnostics(tmp_path, old, new, message):
    assert old in MAPPING_BASE
    bad = tmp_path / "bad.mk"
    bad.write_text(MAPPING_BASE.replace(old, new, 1))
    with pytest.raises(SpecError) as e:
        mkdsl.load(bad, "mini")
    text = e.value.render(str(bad), bad.read_text())
    assert re.search(message, text, re.S), text
    assert re.search(r"bad\.mk:\d+:\d+: error", text)
