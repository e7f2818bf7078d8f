"""A Gated DeltaNet decoder (Qwen3-Next's linear-attention mixer, two layers, sharded over 2
devices) as a generated megakernel against the unfused reference, in TPU interpret mode.

What it exercises beyond KDA: two value heads per key head (`recurrent(..., key_heads=)`), one
decay per head composed from elementwise ops (`-exp(a_log) * softplus(a + dt_bias)`), the gated
per-head output norm `rmsnorm(o, w, heads=) * silu(z)`, and the key-heads shard rule (each device
holds 2 key heads and their 4 value heads). Interpret mode runs with the race detector on; each of 3
steps is checked layer by layer by `mkdsl.verify.kernel` (bounds derived there), at batch 4 (rows are
static loops in the kernel: batch 1 is the first of them; tests/test_qwen3_next.py runs batch 1).

The fast tests check the shard pass's per-device attributes and its diagnostic for key heads that
do not split. Cost: the kernel run ~25 s on the idle 2-core dev machine, ~70 s when it is busy
(slow-marked).
"""

from __future__ import annotations

import pytest

from mkdsl.compiler import compile_source
from mkdsl.lang.diagnostics import SpecError
from mkdsl.lang.elaborate import elaborate, graph_value_type
from mkdsl.lang.syntax import parse
from mkdsl.spmd.shard import shard
from mkdsl.verify import kernel as verify

SPEC = """\
model gdn_small

const L = 2
const H = 256
const NK = 4       # key heads
const NV = 8       # value heads: 2g and 2g+1 read key head g
const D = 128
const CONV = 4
const F = 256
const V = 512
const BA = 128     # the [beta | a] projection: 2*NV columns stored padded to a lane tile
const EPS = 0.000001
const TP = 2

mesh { tp = TP }

dim B in 1 .. 8
dim S in 1 .. 256

weight embed:       bf16[V, H]
weight norm1:       bf16[H]                 per layer
weight gdn_wq:      bf16[H, NK*D @tp]       per layer
weight gdn_wk:      bf16[H, NK*D @tp]       per layer
weight gdn_wv:      bf16[H, NV*D @tp]       per layer
weight gdn_wz:      bf16[H, NV*D @tp]       per layer
weight gdn_wba:     bf16[H, BA]             per layer
weight gdn_conv_q:  bf16[CONV, NK*D @tp]    per layer
weight gdn_conv_k:  bf16[CONV, NK*D @tp]    per layer
weight gdn_conv_v:  bf16[CONV, NV*D @tp]    per layer
weight gdn_a_log:   f32[NV]                 per layer
weight gdn_dt_bias: f32[NV]                 per layer
weight gdn_norm:    bf16[D]                 per layer
weight gdn_wo:      bf16[NV*D @tp, H]       per layer
weight norm2:       bf16[H]                 per layer
weight w_gate:      bf16[H, F @tp]          per layer
weight w_up:        bf16[H, F @tp]          per layer
weight w_down:      bf16[F @tp, H]          per layer
weight out_norm:    bf16[H]
weight lm_head:     bf16[H, V @tp]

state gdn_state:    f32[B, NV @tp, D, D]          per layer
state gdn_q_conv:   f32[B, CONV - 1, NK*D @tp]    per layer
state gdn_k_conv:   f32[B, CONV - 1, NK*D @tp]    per layer
state gdn_v_conv:   f32[B, CONV - 1, NV*D @tp]    per layer

block gated_deltanet(h) {
  q = l2norm(short_conv(linear(h, gdn_wq), gdn_conv_q, gdn_q_conv), heads=NK, scale=D ** -0.5)
  k = l2norm(short_conv(linear(h, gdn_wk), gdn_conv_k, gdn_k_conv), heads=NK)
  v = short_conv(linear(h, gdn_wv), gdn_conv_v, gdn_v_conv)
  ba = linear(h, gdn_wba)
  beta = sigmoid(slice(ba, start=0, size=NV))
  g = -exp(gdn_a_log) * softplus(slice(ba, start=NV, size=NV) + gdn_dt_bias)
  o = recurrent(q, k, v, gdn_state, g, beta, heads=NV, key_heads=NK, rule="delta")
  return linear(rmsnorm(o, gdn_norm, heads=NV, eps=EPS) * silu(linear(h, gdn_wz)), gdn_wo)
}

layer gdn(x) {
  x = x + gated_deltanet(rmsnorm(x, norm1, eps=EPS))
  h = rmsnorm(x, norm2, eps=EPS)
  return x + linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)
}

layers L { gdn: otherwise }

step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm, eps=EPS), lm_head)
  return logits, argmax(logits)
}
"""


