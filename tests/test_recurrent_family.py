"""The `recurrent` family in the generated kernel: the plain gated outer-product members (Mamba2,
RetNet, GLA) in TPU interpret mode against the reference, and the delta rule at the widths libtpu
once rejected (value heads 64 wide, 16 of them), compiled by libtpu.

tests/data/recurrent_outer.mk has one layer kind per member, sharded over 2 devices with ONE key
group for all value heads (Mamba2's ngroups=1): the shard pass replicates q and k (`key_axes`),
each device's value heads read that key head, and the 64-wide value heads make the kernel unroll
its loop over the heads' slots (static column offsets). The kernel is checked layer by layer by
`mkdsl.verify.kernel` (its bounds, derived there) with the race detector on, 2 steps at batch 2.

tests/data/delta_narrow.mk is a Gated DeltaNet layer with 16 value heads of 64 and 8 key heads of
128: before the unroll, Mosaic refused its `vector<1x64xf32>` load at a loop index ("cannot
statically prove that index in dimension 1 is a multiple of 128"); at batch 8 its loop is folded
(128-lane windows at a loop index, each 64-wide head a static slice of one). Cost: interpret ~40-70 s, each
libtpu compile ~10-25 s, the SPMD prefill ~30 s on the 2-core dev machine (slow-marked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_helpers import compile_one_core, compile_sharded, load_module, tpu7x_devices

from mkdsl.compiler import compile_source
from mkdsl.lang.elaborate import elaborate
from mkdsl.lang.syntax import parse
from mkdsl.spmd.shard import shard
from mkdsl.verify import kernel as verify

DATA = Path(__file__).resolve().parent / "data"
OUTER = DATA / "recurrent_outer.mk"
NARROW = DATA / "delta_narrow.mk"


def _compiled(spec: Path, tmp: Path):
    text = spec.read_text(encoding="utf-8")
    out, _ = compile_source(text, str(spec), None, None)
    path = tmp / f"{spec.stem}.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    return out, path


def test_outer_members_shard_with_replicated_keys():
    text = OUTER.read_text(encoding="utf-8")
    local = shard(elaborate(parse(text), None, text))
    for kind in ("ssm_layer", "ret_layer", "gla_layer"):
        (node,) = [n for n in local.kind(kind).nodes if n.op == "recurrent"]
        assert node.attr["rule"] == "outer" and node.attr["heads"] == 2, (kind, node.attrs)
        assert node.attr["key_heads"] == 1 and node.attr["key_axes"] == ("tp",), (kind, node.attrs)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_outer_members_kernel_matches_reference(tmp_path):
    out, path = _compiled(OUTER, tmp_path)
    module = verify.import_generated(path.read_text(encoding="utf-8"), tmp_path, "recurrent_outer_k")
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), 2, steps=2, seed=3)
    assert not result.failures, result.failures
    assert any(k.startswith("state ssm") for k in result.worst), result.worst  # the recurrent state was compared
    print(f"\nrecurrent_outer batch 2: worst error / bound {result.worst} ({result.seconds:.0f} s)")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_outer_members_compile_with_libtpu(tmp_path):
    _, path = _compiled(OUTER, tmp_path)
    module = load_module(path, "recurrent_outer_compile")
    compiled, seconds = compile_sharded(module, tpu7x_devices("tpu7x:2x2x1"), 2, 256)
    assert compiled is not None
    print(f"\nrecurrent_outer: libtpu compile {seconds:.0f} s")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_delta_rule_with_narrow_value_heads_compiles_with_libtpu(tmp_path):
    """16 value heads of 64: at batch 1 (8 heads a row, two slots' worth) the loop over the slots
    is unrolled; at batch 8 (a head of 8 rows a slot) it is folded, a trip of 2 slots' value columns
    one 128-lane window at a loop index (`Recurrent.fold`, tests/test_recurrent_fold.py)."""
    out, path = _compiled(NARROW, tmp_path)
    assert "self.unrolled = s_in.shape[2] % 128 != 0 or s_in.shape[3] % 128 != 0" in path.read_text(encoding="utf-8")
    module = load_module(path, "delta_narrow_compile")
    for batch in (1, 8):
        compiled, seconds = compile_one_core(module, tpu7x_devices("tpu7x:2x2x1")[0], batch, 256)
        assert compiled is not None
        print(f"\ndelta_narrow batch {batch}: libtpu compile {seconds:.0f} s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_outer_members_prefill_per_device_equals_the_whole_prefill():
    """The SPMD prefill of the replicated-key members (each device reading the one key head of
    the whole q and k, `key_axes`) equals the whole model's prefill: the states within
    mkdsl/verify/kernel.py's per-layer bound times the layers (tests/test_prefill_spmd.py's
    bound), the greedy tokens equal. A device reading another device's key head or values changes
    the state by O(1) of its scale."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mkdsl
    from mkdsl.run.prefill import build_prefill
    from mkdsl.run.prefill_spmd import build_sharded_prefill
    from mkdsl.verify.kernel import STATE_RTOL

    spec = mkdsl.load(str(OUTER), None)
    model = spec.model
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    weights, state = mkdsl.random_inputs(spec, batch=2, seq_len=64, seed=4)
    state = {k: jnp.asarray(v) for k, v in state.items()}
    tokens, lengths = np.array([[11, 70, 42, 5], [3, 4, 5, 6]], np.int32), np.array([4, 2], np.int32)
    _, want_tokens, want = build_prefill(model, donate=False)(weights, state, tokens, lengths)
    _, got_tokens, got = build_sharded_prefill(model, mesh)(weights, state, tokens, lengths)
    layers = len(model.schedule)
    for name in want:
        w, g = np.asarray(want[name], np.float32), np.asarray(got[name], np.float32)
        assert not np.isnan(g).any(), name
        bound = layers * STATE_RTOL * np.abs(w).max(-1, keepdims=True) + np.finfo(np.float32).tiny
        assert (np.abs(g - w) <= bound).all(), (name, float((np.abs(g - w) / bound).max()))
    assert (np.asarray(got_tokens) == np.asarray(want_tokens)).all()
