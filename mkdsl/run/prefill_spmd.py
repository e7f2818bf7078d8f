"""Prefill per device: the sharded spec's per-device model (mkdsl/spmd/shard.py) under `shard_map`.

A sharded model's whole prefill may not fit one device (Kimi K3: 51 GB of weights per core over
32 cores). Here each device runs the per-device model's prefill on its own blocks of the weights
and the state (split as each tensor's `sharding` says, the blocks the kernel holds), and the
collectives the shard pass inserted exchange values over the mesh as the kernel's do: partial
sums by `psum`, column slices by `all_gather`, in mesh order (a deferred norm's
exchanges, mkdsl/spmd/defer_norm.py, by `psum` and the slice). The new state comes back as global
arrays split over the mesh as the kernel's `STATE_SPLIT` says, so the kernel's step takes it.

What the per-device model needs beyond its ops' references is each op's own `OpDef.spmd_prefill`:
the collectives (identities on the whole model) exchange over the mesh, and the ops that index
over a split (an embedding or output argmax split over the vocabulary, experts split over
`expert_axes`) take their device's part.
"""

from __future__ import annotations

from collections.abc import Callable

from mkdsl.lang.ir import Model, Tensor
from mkdsl.lang.quant import register_pytree
from mkdsl.lazy import jax, jnp
from mkdsl.ops import OPS
from mkdsl.run.prefill import check_prefill, reference_weights, run_prefill
from mkdsl.run.sampling import Sampling, sample_tokens
from mkdsl.spmd.shard import shard


def tensor_spec(t: Tensor):
    """The PartitionSpec of a tensor's global array: its layer-slot axis whole, then its `sharding`."""
    split = ((),) * t.stacked + tuple(t.sharding)
    return jax.sharding.PartitionSpec(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in split))


def _vocab_axes(local: Model) -> tuple[str, ...]:
    """The mesh axes the per-device logits are split over (the output argmax's)."""
    return tuple(
        next((n.attr["shard_axes"] for n in local.step.nodes if n.op in OPS and OPS[n.op].exchange == "best"), ()) or ()
    )


def build_sharded_prefill(
    model: Model,
    mesh,
    *,
    sampling: Sampling | None = None,
    state_shardings: dict | None = None,
    jit: bool = True,
    donate: bool = True,
) -> Callable:
    """`prefill(weights, state, tokens, lengths=None, start=None, seed=0) -> (logits, next_tokens,
    new_state)` as mkdsl/run/prefill.py's `build_prefill`, computed per device under `shard_map` over
    `mesh` (the generated module's `make_mesh`). Weights and state are global arrays in the
    reference's layout (or the kernel's `w_codes`/`w_scales`, unpadded); the logits come back
    whole, next_tokens sampled from them as the kernel's step samples; `state_shardings` (e.g.
    `mkdsl.state_shardings(spec, mesh)`) places the new state; `donate` donates the input state."""
    check_prefill(model)
    local, sampling = shard(model), Sampling() if sampling is None else sampling
    P = jax.sharding.PartitionSpec  # noqa: N806
    w_specs = {t.name: tensor_spec(t) for t in local.weights}
    s_specs = {t.name: tensor_spec(t) for t in local.states}
    logit_spec = P(None, _vocab_axes(local) or None)

    def per_device(weights, state, tokens, lengths, start):
        return run_prefill(local, Sampling(), weights, state, tokens, lengths, start, spmd=True)

    def prefill(weights, state, tokens, lengths=None, start=None, seed=0):
        weights = reference_weights(model, weights)
        batch, length = tokens.shape
        lengths = jnp.full((batch,), length, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        specs = ({k: w_specs[k] for k in weights}, {k: s_specs[k] for k in state}, P(), P(), P())
        out_specs = (logit_spec, P(), {k: s_specs[k] for k in state})
        mapped = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
        logits, greedy, new = mapped(weights, state, jnp.asarray(tokens, jnp.int32), lengths, start)
        seed = jnp.uint32(seed % 2**32) if isinstance(seed, int) else seed
        return logits, sample_tokens(logits, start + lengths - 1, seed, sampling, greedy), new

    register_pytree()
    if not jit:
        return prefill
    jitted = jax.jit(prefill, **({"donate_argnums": (1,)} if donate else {}))
    if state_shardings is None:
        return jitted

    def placed(*args, **kwargs):
        logits, next_tokens, new_state = jitted(*args, **kwargs)
        return logits, next_tokens, jax.device_put(new_state, {k: state_shardings[k] for k in new_state})

    return placed
