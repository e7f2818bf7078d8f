"""NVFP4 and int4 with f32 scales: the reference's decoders against float64 decoders of the published
formats, the spec errors, and the kernel's in-VMEM decoders (TPU interpret mode) against the
reference through the weight ring, with several K tiles."""

from __future__ import annotations

import numpy as np
import pytest
from test_quant_linear import e2m1, minifloat, nibbles

from mkdsl.compiler import compile_source
from mkdsl.lang import dtypes
from mkdsl.lang.diagnostics import SpecError
from mkdsl.lang.quant import dequantize, quantize
from mkdsl.verify import kernel as verify


def nvfp4_64(codes: np.ndarray, scales: np.ndarray, glob: np.ndarray) -> np.ndarray:
    """NVIDIA NVFP4: e2m1 value * e4m3 block scale (one per 16 inputs) * the tensor's f32 scale."""
    vals = np.array([e2m1(n) for n in range(16)])[nibbles(codes)]
    e4m3 = np.array([minifloat(b, 4, 3, 7) for b in range(256)])
    scale = e4m3[np.asarray(scales).view(np.uint8)]
    return vals * np.repeat(scale, 16, axis=0) * float(glob.reshape(()))


def int4_64(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    nib = nibbles(codes)
    return np.where(nib >= 8, nib - 16, nib) * np.repeat(scales.astype(np.float64), group, axis=0)


def test_nvfp4_reference_decoder_matches_the_published_format():
    w = np.random.default_rng(3).standard_normal((256, 200)).astype(np.float32) * 3
    q = quantize(dtypes.NVFP4, w)
    parts = dtypes.storage(dtypes.NVFP4, w.shape)
    got_parts = [(a.shape, str(a.dtype)) for a in (q.codes, q.scales, q.glob)]
    assert (
        [(p.shape, p.dtype) for p in parts]
        == got_parts
        == [
            ((32, 200), "uint32"),
            ((16, 200), "float8_e4m3fn"),
            ((1, 1), "float32"),
        ]
    )
    want = nvfp4_64(np.asarray(q.codes), np.asarray(q.scales), np.asarray(q.glob))
    got = np.asarray(dequantize(q))
    # e2m1 * e4m3 is exact (2 + 4 significant bits); times the f32 global it is rounded once in f32,
    # as the f64 product (exact: 6 + 24 bits) rounded to f32
    np.testing.assert_array_equal(got, want.astype(np.float32))
    # a quantisation, not garbage: within one e2m1 step (2 at the top) of the block's scale
    step = 2.0 * np.repeat(q.scales.astype(np.float32), 16, axis=0) * q.glob
    assert (np.abs(got - w) <= step / 2 + 1e-6).all() and np.isfinite(got).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_with_f32_scales_matches_the_published_format(group):
    dt = dtypes.int4(group, "float32")
    assert str(dt) == f"int4(group={group}, scale=f32)" and str(dtypes.int4(group)) == f"int4(group={group})"
    w = np.random.default_rng(group).standard_normal((256, 136)).astype(np.float32)
    q = quantize(dt, w)
    assert q.scales.dtype == np.float32 and q.scales.shape == (256 // group, 136)
    got = np.asarray(dequantize(q))
    # a nibble (<= 4 bits) times an f32 scale, rounded once to f32
    np.testing.assert_array_equal(got, int4_64(np.asarray(q.codes), q.scales, group).astype(np.float32))
    assert np.abs(got - w).max() <= np.abs(w).max() / 7 / 2 * 1.0001


HEAD = """
model q
const H = 256
dim B in 1 .. 8
weight embed: bf16[256, H]
weight w: {dtype}[H, H] per layer
layer l(x) {{ return x + linear(x, w) }}
layers 1 {{ l: otherwise }}
step(tokens, positions) {{
  logits = linear(layers(embedding(tokens, embed)), w)
  return logits, argmax(logits)
}}
"""


@pytest.mark.parametrize(
    "dtype, message",
    [
        ("int4(group=128, scale=f16)", "int4 scales are bf16 or f32"),
        ("nvfp4(group=32)", "dtype nvfp4 takes no parameters"),
        ("int4(scale=f32)", "int4 needs a group size"),
    ],
)
def test_quantised_dtype_errors_name_what_is_wrong(tmp_path, dtype, message):
    with pytest.raises(SpecError) as e:
        compile_source(HEAD.format(dtype=dtype), str(tmp_path / "q.mk"), None, tmp_path / "out")
    assert message in str(e.value)


SPEC = """
model nvdemo

const H = 256
const F = 2560
const V = 256

dim B in 1 .. 8

weight embed:   bf16[V, H]
weight w_a:     nvfp4[H, F]                        per layer
weight w_b:     nvfp4[F, H]                        per layer
weight w_c:     int4(group=128, scale=f32)[H, F]   per layer
weight w_d:     int4(group=64, scale=f32)[F, H]    per layer
weight lm_head: nvfp4[H, V]

layer mlp(x) {
  x = x + linear(silu(linear(x, w_a)), w_b)
  return x + linear(silu(linear(x, w_c)), w_d)
}

layers 2 { mlp: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


def test_nvfp4_and_f32_scaled_int4_stream_and_match_the_reference(tmp_path):
    """Two layers (each its own global scale), 2560-row matrices in five 512-row K tiles."""
    out, _ = compile_source(SPEC, str(tmp_path / "nv.mk"), None, tmp_path / "out")
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "nv_kernel")
    streams = {st.ref: st for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")}
    assert {n: st.fmt for n, st in streams.items()} == {
        "w_a": "nvfp4",
        "w_b": "nvfp4",
        "w_c": "int4_f32",
        "w_d": "int4_f32",
        "lm_head": "nvfp4",
    }
    assert streams["w_b"].nk == 5 and streams["w_d"].nk == 5
    assert module.WEIGHTS["w_a_global"][0] == (2, 1, 1)
    moved = {i.what: i.bytes for i in out.plan.schedule_items if i.graph == "mlp" and i.what.startswith("linear")}
    for name in ("w_c", "w_d"):
        t = out.model.tensor(name)
        assert moved[f"linear `{name}`"] == dtypes.storage_bytes(t.type.dtype, t.type.shape), name
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=1, seed=0)
    assert not result.failures, result.failures


# ---------------------------------------------------------------- NVFP4 from a ModelOpt-style checkpoint

CKPT_SPEC = """
model nvload
const H = 256
const L = 2
dim B in 1 .. 8
weight embed: bf16[512, H]
weight w: nvfp4[H, H] per layer
layer l(x) { return x + linear(x, w) }
layers L { l: otherwise }
step(tokens, positions) {
  logits = linear(layers(embedding(tokens, embed)), embed, transposed=true)
  return logits, argmax(logits)
}
checkpoint hf {
  embed = "embed" | round
  w = "layers.{l}.w.weight" * "layers.{l}.w.weight_scale" * "layers.{l}.w.weight_scale_2" | transpose
}
"""


def modelopt_nvfp4(codes: np.ndarray, scales: np.ndarray, glob: np.ndarray) -> dict:
    """One [K, N] nvfp4 matrix as NVIDIA ModelOpt stores it for a [out, in] = [N, K] linear:
    `weight` uint8 [N, K/2] (input 2j in the low nibble of byte j), `weight_scale` e4m3 [N, K/16],
    `weight_scale_2` the f32 global scale (a 0-d tensor)."""
    nib = nibbles(codes).T.astype(np.uint8)  # [N, K]
    return {
        "weight": np.ascontiguousarray(nib[:, 0::2] | (nib[:, 1::2] << 4)),
        "weight_scale": np.ascontiguousarray(scales.T),
        "weight_scale_2": np.asarray(glob, np.float32).reshape(()),
    }


def test_nvfp4_loads_exactly_from_a_modelopt_checkpoint(tmp_path):
    """The three stored tensors become the kernel's codes, scales and global scale bit for bit."""
    from safetensors.numpy import save_file

    import mkdsl

    path = tmp_path / "nvload.mk"
    path.write_text(CKPT_SPEC)
    spec = mkdsl.load(path)
    rng = np.random.default_rng(7)
    qs = [quantize(dtypes.NVFP4, rng.standard_normal((256, 256)).astype(np.float32) * (i + 1)) for i in range(2)]
    tensors = {"embed": rng.standard_normal((512, 256)).astype(np.float32)}
    for i, q in enumerate(qs):
        for name, a in modelopt_nvfp4(q.codes, q.scales, q.glob).items():
            tensors[f"layers.{i}.w.{name}"] = a
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded, _ = mkdsl.load_weights(spec, tmp_path / "model.safetensors", host=True, progress=False)
    w = loaded["w"]
    for i, q in enumerate(qs):
        np.testing.assert_array_equal(w.codes[i], q.codes)
        np.testing.assert_array_equal(w.scales[i].view(np.uint8), q.scales.view(np.uint8))
        np.testing.assert_array_equal(w.glob[i], q.glob)
    assert w.glob[0, 0, 0] != w.glob[1, 0, 0]  # each layer its own global scale


def test_nvfp4_mapping_needs_its_global_scale(tmp_path):
    text = CKPT_SPEC.replace(' * "layers.{l}.w.weight_scale_2"', "")
    with pytest.raises(SpecError) as e:
        compile_source(text, str(tmp_path / "q.mk"), None, tmp_path / "out")
    assert "which has a global scale: name it third" in str(e.value)
