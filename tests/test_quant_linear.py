"""Quantised and fp8 `linear` matrices: the reference's decoders against float64 decoders written
here from the published formats, and the kernel's in-VMEM decoders (TPU interpret mode) against
the reference through the weight ring."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mkdsl.compiler import compile_source
from mkdsl.lang import dtypes
from mkdsl.lang.quant import dequantize, quantize
from mkdsl.verify import kernel as verify

# ---------------------------------------------------------------- float64 decoders, from the formats


def nibbles(codes: np.ndarray) -> np.ndarray:
    """uint32 [K/8, N] -> [K, N]: input 8w + i is bits 4i .. 4i+3 of word w."""
    k8, n = codes.shape
    out = np.zeros((k8 * 8, n), np.int64)
    for i in range(8):
        out[i::8] = (codes.astype(np.int64) >> (4 * i)) & 0xF
    return out


def e2m1(n: int) -> float:
    """OCP MX E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if n & 8 else 1.0
    e, m = (n >> 1) & 3, n & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def minifloat(byte: int, exp_bits: int, man_bits: int, bias: int) -> float:
    """An IEEE-style minifloat from its bits (fp8 E4M3 has no infinities; its top code is NaN)."""
    sign = -1.0 if byte >> (exp_bits + man_bits) else 1.0
    e, m = (byte >> man_bits) & ((1 << exp_bits) - 1), byte & ((1 << man_bits) - 1)
    if e == 0:
        return sign * m / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)


FP8_BITS = {"fp8_e4m3": (4, 3, 7), "fp8_e5m2": (5, 2, 15)}


