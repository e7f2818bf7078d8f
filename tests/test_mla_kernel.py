"""`mla_attention` with many heads on one device: the absorption passes run as loops over groups
of heads (runtime/mla.py.jinja, `each_head`; above MLA_UNROLL_HEADS heads per device, which the
test lowers to 8), which the sharded mini kernels (2 or 1 heads per device) never reach. 18 heads: two groups of 8 in the loop and two heads after it; an fp8 w_kvb
with 128 x 128 scale squares (its scales indexed by the traced head). 16-token KV tiles over a
64-token cache, rows at positions 0 (the new token alone), 15 (the last token of tile 0), 16
(the first of tile 1) and 47: the tile loop's last tile is partly masked or wholly masked, and the
rows' tiles follow each other in one loop. The caches start random, so every cached entry counts.
The kernel runs in TPU interpret mode with the race detector, checked layer by layer against the
reference (mkdsl.verify.kernel's bounds)."""

from __future__ import annotations

from test_attention_kernel import run_checked

SPEC = """
model mla_heads
const H = 128
const V = 256
const NH = 18
const R = 128
const NOPE = 128
const XK = 64
dim B in 1 .. 4
dim S in 16 .. 64
weight embed:   bf16[V, H]
weight wq:      bf16[H, NH*(NOPE+XK)] per layer
weight wkva:    bf16[H, 256]          per layer
weight wkvb:    fp8_e4m3(block=128)[R, NH*(NOPE+128)] per layer
weight wo:      bf16[NH*128, H]       per layer
weight lm_head: bf16[H, V]
state latent:   bf16[B, S, R + XK] per layer
layer mla(x) {
  kv = linear(x, wkva)
  y = mla_attention(linear(x, wq), slice(kv, start=0, size=R), slice(kv, start=R, size=XK), wkvb, latent, pos,
                    heads=NH, nope=NOPE, extra=XK, vdim=128)
  return x + linear(y, wo)
}
layers 1 { mla: otherwise }
hints { kv_tile = 16 }
step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


def test_many_heads_on_one_device_match_the_reference(tmp_path):
    # MLA_UNROLL_HEADS = 8: the 18 heads take the head-group loop (above 128 heads per device in use)
    worst = run_checked(SPEC, "mla_heads", [0, 15, 16, 47], tmp_path, steps=2, patch={"MLA_UNROLL_HEADS": 8})
    assert worst["carries"] <= 1
