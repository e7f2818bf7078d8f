"""Sliding-window attention, sinks, custom scale, head dims 64 and 256, and the rope variants
(YaRN with concentration, partial and interleaved rotary at an offset): the kernel in TPU
interpret mode (race detection on) against the reference, layer by layer (mkdsl.verify.kernel), and the
plan's KV bytes, which skip the tiles wholly outside the window.

The caches start from random values (not zeros), so every cached key and value counts: with
zero caches a kernel that ignored the window would pass (its extra keys add only e^-m terms)."""

from __future__ import annotations

import numpy as np
import pytest

from mkdsl.compiler import compile_source
from mkdsl.lang.diagnostics import SpecError
from mkdsl.plan.planner import make_plan
from mkdsl.run.random_params import random_params
from mkdsl.verify import kernel as verify

# One spec, four layer kinds (each interpret-mode kernel costs ~20 s of tracing, so they share one):
# `local`: gpt-oss-style YaRN rope with concentration, a 16-token window, sinks, a custom scale,
# head dim 64; `global`: interleaved partial rope at an offset, sinks, no window; `wide`:
# Qwen3-Next's head dim 256 with the first 64 lanes rotating (theta 1e7); `mla`: DeepSeek-V3's
# MLA with decoupled rope: the 64 rope lanes after the 128 nope lanes of each query head and the
# shared k_pe rotate with interleaved pairs and YaRN, and the softmax scale is 192^-0.5 * m^2,
# m = 0.1 * ln(40) + 1, and DeepSeek-V3's fp8 w_kvb with 128 x 128 scale squares (WKVB, below);
# gpt-oss's concentration is 0.1 * ln(32) + 1.
WINDOWED = """
model win
const H = 128
const NH = 4
const NKV = 2
const D = 64
const V = 256
const W = 16
const THETA = 150000.0
const CONC = 0.1 * ln(32.0) + 1.0  # gpt-oss's YaRN concentration, 1.346574
const MSCALE = 0.1 * ln(40.0) + 1.0  # DeepSeek's YaRN m, 1.368888
const R = 128
const NOPE = 128
const XK = 64
dim B in 1 .. 4
dim S in 16 .. 64
weight embed:     bf16[V, H]
weight wq:        bf16[H, NH*D]  per layer(local, global)
weight wk:        bf16[H, NKV*D] per layer(local, global)
weight wv:        bf16[H, NKV*D] per layer(local, global)
weight sinks:     bf16[NH]       per layer(local, global)
weight wo:        bf16[NH*D, H]  per layer(local, global)
weight wq2:       bf16[H, 2*256] per layer(wide)
weight wk2:       bf16[H, 256]   per layer(wide)
weight wv2:       bf16[H, 256]   per layer(wide)
weight wo2:       bf16[2*256, H] per layer(wide)
weight wq3:       bf16[H, 2*(NOPE+XK)] per layer(mla)
weight wkva:      bf16[H, 256]         per layer(mla)
weight wkvb:      WKVB_DTYPE[R, 2*(NOPE+128)] per layer(mla)
weight wo3:       bf16[2*128, H]       per layer(mla)
weight lm_head:   bf16[H, V]
state k_cache: bf16[B, NKV, S, D] per layer(local, global)
state v_cache: bf16[B, NKV, S, D] per layer(local, global)
state k256:    bf16[B, 1, S, 256] per layer(wide)
state v256:    bf16[B, 1, S, 256] per layer(wide)
state latent:  bf16[B, S, R + XK] per layer(mla)
layer local(x) {
  q = rope(linear(x, wq), pos, heads=NH, theta=THETA, scaling="yarn", factor=32.0, original_max_position=16,
           truncate=false, concentration=CONC)
  k = rope(linear(x, wk), pos, heads=NKV, theta=THETA, scaling="yarn", factor=32.0, original_max_position=16,
           truncate=false, concentration=CONC)
  a = attention(q, k, linear(x, wv), k_cache, v_cache, pos, sinks, heads=NH, kv_heads=NKV, window=W, scale=0.125)
  return x + linear(a, wo)
}
layer global(x) {
  q = rope(linear(x, wq), pos, heads=NH, rotary_dim=32, rotary_offset=16, pairing="interleaved")
  k = rope(linear(x, wk), pos, heads=NKV, rotary_dim=32, rotary_offset=16, pairing="interleaved")
  a = attention(q, k, linear(x, wv), k_cache, v_cache, pos, sinks, heads=NH, kv_heads=NKV)
  return x + linear(a, wo)
}
layer wide(x) {
  q = rope(linear(x, wq2), pos, heads=2, rotary_dim=64, theta=10000000.0)
  k = rope(linear(x, wk2), pos, heads=1, rotary_dim=64, theta=10000000.0)
  return x + linear(attention(q, k, linear(x, wv2), k256, v256, pos, heads=2, kv_heads=1), wo2)
}
layer mla(x) {
  q = rope(linear(x, wq3), pos, heads=2, rotary_dim=XK, rotary_offset=NOPE, pairing="interleaved",
           scaling="yarn", factor=40.0, original_max_position=16)
  kv = linear(x, wkva)
  k_pe = rope(slice(kv, start=R, size=XK), pos, pairing="interleaved", scaling="yarn", factor=40.0,
              original_max_position=16)
  y = mla_attention(q, slice(kv, start=0, size=R), k_pe, wkvb, latent, pos, heads=2, nope=NOPE, extra=XK,
                    vdim=128, scale=(NOPE + XK) ** -0.5 * MSCALE ** 2)  # 0.135234
  return x + linear(y, wo3)
}
layers 4 { local: l == 0   global: l == 1   wide: l == 2   mla: otherwise }
hints { kv_tile = 16 }
step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""

WKVB = "fp8_e4m3(block=128)"  # the MLA layer's w_kvb as DeepSeek-V3 ships it (bf16 MLA: the Kimi K3 tests)


def run_checked(
    text: str, name: str, starts: list[int], tmp_path, seq_len: int = 64, steps: int = 2, patch: dict | None = None
) -> dict:
    """`steps` kernel steps from random caches, each checked layer by layer against the reference;
    `patch`: module constants to set before the step is built (e.g. a loop threshold)."""
    out, _ = compile_source(text, f"{name}.mk", None, None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path, name)
    for key, value in (patch or {}).items():
        assert hasattr(module, key), key
        setattr(module, key, value)
    checker = verify.LayerChecker(out.model)
    batch = len(starts)
    weights, state = random_params(out.model, {"B": batch, "S": seq_len}, 0)
    rng = np.random.default_rng(1)
    state = {k: (rng.normal(size=v.shape) * 2).astype(v.dtype) for k, v in state.items()}
    tokens, positions = np.arange(batch, dtype=np.int32), np.asarray(starts, np.int32)
    step = module.build_decode_step(batch, seq_len, interpret=verify.interpret_params(), layer_trace=True)
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    worst: dict[str, float] = {}
    for i in range(steps):
        got = verify.run_kernel(step, weights, state, tokens, positions, sharded=hasattr(module, "MESH_SHAPE"))
        assert not verify.races_found(), f"step {i}: the race detector reported a race"
        result = checker.check(weights, state, tokens, positions, got)
        assert result.ok, f"step {i}, positions {positions.tolist()}: " + "; ".join(result.failures[:6])
        for name in state:  # a replicated cache is the same on every device
            shards = [np.asarray(sh.data) for sh in got.device[name].addressable_shards]
            if got.device[name].sharding.is_fully_replicated:
                assert all(np.array_equal(sh.view(np.uint16), shards[0].view(np.uint16)) for sh in shards), name
        for item, ratio in result.worst.items():
            worst[item] = max(worst.get(item, 0.0), ratio)
        state, tokens, positions = got.state, got.next_tokens.astype(np.int32), positions + 1
    return worst


def test_window_sinks_rope_variants_head_dims_and_mla_match_the_reference(tmp_path):
    """Row 0 at 40 reads tiles 1-2 only in the windowed layer (keys 25..40); row 1 at 16 is the
    first token of tile 1 (its window reaches back into tile 0); the global layer reads every tile."""
    worst = run_checked(WINDOWED.replace("WKVB_DTYPE", WKVB), "win", [40, 16], tmp_path, steps=1)
    assert worst["carries"] <= 1


def _kv_bytes(plan, graph: str) -> int:
    return sum(i.bytes for i in plan.schedule_items if i.graph == graph and "attention" in i.what)


@pytest.mark.parametrize("context", [10, 40, 63])
def test_plan_counts_only_the_tiles_the_window_reaches(context):
    """Per row: full attention reads context // 16 + 1 tiles of 16 tokens; the 16-token window
    from the tile of context - 15 on; both write back one 16-token block. Per token of a tile:
    2 KV heads x (64 + 64) values x 2 bytes."""
    out, _ = compile_source(WINDOWED.replace("WKVB_DTYPE", "bf16"), "win.mk", None, None)
    plan = make_plan(out.model, batch=2, context=context)
    per_tile = 16 * 2 * 128 * 2
    full = context // 16 + 1
    windowed = full - max(context - 15, 0) // 16
    assert _kv_bytes(plan, "global") == 2 * (full + 1) * per_tile
    assert _kv_bytes(plan, "local") == 2 * (windowed + 1) * per_tile
    assert windowed < full or context < 16


def test_w_kvb_with_scales_in_groups_is_a_positioned_diagnostic(tmp_path, monkeypatch, capsys):
    """The kernel decodes bf16 and block-scaled fp8 w_kvb; other formats are reported at their line."""
    from mkdsl.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.mk").write_text(WINDOWED.replace("WKVB_DTYPE", "fp8_e4m3(group=128)"), encoding="utf-8")
    assert main(["check", "spec.mk"]) == 1
    err = capsys.readouterr().err
    line = next(i for i, t in enumerate(WINDOWED.splitlines(), 1) if t.startswith("weight wkvb"))
    want = (
        f"spec.mk:{line}:8: error: `wkvb` is fp8_e4m3(group=128): mla_attention's kernel reads a bf16 or block-scaled"
    )
    assert want in err


# GQA 8:1 on 2 devices: the one KV head is replicated (k, v and the caches whole on each device),
# each device runs 4 query heads against it; sinks are split with the query heads.
REPLICATED = """
model gqa_replicated
const H = 128
const NH = 8
const NKV = 1
const D = 128
const V = 256
dim B in 1 .. 4
dim S in 16 .. 64
mesh { tp = 2 }
weight embed:   bf16[V, H]
weight wq:      bf16[H, NH*D @tp]  per layer
weight wk:      bf16[H, NKV*D]     per layer
weight wv:      bf16[H, NKV*D]     per layer
weight sinks:   bf16[NH @tp]       per layer
weight wo:      bf16[NH*D @tp, H]  per layer
weight lm_head: bf16[H, V]
state k_cache: bf16[B, NKV, S, D] per layer
state v_cache: bf16[B, NKV, S, D] per layer
layer attn(x) {
  q = rope(linear(x, wq), pos, heads=NH)
  k = rope(linear(x, wk), pos, heads=NKV)
  a = attention(q, k, linear(x, wv), k_cache, v_cache, pos, sinks, heads=NH, kv_heads=NKV)
  return x + linear(a, wo)
}
layers 1 { attn: otherwise }
hints { kv_tile = 16 }
step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
"""


def test_gqa_8_to_1_with_the_kv_head_replicated_over_2_devices(tmp_path):
    run_checked(REPLICATED, "gqa_replicated", [20, 5], tmp_path, steps=1)


def test_replicated_kv_heads_shard_rule():
    """Each device holds the whole (replicated) caches and reads the one KV head its query heads share."""
    from mkdsl.spmd.shard import shard

    out, _ = compile_source(REPLICATED, "r.mk", None, None)
    local = shard(out.model)
    (node,) = [n for n in local.kind("attn").nodes if n.op == "attention"]
    assert node.attr["heads"] == 4 and node.attr["kv_heads"] == 1 and node.attr["kv_axes"] == ("tp",)
    assert local.tensor("k_cache").type.shape[1] == 1
    bad = REPLICATED.replace("bf16[NH @tp]", "bf16[NH]")
    with pytest.raises(SpecError, match="must be split over tp like the query heads"):
        compile_source(bad, "r.mk", None, None)


@pytest.mark.parametrize("name", ["win", "rep"])
def test_kernels_compile_with_libtpu(name, tmp_path):
    """libtpu rejects what interpret mode accepts (strided loads on arrays not 128 lanes wide:
    head dims 64 and 256 needed the head-major buffers in 128-lane chunks)."""
    from mkdsl.backends.tpu import libtpu as tpu_compile

    text = {"win": WINDOWED.replace("WKVB_DTYPE", WKVB), "rep": REPLICATED}[name]
    out, _ = compile_source(text, f"{name}.mk", None, None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path, f"{name}_compile")
    devices = tpu_compile.tpu7x_devices(tpu_compile.topology_for(module))
    tpu_compile.compile_module(module, devices, 2, 64)
