"""GGUF block formats: mkdsl's own decoder (mkdsl/checkpoint/gguf_blocks.py) against the `gguf`
package's dequantizer (an independent oracle), Q8_0/Q4_0/Q4_1 kept as stored (the loader moves
the file's blocks into the kernel's storage bit for bit; the reference decodes them to the same
f32 values), `| stored` retyping a spec for the file, the kernel's in-VMEM decoders (TPU
interpret mode) against the reference, and SmolLM2 at its published width in Q4_1 compiled by
libtpu."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from checkpoint_writers import gguf_tensors, llama_cpp_permute, write_gguf

import mkdsl
from mkdsl.checkpoint import gguf_blocks
from mkdsl.checkpoint.formats import CheckpointError
from mkdsl.checkpoint.pairs import BLOCKS, STORAGE
from mkdsl.lang import dtypes
from mkdsl.lang.quant import QTensor, dequantize

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "specs" / "smollm2_135m.mk"
KEPT = ["Q8_0", "Q4_0", "Q4_1"]
MATRICES = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]


def _blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Stored bytes of a [rows, cols] tensor: quantised by gguf where it can (Q8_0, Q4_x), else
    random bytes with finite f16 fields (gguf has no K-quant quantizer): every code is legal."""
    if kind in KEPT:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])
    per, size = gguf_blocks.SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    f16 = (rng.standard_normal((rows, cols // per, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        raw[..., 208:210] = f16[..., 0:2]
    else:
        raw[..., 0:4] = f16
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", [*KEPT, "Q4_K", "Q5_K", "Q6_K"])
def test_our_block_decoder_equals_the_gguf_dequantizer(kind):
    raw = _blocks(kind, 6, 512, np.random.default_rng(0))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    got = gguf_blocks.decode(raw, kind, (6, 512))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    # exact: both multiply the same f16 fields and codes in f32, in ggml's order
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", KEPT)
def test_kept_blocks_are_the_files_bytes_and_decode_to_its_values(kind):
    """Stored [N, K] blocks -> the spec's [K, N] storage (transposed) -> the reference's decode."""
    n, k = 40, 256
    raw = _blocks(kind, n, k, np.random.default_rng(1))
    dt = dtypes.GGUF[gguf_blocks.KEPT[kind]].dtype
    codes, words = BLOCKS[kind].unpack(raw)
    q = QTensor(*STORAGE[dt.name](codes.T, words.T), dt.fmt, dt.group)
    assert [(p.shape, p.dtype) for p in dtypes.storage(dt, (k, n))] == [
        (q.codes.shape, str(q.codes.dtype)),
        (q.scales.shape, str(q.scales.dtype)),
    ]
    assert dtypes.storage_bytes(dt, (k, n)) == raw.nbytes  # 8.5, 4.5 and 5 bits per weight, as the file
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).T
    np.testing.assert_array_equal(np.asarray(dequantize(q)), want)


@pytest.fixture(scope="module")
def mini_gguf(tmp_path_factory):
    """SmolLM2 at its mini profile written as llama.cpp writes it: Q4_1 matrices, a Q8_0 embedding."""
    spec = mkdsl.load(SMOLLM2, "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=64, seed=5)
    c = spec.model.const
    tensors = gguf_tensors(weights, 2, c["NH"], c["NKV"])
    path = tmp_path_factory.mktemp("gguf") / "mini.gguf"
    write_gguf(path, tensors, block_count=2)
    return path, c


def test_stored_keeps_q4_1_bit_for_bit(mini_gguf):
    path, c = mini_gguf
    spec = mkdsl.load(SMOLLM2, "mini", weights=path)
    assert {t.name: str(t.type.dtype) for t in spec.model.weights if t.type.dtype.quantised} == dict.fromkeys(
        MATRICES, "q4_1"
    )
    loaded, report = mkdsl.load_weights(spec, path, host=True, progress=False)
    assert dict(report.rounded) == {"Q8_0": 1, "F32": 5}  # the embedding (also the tied head) and norms
    r = gguf.GGUFReader(str(path))
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors}
    names = {"wq": "attn_q", "wv": "attn_v", "w_down": "ffn_down"}
    for name, gg in names.items():
        for layer in range(2):
            w = loaded[name]
            got = np.asarray(dequantize(QTensor(w.codes[layer], w.scales[layer], w.fmt, w.group))).T
            if name == "wq":  # the loader undid llama.cpp's q row permutation; redo it
                got = llama_cpp_permute(got, c["NH"])
            np.testing.assert_array_equal(got, stored[f"blk.{layer}.{gg}.weight"])


def test_without_the_file_stored_rounds_and_a_wrong_format_is_named(mini_gguf, tmp_path):
    path, _ = mini_gguf
    _, report = mkdsl.load_weights(mkdsl.load(SMOLLM2, "mini"), path, host=True, progress=False)
    assert report.rounded["Q4_1"] == 14  # declared bf16, not retyped: `stored` rounds as `round`
    text = SMOLLM2.read_text().replace("weight wv:         bf16", "weight wv:         q8_0")
    assert text != SMOLLM2.read_text()
    other = tmp_path / "q8.mk"
    other.write_text(text)
    with pytest.raises(
        CheckpointError, match=r"`blk\.0\.attn_v\.weight` is Q4_1 \[64, 192\]; the spec's q8_0 holds Q8_0"
    ):
        mkdsl.load_weights(mkdsl.load(other, "mini"), path, host=True, progress=False)


def test_plan_with_weights_shows_the_stored_bytes(mini_gguf, capsys):
    from mkdsl.cli import main

    path, c = mini_gguf
    assert main(["plan", str(SMOLLM2), "--profile", "mini", "--weights", str(path), "--json"]) == 0
    err = capsys.readouterr().err
    assert "kept as stored: 7 q4_1 weights" in err and "(5.00 bits per weight)" in err, err


def test_a_stored_weight_its_ops_cannot_take_quantised_is_an_error_naming_stored(mini_gguf, tmp_path, capsys):
    from mkdsl.cli import main

    path, _ = mini_gguf
    text = SMOLLM2.read_text()
    spec = tmp_path / "emb.mk"
    spec.write_text(text.replace('"token_embd.weight" | round', '"token_embd.weight" | stored'))
    assert spec.read_text() != text
    assert main(["plan", str(spec), "--profile", "mini", "--weights", str(path)]) == 1
    err = capsys.readouterr().err
    assert "embedding table `embed` must not be quantised" in err and "`| stored` declared `embed` as q8_0" in err, err


GSPEC = """
model gguf_demo

const H = 256
const F = 512
const V = 256

dim B in 1 .. 8

weight embed:   bf16[V, H]
weight w_a:     q4_1[H, F]   per layer
weight w_b:     q8_0[F, H]   per layer
weight w_c:     q4_0[H, 192] per layer
weight w_d:     q4_1[192, H] per layer
weight lm_head: q4_0[H, V]

layer mlp(x) {
  x = x + linear(silu(linear(x, w_a)), w_b)
  return x + linear(linear(x, w_c), w_d)
}

layers 1 { mlp: otherwise }

hints { tile_n = 256 }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


@pytest.mark.slow
def test_the_kernel_decodes_gguf_tiles_as_the_reference(tmp_path):
    """Every kept format through the weight ring, a padded width (192) and a K of 6 block rows."""
    from mkdsl.compiler import compile_source
    from mkdsl.verify import kernel as verify

    out, _ = compile_source(GSPEC, str(tmp_path / "g.mk"), None, tmp_path / "g")
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "gguf_demo_kernel")
    fmts = {st.fmt for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")}
    assert fmts == {"q8_0", "q4_0", "q4_1"}, fmts
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=1, seed=0)
    assert not result.failures, result.failures


@pytest.mark.slow
def test_smollm2_in_q4_1_at_published_width_compiles_for_tpu7x(tmp_path):
    """Mosaic's layout rules (a whole K of 576 is 18 rows of block words) only show here."""
    from compile_helpers import MIB, compile_one_core, tpu7x_devices

    from mkdsl.checkpoint.stored import retype
    from mkdsl.compiler import compile_source
    from mkdsl.verify import kernel as verify

    spec = mkdsl.load(SMOLLM2)
    source = retype(spec.source, spec.model, dict.fromkeys(MATRICES, "q4_1"))
    out, _ = compile_source(source, str(tmp_path / "s.mk"), None, tmp_path / "s")
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "smollm2_q4_1_kernel")
    assert "ring_gguf_words18" in out.files["kernel.py"]
    assert module.VMEM_LIMIT_BYTES <= 64 * MIB
    compiled, seconds = compile_one_core(module, tpu7x_devices("tpu7x:2x2x1")[0], 8, 256)
    assert compiled is not None, seconds


# llama.cpp's qwen2 names (convert_hf_to_gguf keeps q/k rows in Hugging Face's order for it):
# spec weight -> (GGUF name, a matrix stored [out, in]).
QWEN2_GGUF = {
    "embed": ("token_embd.weight", False),
    "attn_norm": ("blk.{l}.attn_norm.weight", False),
    "wq": ("blk.{l}.attn_q.weight", True),
    "bq": ("blk.{l}.attn_q.bias", False),
    "wk": ("blk.{l}.attn_k.weight", True),
    "bk": ("blk.{l}.attn_k.bias", False),
    "wv": ("blk.{l}.attn_v.weight", True),
    "bv": ("blk.{l}.attn_v.bias", False),
    "wo": ("blk.{l}.attn_output.weight", True),
    "mlp_norm": ("blk.{l}.ffn_norm.weight", False),
    "w_gate": ("blk.{l}.ffn_gate.weight", True),
    "w_up": ("blk.{l}.ffn_up.weight", True),
    "w_down": ("blk.{l}.ffn_down.weight", True),
    "final_norm": ("output_norm.weight", False),
    "lm_head": ("output.weight", True),
}


def test_qwen2_5_loads_a_gguf_in_llama_cpps_layout(tmp_path):
    """Q8_0 matrices (the embedding too), f32 norms and biases, decoded and rounded to bf16."""
    import ml_dtypes

    spec = mkdsl.load(ROOT / "specs" / "qwen2_5_7b.mk", "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=64, seed=7)
    tensors = {}
    for name, (gg, matrix) in QWEN2_GGUF.items():
        w = np.asarray(weights[name]).astype(np.float32)
        for layer in range(2) if "{l}" in gg else [None]:
            x = w[layer] if layer is not None else w
            tensors[gg.format(l=layer)] = (np.ascontiguousarray(x.T if matrix else x), "Q8_0" if x.ndim == 2 else "F32")
    write_gguf(tmp_path / "q.gguf", tensors, block_count=2)
    loaded, report = mkdsl.load_weights(spec, tmp_path / "q.gguf", host=True, progress=False)
    assert dict(report.rounded) == {"Q8_0": 1 + 7 * 2 + 1, "F32": 5 * 2 + 1}
    for name, (gg, matrix) in QWEN2_GGUF.items():
        for layer in range(2) if "{l}" in gg else [None]:
            x, kind = tensors[gg.format(l=layer)]
            if kind == "Q8_0":  # the oracle's decode of the blocks the writer made
                q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
                x = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            want = (x.T if matrix else x).astype(ml_dtypes.bfloat16)
            got = loaded[name][layer] if layer is not None else loaded[name]
            assert np.array_equal(got, want), (name, layer)


def test_phi3_loads_a_gguf_with_its_fused_qkv_and_gate_up(tmp_path):
    """llama.cpp's phi3 tensors: `attn_qkv` [3 x NH*D, H] and `ffn_up` [2F, H] (gate rows first)."""
    import ml_dtypes

    spec = mkdsl.load(ROOT / "specs" / "phi3_mini_4k.mk", "mini")
    w, _ = mkdsl.random_inputs(spec, batch=1, seq_len=64, seed=9)
    w = {n: np.asarray(x).astype(np.float32) for n, x in w.items()}
    tensors = {
        "token_embd.weight": (w["embed"], "Q8_0"),
        "output_norm.weight": (w["final_norm"], "F32"),
        "output.weight": (np.ascontiguousarray(w["lm_head"].T), "Q8_0"),
    }
    for i in range(2):
        qkv = np.concatenate([w["wq"][i].T, w["wk"][i].T, w["wv"][i].T])
        tensors |= {
            f"blk.{i}.attn_norm.weight": (w["attn_norm"][i], "F32"),
            f"blk.{i}.attn_qkv.weight": (qkv, "Q8_0"),
            f"blk.{i}.attn_output.weight": (np.ascontiguousarray(w["wo"][i].T), "Q8_0"),
            f"blk.{i}.ffn_norm.weight": (w["mlp_norm"][i], "F32"),
            f"blk.{i}.ffn_up.weight": (np.concatenate([w["w_gate"][i].T, w["w_up"][i].T]), "Q8_0"),
            f"blk.{i}.ffn_down.weight": (np.ascontiguousarray(w["w_down"][i].T), "Q8_0"),
        }
    write_gguf(tmp_path / "p.gguf", tensors, block_count=2)
    loaded, report = mkdsl.load_weights(spec, tmp_path / "p.gguf", host=True, progress=False)

    def q8(x):  # the oracle's decode of the blocks the writer made
        t = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(x), t), t)

    def bf16(x):
        return np.asarray(x).astype(ml_dtypes.bfloat16)

    nh = w["wq"].shape[-1]
    f = w["w_gate"].shape[-1]
    for i in range(2):
        qkv = q8(tensors[f"blk.{i}.attn_qkv.weight"][0])
        up = q8(tensors[f"blk.{i}.ffn_up.weight"][0])
        assert np.array_equal(loaded["wk"][i], bf16(qkv[nh : 2 * nh].T))
        assert np.array_equal(loaded["wv"][i], bf16(qkv[2 * nh :].T))
        assert np.array_equal(loaded["w_gate"][i], bf16(up[:f].T)) and np.array_equal(loaded["w_up"][i], bf16(up[f:].T))
        assert np.array_equal(loaded["attn_norm"][i], bf16(w["attn_norm"][i]))
    assert np.array_equal(loaded["lm_head"], bf16(q8(w["lm_head"].T).T))
    # counted per weight read: the fused qkv feeds three, ffn_up two
    assert dict(report.rounded) == {"Q8_0": 2 + (3 + 1 + 2 + 1) * 2, "F32": 2 * 2 + 1}
