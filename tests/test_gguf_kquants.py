"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as stored: the file's super-blocks moved into the spec
dtypes `q4_k`, `q5_k`, `q6_k` (mkdsl/lang/dtypes.py `storage`) decode, through the reference, to
the `gguf` package's values bit for bit; the checker names the super-block rule; a GGUF whose
bytes are built here loads into those dtypes (`| stored`) and `plan --weights` shows their bytes;
the kernel's in-VMEM decoders (TPU interpret mode) equal the reference and compile for TPU7x."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import mkdsl
from mkdsl.checkpoint import gguf_blocks
from mkdsl.checkpoint.pairs import BLOCKS, STORAGE
from mkdsl.lang import dtypes
from mkdsl.lang.quant import dequantize, from_storage, slot_of

KQUANTS = {"Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}  # bits per weight in the file


def kquant_bytes(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """A [rows, cols] K-quant tensor's bytes: random codes and packed sub-block scales (every
    byte value is legal), f16 d (and Q4_K/Q5_K's dmin) drawn finite and of a trained model's size
    (1e-4 .. 3e-3: sub-block steps of ~1e-3 .. 0.2), never zero."""
    per, size = gguf_blocks.SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    f16 = rng.uniform(1e-4, 3e-3, (rows, cols // per, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        raw[..., 208:210] = f16[..., 0:2]
    else:
        raw[..., 0:4] = f16
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", KQUANTS)
def test_kquant_storage_is_the_files_bytes_and_decodes_as_gguf(kind):
    """Stored [N, K] super-blocks -> the spec's [K, N] storage (transposed) -> the reference."""
    n, k = 24, 1024
    raw = kquant_bytes(kind, n, k, np.random.default_rng(3))
    dt = dtypes.GGUF[gguf_blocks.KEPT[kind]].dtype
    codes, head = BLOCKS[kind].unpack(raw)
    parts = STORAGE[dt.name](codes.T, head.T)
    assert [(p.shape, p.dtype) for p in dtypes.storage(dt, (k, n))] == [(a.shape, str(a.dtype)) for a in parts]
    assert dtypes.storage_bytes(dt, (k, n)) == raw.nbytes == KQUANTS[kind] * k * n / 8
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).T
    got = np.asarray(dequantize(from_storage(dt, list(parts))))
    assert np.isfinite(want).all() and np.count_nonzero(want) > 0.9 * want.size
    np.testing.assert_array_equal(got, want)  # exact: the same f16 fields and codes, in ggml's order


def test_kquant_k_off_its_super_blocks_is_a_diagnostic_with_the_reason(tmp_path, capsys):
    from mkdsl.cli import main

    path = tmp_path / "bad.mk"
    path.write_text(KSPEC.replace("weight w_a:     q4_k[H, F]", "weight w_a:     q4_k[192, F]"))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "the input dimension of q4_k weight `w_a` (192) must be a multiple of 256" in err, err
    assert "K-quant super-blocks are 256 inputs" in err, err
    path.write_text(KSPEC.replace("weight w_e:     q6_k[F, H]", "weight w_e:     q6_k[768, H]"))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "(768) must be a multiple of 512" in err and "keeps the f16 d of two in one word" in err, err
    path.write_text(KSPEC.replace("weight w_d:     q4_k[4096, H]", "weight w_d:     q6_k[4096, H]"))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "weight `w_d` has 4096 rows; streaming it in tiles needs a tile that divides it and suits q6_k" in err
    assert "q6_k streams all of K in one tile, at most 2048 inputs" in err, err


KSPEC = """
model kquant_demo

const H = 256
const F = 512
const V = 192

dim B in 1 .. 8

weight embed:   bf16[V, H]
weight w_a:     q4_k[H, F]    per layer
weight w_b:     q5_k[F, H]    per layer
weight w_c:     q5_k[H, 4096] per layer
weight w_d:     q4_k[4096, H] per layer
weight w_e:     q6_k[F, H]    per layer
weight lm_head: q4_k[H, V]

layer mlp(x) {
  x = x + linear(silu(linear(x, w_a)), w_b)
  x = x + linear(silu(linear(x, w_c)), w_d)
  return x + linear(silu(linear(x, w_a)), w_e)
}

layers 1 { mlp: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}

checkpoint gguf {
  embed   = "token_embd.weight" | round
  w_a     = "blk.{l}.a.weight" | transpose | stored
  w_b     = "blk.{l}.b.weight" | transpose | stored
  w_c     = "blk.{l}.c.weight" | transpose | stored
  w_d     = "blk.{l}.d.weight" | transpose | stored
  w_e     = "blk.{l}.e.weight" | transpose | stored
  lm_head = "output.weight" | transpose | stored
}
"""
# weight -> (GGUF name, its type in the file: every K-quant, at every K the kernel tiles)
FILE = {
    "w_a": ("blk.0.a.weight", "Q4_K"),
    "w_b": ("blk.0.b.weight", "Q5_K"),
    "w_c": ("blk.0.c.weight", "Q5_K"),
    "w_d": ("blk.0.d.weight", "Q4_K"),
    "w_e": ("blk.0.e.weight", "Q6_K"),
    "lm_head": ("output.weight", "Q4_K"),
}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """KSPEC declared in bf16 (its mapping says `| stored`) and a GGUF holding its matrices as
    K-quants whose bytes are built here ([out, in], as llama.cpp stores them)."""
    d = tmp_path_factory.mktemp("kq")
    spec = d / "k.mk"
    text = KSPEC
    for q in ("q4_k", "q5_k", "q6_k"):
        text = text.replace(f" {q}[", " bf16[")
    spec.write_text(text)
    rng = np.random.default_rng(11)
    model = mkdsl.load(spec).model
    w = gguf.GGUFWriter(str(d / "k.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", rng.standard_normal((192, 256)).astype(np.float32))
    raw = {}
    for name, (gg, kind) in FILE.items():
        k, n = model.tensor(name).type.shape
        raw[name] = kquant_bytes(kind, n, k, rng)
        w.add_tensor(gg, raw[name], raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return spec, d / "k.gguf", raw


def test_the_loader_keeps_kquants_as_stored(kquant_gguf):
    spec_path, path, raw = kquant_gguf
    spec = mkdsl.load(spec_path, weights=path)
    assert {t.name: str(t.type.dtype) for t in spec.model.weights if t.type.dtype.gguf} == {
        n: gguf_blocks.KEPT[k] for n, (_, k) in FILE.items()
    }
    loaded, report = mkdsl.load_weights(spec, path, host=True, progress=False)
    assert dict(report.rounded) == {"F32": 1}  # only the embedding
    for name, (_, kind) in FILE.items():
        w = loaded[name] if name == "lm_head" else slot_of(loaded[name], 0)
        assert dtypes.storage_bytes(dtypes.GGUF[w.fmt].dtype, tuple(reversed(raw[name].shape))) != 0
        assert sum(a.nbytes for a in (w.codes, w.scales, *w.extra)) == raw[name].nbytes  # the file's bytes
        if name in ("w_b", "w_d", "w_e"):  # one of each format decoded (all of them: the storage test above)
            want = gguf.quants.dequantize(raw[name], gguf.GGMLQuantizationType[kind])
            np.testing.assert_array_equal(np.asarray(dequantize(w)).T, want)


def test_plan_with_weights_shows_the_kquant_bytes(kquant_gguf, capsys):
    from mkdsl.cli import main

    spec_path, path, raw = kquant_gguf
    assert main(["plan", str(spec_path), "--weights", str(path), "--json"]) == 0
    err = capsys.readouterr().err
    stored = sum(a.nbytes for a in raw.values())
    values = sum(8 * a.nbytes / KQUANTS[FILE[n][1]] for n, a in raw.items())
    assert "kept as stored: 3 q4_k, 2 q5_k, 1 q6_k weights" in err, err
    assert f"{stored / 2**20:.1f} MiB ({8 * stored / values:.2f} bits per weight)" in err, err


@pytest.mark.slow
def test_the_kernel_decodes_kquant_tiles_as_the_reference(tmp_path):
    """Each K-quant through the weight ring: whole-K tiles of 1 and 2 super-blocks, two K tiles
    of 8 (w_d, K = 4096), column tiles of 512 (w_c) and a padded width (lm_head, 192)."""
    from mkdsl.compiler import compile_source
    from mkdsl.verify import kernel as verify

    out, _ = compile_source(KSPEC, str(tmp_path / "k.mk"), None, tmp_path / "k")
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "kquant_demo_kernel")
    streams = {st.ref: st for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")}
    assert {st.fmt for st in streams.values()} == {"q4_k", "q5_k", "q6_k"}
    assert streams["w_d"].tk == 2048 and streams["w_d"].k == 4096, streams["w_d"]
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=1, seed=0)
    assert not result.failures, result.failures


@pytest.mark.slow
def test_kquant_kernel_compiles_for_tpu7x(tmp_path):
    """Mosaic's layout rules only show here (it refused a strided load of a 512-lane ring bank)."""
    from compile_helpers import compile_one_core, tpu7x_devices

    from mkdsl.compiler import compile_source
    from mkdsl.verify import kernel as verify

    out, _ = compile_source(KSPEC, str(tmp_path / "k.mk"), None, tmp_path / "k")
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "kquant_demo_compile")
    compiled, seconds = compile_one_core(module, tpu7x_devices("tpu7x:2x2x1")[0], 8, 256)
    assert compiled is not None, seconds
