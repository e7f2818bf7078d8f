"""A per-head weight `[NH]` split over tp devices and widened over the head dim
(`repeat(w, each=D)`, issue 27), as Mamba2's D skip and Llama 4's per-head scales use it: each
device holds its own heads' entries and widens them to its own [NH/tp * D] slice. The kernel,
sharded over 2 devices in TPU interpret mode (race detector on), against the reference, on
random weights (so a device reading another's heads, or widening by lane instead of by head,
differs from the reference)."""

from __future__ import annotations

import pytest

from mkdsl.compiler import compile_source
from mkdsl.verify import kernel as verify

SPEC = """
model headsplit

const H  = 256
const NH = 4
const D  = 64
const V  = 256

dim B in 1 .. 8

mesh { tp = 2 }

weight embed:      bf16[V, H]
weight wq:         bf16[H, NH*D @tp]  per layer
weight head_scale: bf16[NH @tp]       per layer
weight wo:         bf16[NH*D @tp, H]  per layer
weight lm_head:    bf16[H, V]

layer mix(x) {
  a = silu(linear(x, wq))
  return x + linear(a * repeat(head_scale, each=D), wo)
}

layers 2 { mix: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


@pytest.mark.slow  # ~13 s: two devices in TPU interpret mode
@pytest.mark.timeout(600)
def test_split_per_head_weight_matches_the_reference(tmp_path):
    out, _ = compile_source(SPEC, str(tmp_path / "headsplit.mk"), None, None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "headsplit_kernel")
    assert module.MESH_SHAPE == (2,) and module.LOCAL_WEIGHTS["head_scale"] == (2, 2)  # [layers, NH / tp]
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=2, steps=2, seed=5)
    assert not result.failures, result.failures