def decode64(dt: dtypes.DType, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    if dt.name == "mxfp4":
        vals = np.array([e2m1(n) for n in range(16)])[nibbles(codes)]
        scale = np.array([math.ldexp(1.0, b - 127) for b in range(256)])[scales]
    elif dt.name == "int4":
        nib = nibbles(codes)
        vals, scale = np.where(nib >= 8, nib - 16, nib).astype(np.float64), scales.astype(np.float64)
    elif dt.name == "int8":
        vals, scale = codes.astype(np.float64), scales.astype(np.float64)
    else:
        bits = codes.view(np.uint8)
        table = np.array([minifloat(b, *FP8_BITS[dt.name]) for b in range(256)])
        vals, scale = table[bits], scales.astype(np.float64)
    if dt.block:
        k, n = vals.shape
        full = np.repeat(np.repeat(scale, dt.block, 0), dt.block, 1)[:k, :n]
        return vals * full
    return vals * np.repeat(scale, dt.group, axis=0)


FORMATS = [
    dtypes.MXFP4,
    dtypes.int4(32),
    dtypes.int4(128),
    dtypes.int8(64),
    dtypes.int8(256),
    dtypes.fp8("fp8_e4m3", group=128),
    dtypes.fp8("fp8_e5m2", group=256),
    dtypes.fp8("fp8_e4m3", block=128),
    dtypes.fp8("fp8_e5m2", block=128),
]


@pytest.mark.parametrize("dt", FORMATS, ids=str)
def test_reference_decoder_matches_the_published_format(dt):
    w = np.random.default_rng(1).standard_normal((256, 200)).astype(np.float32) * 3
    q = quantize(dt, w)
    parts = dtypes.storage(dt, w.shape)
    assert [(p.shape, str(p.dtype)) for p in parts] == [
        (q.codes.shape, str(q.codes.dtype)),
        (q.scales.shape, str(q.scales.dtype)),
    ]
    want = decode64(dt, np.asarray(q.codes), np.asarray(q.scales))
    got = np.asarray(dequantize(q))
    # exact: each value is one product of two f32 numbers, correctly rounded to f32 (the f64
    # product of a <= 8-bit code and a 24-bit scale is exact, so rounding it once is what f32 does)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    # and the rounding to the format is a quantisation, not garbage: within half a scale step
    assert np.abs(got - w).max() <= 0.75 * np.abs(w).max()


def test_edge_blocks_of_block_scales_cover_what_is_left():
    dt = dtypes.fp8("fp8_e4m3", block=128)
    assert [p.shape for p in dtypes.storage(dt, (7, 576, 1536))] == [(7, 576, 1536), (7, 5, 12)]
    assert str(dt) == "fp8_e4m3(block=128)" and str(dtypes.int8(4096)) == "int8(group=4096)"


# ---------------------------------------------------------------- the kernel, in TPU interpret mode

QSPEC = """
model qdemo

const H = 256
const F = 512
const V = 256

dim B in 1 .. 8

weight embed:   bf16[V, H]
weight w_a:     mxfp4[H, F]                per layer
weight w_b:     int4(group=128)[F, H]      per layer
weight w_c:     fp8_e4m3(block=128)[H, F]  per layer
weight w_d:     int8(group=F)[F, H]        per layer
weight w_e:     fp8_e4m3(group=128)[H, H]  per layer
weight w_f:     fp8_e5m2[H, H]             per layer
weight lm_head: fp8_e4m3(block=128)[H, V]

layer mlp(x) {
  x = x + linear(silu(linear(x, w_a)), w_b)
  x = x + linear(silu(linear(x, w_c)), w_d)
  return x + linear(linear(x, w_e), w_f)
}

layers 1 { mlp: otherwise }

hints { tile_n = 256 }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


def _compiled(text: str, tmp_path, name: str):
    out, _ = compile_source(text, str(tmp_path / f"{name}.mk"), None, tmp_path / name)
    return out


def test_every_weight_format_streams_and_matches_the_reference(tmp_path):
    out = _compiled(QSPEC, tmp_path, "qdemo")
    kernel = out.files["kernel.py"]
    assert "QStream(" in kernel and "only bf16" not in kernel
    module = verify.import_generated(kernel, tmp_path, "qdemo_kernel")
    fmts = {st.fmt for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")}
    assert fmts == {"mxfp4", "int4", "block", "group", "cast"}, fmts
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=1, seed=0)
    assert not result.failures, result.failures


def test_the_plan_streams_storage_bytes(tmp_path):
    out = _compiled(QSPEC, tmp_path, "qdemo")
    m, plan = out.model, out.plan
    moved = {i.what: i.bytes for i in plan.schedule_items if i.graph == "mlp" and i.what.startswith("linear")}
    for name in ("w_a", "w_b", "w_d", "w_e", "w_f"):
        t = m.tensor(name)
        assert moved[f"linear `{name}`"] == dtypes.storage_bytes(t.type.dtype, t.type.shape), name
    # block scales come as whole rows of squares, once per column block (2 of 256 here): 2 x 32 B
    assert moved["linear `w_c`"] == 256 * 512 + 2 * (2 * 4 * 4)
    rings = {a.name: a for a in plan.vmem if a.name.startswith("ring")}
    # 8 rows of E8M0 scales are no whole 32-row 8-bit tile: an array of exactly those rows (`TilePart.ring_for`)
    assert {"ring", "ring_uint32", "ring_scales_uint8_8", "ring_float8_e4m3fn", "ring_float8_e5m2", "ring_int8"} <= set(
        rings
    )
    assert rings["ring_scales2"].shape[1:] == (2, 2) and rings["ring_scales_float32_2"].shape[1:] == (2, 256)


PADDED = """
model padn

const H  = 576
const KV = 192
const V  = 400
const F  = 256

dim B in 1 .. 8

mesh { tp = 2 }

weight embed:   bf16[V @tp, H]
weight w_kv:    int8(group=H)[H, KV @tp]   per layer
weight w_up:    bf16[H, F]                 per layer
weight w_q:     fp8_e4m3(block=128)[F, KV] per layer
weight w_o:     bf16[KV, H]                per layer
weight w_p:     bf16[KV @tp, H]            per layer

layer mix(x) {
  return x + linear(silu(linear(x, w_kv)), w_p) + linear(linear(linear(x, w_up), w_q), w_o)
}

layers 1 { mix: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, embed, transposed=true)
  return logits, argmax(logits)
}
"""


def test_padded_outputs_a_tied_head_and_a_split_vocabulary_match_the_reference(tmp_path):
    """Widths that are not whole 128-lane tiles (hidden 576, KV 192, 96 KV columns and 200
    vocabulary rows per device) are stored padded per device and computed padded; consumers see
    the valid width. The tied head streams the [V, H] embedding transposed, and its
    vocabulary-split logits stay split (no all-gather): argmax combines the devices' bests."""
    out = _compiled(PADDED, tmp_path, "padn")
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "padn_kernel")
    assert module.PADDED == {
        "embed": ((-2, 200, 256, 2),),
        "w_kv_codes": ((-1, 96, 128, 2),),
        "w_kv_scales": ((-1, 96, 128, 2),),
        "w_q_codes": ((-1, 192, 256, 1),),
        "w_o": ((-1, 576, 640, 1),),
        "w_p": ((-1, 576, 640, 1),),
    }
    assert module.WEIGHTS["embed"][0] == (512, 576) and module.LOCAL_WEIGHTS["embed"] == (256, 576)
    assert module.WEIGHTS["w_q_scales"][0] == (1, 2, 2)  # block scales already cover the padding
    assert module.LOGITS_SPLIT == "tp"
    ops = {n.op for g in (*out.local.kinds, out.local.step) for n in g.nodes}
    assert "all_gather" not in ops
    padded = np.asarray(module.pad_weights({"embed": np.ones((400, 576), np.float32)})["embed"])
    assert padded.shape == (512, 576) and padded[:200].all() and not padded[200:256].any()
    assert padded[256:456].all() and not padded[456:].any()
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=1, seed=0)
    assert not result.failures, result.failures


