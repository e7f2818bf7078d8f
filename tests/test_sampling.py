"""Sampling (mkdsl/run/sampling.py, the generated module's `Sampling`/`sample_tokens`): greedy,
temperature, top-k and top-p draws from counter-based bits, identical in the module and in
mkdsl, reproducible for a seed, and from the right distribution (a chi-square bound)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mkdsl
from mkdsl.run.sampling import Sampling, sample_tokens, sampling_mask

DRAWS = 20000


def _logits(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    return (2.0 * np.random.default_rng(seed).standard_normal((rows, vocab))).astype(np.float32)


def _draws(logits_row: np.ndarray, sampling: Sampling, seed: int = 1) -> np.ndarray:
    """DRAWS tokens from one row's logits: rows (and positions) differ, so the draws are independent."""
    logits = jnp.asarray(np.tile(logits_row, (DRAWS, 1)))
    positions = jnp.arange(DRAWS, dtype=jnp.int32) % 4096
    return np.asarray(sample_tokens(logits, positions, np.uint32(seed), sampling))


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


def _chi2_bound(categories: int) -> float:
    # Pearson's X² of a correct sampler is ~chi2(k-1): mean k-1, sd sqrt(2(k-1)); 6 sd above the
    # mean is exceeded with probability < 1e-3 for k <= 16 (the chi-square tail at +6 sd), and the
    # draws are seeded, so the test is deterministic.
    return (categories - 1) + 6 * math.sqrt(2 * (categories - 1))


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def test_temperature_samples_softmax_of_scaled_logits():
    row = _logits(1, 8)[0]
    counts = np.bincount(_draws(row, Sampling(temperature=0.7)), minlength=8)
    p = _softmax(row / 0.7)
    assert _chi2(counts, p) < _chi2_bound(8)
    # the test can fail: the same draws against the distribution at temperature 1
    assert _chi2(counts, _softmax(row)) > 10 * _chi2_bound(8)


def test_top_p_samples_the_renormalised_nucleus():
    row = 0.4 * _logits(1, 12, seed=3)[0]  # flat enough that the nucleus holds several tokens
    p = _softmax(row)
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    kept = order[before < 0.8]  # the most likely tokens until their mass reaches 0.8
    assert 3 <= len(kept) < 12
    counts = np.bincount(_draws(row, Sampling(temperature=1.0, top_p=0.8)), minlength=12)
    assert counts[np.setdiff1d(np.arange(12), kept)].sum() == 0
    q = p[kept] / p[kept].sum()
    assert _chi2(counts[kept], q) < _chi2_bound(len(kept))


def test_top_k_samples_the_k_largest():
    row = _logits(1, 16, seed=4)[0]
    top = np.argsort(-row)[:5]
    counts = np.bincount(_draws(row, Sampling(temperature=1.3, top_k=5)), minlength=16)
    assert counts[np.setdiff1d(np.arange(16), top)].sum() == 0
    assert _chi2(counts[top], _softmax(row[top] / 1.3)) < _chi2_bound(5)


def test_top_k_one_and_temperature_zero_are_greedy():
    logits = jnp.asarray(_logits(64, 300, seed=5))
    positions = jnp.arange(64, dtype=jnp.int32)
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    for sampling in (Sampling(), Sampling(temperature=2.0, top_k=1), Sampling(temperature=0.0, top_k=7)):
        assert (np.asarray(sample_tokens(logits, positions, np.uint32(9), sampling)) == greedy).all()


def test_a_seed_reproduces_its_draws_and_another_seed_differs():
    logits = jnp.asarray(_logits(256, 64, seed=6))
    positions = jnp.arange(256, dtype=jnp.int32)
    sampling = Sampling(temperature=1.0, top_k=40, top_p=0.95)
    a, b = (np.asarray(sample_tokens(logits, positions, np.uint32(11), sampling)) for _ in range(2))
    c = np.asarray(sample_tokens(logits, positions, np.uint32(12), sampling))
    assert (a == b).all()
    assert (a != c).mean() > 0.3  # distinct seeds: most draws of a spread distribution differ


def test_the_generated_module_samples_exactly_as_mkdsl():
    module = mkdsl.load_kernel(mkdsl.load("specs/tiny.mk"))
    logits = jnp.asarray(_logits(8, 256, seed=7))
    positions = jnp.arange(8, dtype=jnp.int32) * 17
    for t, k, p in ((0.8, 0, 1.0), (1.0, 20, 0.9), (1.5, 0, 0.5)):
        ours = sample_tokens(logits, positions, np.uint32(3), Sampling(t, k, p))
        theirs = module.sample_tokens(logits, positions, np.uint32(3), module.Sampling(t, k, p))
        assert (np.asarray(ours) == np.asarray(theirs)).all()


def test_masks_keep_ties_and_at_least_one_token():
    z = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, -2.0, -3.0]])
    kept = np.isfinite(np.asarray(sampling_mask(z, Sampling(1.0, top_k=1))))
    assert kept.tolist() == [[False, True, True, False], [True, False, False, False]]
    kept = np.isfinite(np.asarray(sampling_mask(z, Sampling(1.0, top_p=1e-6))))
    assert kept.sum(axis=1).tolist() == [2, 1]


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_sampling_is_a_value_error(bad):
    with pytest.raises(ValueError):
        Sampling(**bad)


