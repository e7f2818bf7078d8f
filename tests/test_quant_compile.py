"""fp8 block-scaled `linear` at DeepSeek-V3 sizes compiles with the real TPU compiler (libtpu) for a
compile-only TPU7x core: hidden 7168, q_a 1536 and q_b back, kv_a 576 (padded to 640 columns) and
kv_b from its 512-wide latent, all fp8 e4m3 with 128x128 f32 block scales, and the bf16 head over
DeepSeek-V3's 129280-token vocabulary. Interpret mode accepts DMA
windows Mosaic rejects (narrow windows at dynamic lane offsets, HBM to SMEM), so only this test
shows the block scales' layout in VMEM is one the TPU compiler takes."""

from __future__ import annotations

from compile_helpers import MIB, compile_one_core, tpu7x_devices

from mkdsl.compiler import compile_source
from mkdsl.verify import kernel as verify

SPEC = """
model ds_linear

const H  = 7168
const QA = 1536
const KV = 576
const R  = 512
const V  = 129280

dim B in 1 .. 8

weight embed:   bf16[V, H]
weight q_a:     fp8_e4m3(block=128)[H, QA] per layer
weight q_b:     fp8_e4m3(block=128)[QA, H] per layer
weight kv_a:    fp8_e4m3(block=128)[H, KV] per layer
weight kv_b:    fp8_e4m3(block=128)[R, H]  per layer
weight lm_head: bf16[H, V]

layer lin(x) {
  return x + linear(linear(x, q_a), q_b) + linear(slice(linear(x, kv_a), start=0, size=R), kv_b)
}

layers 1 { lin: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


def test_deepseek_v3_sized_fp8_block_scaled_linear_compiles_for_tpu7x(tmp_path):
    out, _ = compile_source(SPEC, str(tmp_path / "ds.mk"), None, tmp_path / "ds")
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "ds_kernel")
    assert module.PADDED == {"kv_a_codes": ((-1, 576, 640, 1),)}
    assert module.VMEM_LIMIT_BYTES <= 64 * MIB
    compiled, seconds = compile_one_core(module, tpu7x_devices("tpu7x:2x2x1")[0], 8, 256)
    assert compiled is not None, seconds