# ---------------------------------------------------------------- HBM capacity per device

BIG = """
model big

const H = 8192
const F = 32768
const V = 256

dim B in 1 .. 8

MESH

weight embed:   bf16[V, H]
weight w_up:    fp8_e4m3(block=128)[H, F SPLIT] per layer
weight w_down:  bf16[F SPLIT, H]                per layer
weight lm_head: bf16[H, V]

layers 128 { mlp: otherwise }

layer mlp(x) {
  return x + linear(silu(linear(x, w_up)), w_down)
}

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  return linear(x, lm_head), argmax(linear(x, lm_head))
}
"""


def test_hbm_capacity_is_checked_per_device(tmp_path):
    from mkdsl.lang.diagnostics import SpecError

    one = BIG.replace("MESH", "").replace(" SPLIT", "")
    with pytest.raises(SpecError) as err:
        _compiled(one, tmp_path, "big")
    text = err.value.render("big.mk", one)
    # per layer: 8192 x 32768 fp8 codes (268.4 MB) + 64 x 256 f32 scales + 8192 x 32768 bf16 (536.9 MB)
    assert "HBM capacity exceeded on one device: weights and state (batch 8, shortest cache) need 103.10 GB" in text
    assert (
        "the largest: weight `w_down` 68.72 GB, weight `w_up` 34.37 GB, weight `embed` 4.19 MB" in text
        and "big.mk:14:8" in text
    )
    assert len(err.value.diagnostics) == 1, text
    split = BIG.replace("MESH", "mesh { tp = 2 }").replace(" SPLIT", " @tp")
    out = _compiled(split, tmp_path, "big2")  # half of each matrix per device: fits
    assert 51.5e9 < out.plan.hbm_bytes < 51.6e9
    assert "| HBM per device | 51.5" in out.files["plan.md"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_weight_format_compiles_with_libtpu(tmp_path):
    """The same formats compiled for one TPU7x core by the real compiler: each tile part whose rows
    are not whole tiles of its dtype (8 rows of E8M0 scales, 4 of int4's bf16 scales, 1 and 2 of
    f32 group scales) has a ring array of exactly those rows (`TilePart.ring_for`)."""
    from compile_helpers import compile_one_core, load_module, tpu7x_devices

    from mkdsl.backends.tpu.libtpu import topology_for

    out = _compiled(QSPEC, tmp_path, "qdemo")
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    module = load_module(path, "qdemo_libtpu")
    compiled, _ = compile_one_core(module, tpu7x_devices(topology_for(module))[0], 8, 256)
    assert compiled is not None