@pytest.fixture(scope="module")
def tiny_module():
    return mkdsl.load_kernel(mkdsl.load("specs/tiny.mk"))


def _kernel_draws(module, sampling, logits: np.ndarray, positions: np.ndarray, seed: int) -> np.ndarray:
    """The kernel's own sampler (the generated module's `sampled_argmax`, what the step's epilogue
    runs) in a one-block Pallas kernel, interpret mode."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from mkdsl.verify.kernel import interpret_params

    rows = logits.shape[0]

    def kernel(seed_ref, positions_ref, x_ref, out_ref):
        module.sampled_argmax(sampling, seed_ref, positions_ref, x_ref, out_ref, chunk=128)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, 1), jnp.int32),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(), in_specs=[vmem], out_specs=vmem),
        interpret=interpret_params(),
    )
    seed_bits = np.array([seed], np.uint32).view(np.int32)
    return np.asarray(call(jnp.asarray(seed_bits), jnp.asarray(positions, jnp.int32), jnp.asarray(logits))).reshape(
        rows
    )


@pytest.mark.parametrize(
    "t,k,p", [(0.8, 0, 1.0), (1.0, 20, 0.9), (1.5, 0, 0.5), (0.7, 5, 1.0), (2.0, 1, 1.0), (0.0, 0, 1.0)]
)
def test_the_kernel_draws_exactly_as_the_reference(tiny_module, t, k, p):
    """In the kernel (bit-built top-k and top-p thresholds, the hash per token id) the same
    tokens as sample_tokens for a seed; top_k 1 and temperature 0 are the greedy argmax."""
    logits = _logits(16, 512, seed=8)
    positions = (np.arange(16) * 37 % 300).astype(np.int32)
    sampling = Sampling(t, k, p)
    theirs = np.asarray(sample_tokens(jnp.asarray(logits), jnp.asarray(positions), np.uint32(2**31 + 5), sampling))
    ours = _kernel_draws(tiny_module, tiny_module.Sampling(t, k, p), logits, positions, 2**31 + 5)
    assert (ours == theirs).all(), (ours, theirs)
    if sampling.greedy or k == 1:
        assert (ours == logits.argmax(axis=-1)).all()
    else:  # a draw, not the argmax: the test can tell the two apart
        assert (ours != logits.argmax(axis=-1)).any()


def _sharded_draws(sampling, logits: np.ndarray, positions: np.ndarray, seed: int) -> np.ndarray:
    """The kernel's sampler over a vocabulary split over 8 devices (a 4 x 2 mesh, each holding
    its columns), exchanging with the collectives' Comm; every device's token, [8, batch]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import PartitionSpec as P
    from test_comm import load_runtime

    from mkdsl.run.sampling import TEMPLATE
    from mkdsl.verify.kernel import interpret_params

    ns = load_runtime()
    exec(compile(TEMPLATE.read_text(encoding="utf-8"), str(TEMPLATE), "exec"), ns)
    axes, sizes, batch = ("ep", "tp"), (4, 2), logits.shape[0]
    # 8 rows on the wire (batch 5: the exchange widens), one group of all 8 devices, 128-lane messages
    scratch = ns["comm_scratch"](8, {0b111: 128}, 128)

    def kernel(seed_ref, positions_ref, x_ref, out_ref, *refs):
        comm = ns["Comm"](ns["Refs"](list(scratch), refs), axes=axes, sizes=sizes)
        every = comm.mask()
        comm.enter()
        offset = comm.group_index(every) * x_ref.shape[1]
        ns["sampled_argmax"](sampling, seed_ref, positions_ref, x_ref, out_ref, 128, offset, comm, every)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, 1), jnp.int32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(),
            in_specs=[vmem],
            out_specs=vmem,
            scratch_shapes=ns["comm_scratch_shapes"](scratch),
        ),
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret_params(),
    )
    mesh = jax.make_mesh(sizes, axes, devices=jax.devices()[:8])
    fn = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(P(), P(), P(None, axes)), out_specs=P(axes), check_vma=False))
    seed_bits = jnp.asarray(np.array([seed], np.uint32).view(np.int32))
    put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    out = fn(put(seed_bits, P()), put(jnp.asarray(positions, jnp.int32), P()), put(logits, P(None, axes)))
    return np.asarray(out).reshape(8, batch)


@pytest.mark.parametrize("t,k,p", [(1.0, 20, 0.9), (0.0, 0, 1.0)])
def test_the_kernel_draws_as_the_reference_over_a_split_vocabulary(t, k, p):
    """Split over 8 devices (thresholds from counts and sums combined over the group, each
    device's best draw combined as the greedy argmax is): every device takes the reference's token."""
    logits = _logits(5, 1024, seed=9)
    positions = np.array([0, 3, 17, 200, 4095], np.int32)
    want = np.asarray(sample_tokens(jnp.asarray(logits), jnp.asarray(positions), np.uint32(77), Sampling(t, k, p)))
    got = _sharded_draws(Sampling(t, k, p), logits, positions, 77)
    assert (got == want[None, :]).all(), (got, want)