def local_model(text: str):
    return shard(elaborate(parse(text), None, text))


def test_key_heads_split_with_their_value_heads():
    local = local_model(SPEC)
    (rule,) = [n for n in local.kind("gdn").nodes if n.op == "recurrent"]
    assert rule.attr["heads"] == 4 and rule.attr["key_heads"] == 2, rule.attrs
    widths = [graph_value_type(local.kind("gdn"), rule.inputs[i]).shape[1] for i in (0, 1, 2, 4, 5)]
    assert widths == [256, 256, 512, 4, 4], widths  # q, k: two key heads; v: four value heads; g, beta


def test_key_heads_fewer_than_the_devices_are_replicated():
    """One key head (Mamba2's single B/C group) for 2 devices: q and k stay whole on both, each
    device's value head reads that key head (`key_axes`), the state splits by value heads."""
    text = SPEC.replace("const NK = 4 ", "const NK = 1 ").replace("const NV = 8 ", "const NV = 2 ")
    text = text.replace("gdn_wq:      bf16[H, NK*D @tp]", "gdn_wq:      bf16[H, NK*D]").replace(
        "gdn_wk:      bf16[H, NK*D @tp]", "gdn_wk:      bf16[H, NK*D]"
    )
    for w in ("gdn_conv_q:  bf16[CONV, NK*D @tp]", "gdn_conv_k:  bf16[CONV, NK*D @tp]"):
        text = text.replace(w, w.replace(" @tp", ""))
    for st in ("gdn_q_conv:   f32[B, CONV - 1, NK*D @tp]", "gdn_k_conv:   f32[B, CONV - 1, NK*D @tp]"):
        text = text.replace(st, st.replace(" @tp", ""))
    local = local_model(text)
    (rule,) = [n for n in local.kind("gdn").nodes if n.op == "recurrent"]
    assert rule.attr["heads"] == 1 and rule.attr["key_heads"] == 1 and rule.attr["key_axes"] == ("tp",), rule.attrs
    widths = [graph_value_type(local.kind("gdn"), rule.inputs[i]).shape[1] for i in (0, 1, 2, 4, 5)]
    assert widths == [128, 128, 128, 1, 1], widths


def test_value_heads_spanning_several_replicated_key_heads_are_a_diagnostic():
    """3 key heads of 6 value heads over 2 devices: a device's 3 value heads would read 2 key heads."""
    text = SPEC.replace("const NK = 4 ", "const NK = 3 ").replace("const NV = 8 ", "const NV = 6 ")
    with pytest.raises(SpecError) as err:
        local_model(text)
    assert "3 key heads do not split 2 ways" in str(err.value), err.value


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out, _ = compile_source(SPEC, "gdn_small.mk", None, None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path_factory.mktemp("gdn"), "gdn_small")
    return out.model, module, verify.LayerChecker(out.model)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("batch", [4])
def test_gated_deltanet_kernel_matches_reference(batch, compiled):
    model, module, checker = compiled
    result = verify.check_batch(model, module, checker, batch, steps=3, seed=batch)
    assert not result.failures, result.failures
    print(f"\ngdn_small batch {batch}: worst error / bound {result.worst} ({result.seconds:.0f} s)")


def test_recurrent_slots_are_laid_out_as_the_planner_counts_them(compiled):
    """The kernel's Recurrent and the planner (`slot_layout`, `slot_states`) agree on a slot's rows
    and heads at every batch, and a slot holds whole rows' worth of heads within its states."""
    from types import SimpleNamespace

    from mkdsl.backends.tpu.lowerings.kda import slot_layout, slot_states

    _, module, _ = compiled
    for heads, rows_max in ((4, 8), (96, 8), (3, 8), (1, 8), (6, 16)):
        states = slot_states(heads, 128, 128, rows_max)
        buf = SimpleNamespace(shape=(3, states, 128, 128))
        for batch in range(1, rows_max + 1):
            rule = module.Recurrent(None, None, buf, buf, None, batch, heads)
            assert (rule.rows, rule.per) == slot_layout(heads, batch, states), (heads, batch)
            assert rule.rows * rule.per <= states and heads % rule.per == 0
