"""int4 with 128-input groups (bf16 and f32 scales) and NVFP4 `linear` matrices at Llama-3.1-8B widths
(hidden 4096, MLP 14336; the widths of its published NVFP4 and int4-AWQ checkpoints) compile with the
real TPU compiler (libtpu) for a compile-only TPU7x core. Interpret mode accepts DMA windows and
in-VMEM casts Mosaic may refuse (e4m3 scale tiles, the [1, 1] global-scale window, packed nibbles
bitcast to e2m1 and int4), so only this shows the layouts are ones the TPU compiler takes."""

from __future__ import annotations

import pytest
from compile_helpers import MIB, compile_one_core, tpu7x_devices

from mkdsl.compiler import compile_source
from mkdsl.verify import kernel as verify

SPEC = """
model q8b_linear

const H = 4096
const F = 14336
const V = 128256

dim B in 1 .. 8

weight embed:   bf16[V, H]
weight w_q:     int4(group=128)[H, H]             per layer
weight w_gate:  int4(group=128, scale=f32)[H, F]  per layer
weight w_up:    nvfp4[H, F]                       per layer
weight w_down:  nvfp4[F, H]                       per layer
weight lm_head: bf16[H, V]

layer lin(x) {
  x = x + linear(x, w_q)
  return x + linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)
}

layers 1 { lin: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


@pytest.mark.slow
def test_int4_group128_and_nvfp4_linears_at_llama_8b_widths_compile_for_tpu7x(tmp_path):
    out, _ = compile_source(SPEC, str(tmp_path / "q8b.mk"), None, tmp_path / "q8b")
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "q8b_kernel")
    fmts = {st.fmt for name, st in vars(module).items() if name.startswith("S_") and hasattr(st, "fmt")}
    assert {"int4", "int4_f32", "nvfp4"} <= fmts, fmts
    assert module.VMEM_LIMIT_BYTES <= 64 * MIB
    compiled, seconds = compile_one_core(module, tpu7x_devices("tpu7x:2x2x1")[0], 8, 256)
    assert compiled is not None, seconds
