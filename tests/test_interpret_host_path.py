"""mkdsl/backends/tpu/interpret.py: the interpreter's callbacks run on host arrays, called directly;
every other io_callback keeps jax's own path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util
from jax.experimental import io_callback
from jax.experimental import pallas as pl

from mkdsl.backends.tpu.interpret import _host_leaves, interpret_params


def test_results_flatten_as_jax_flattens_them():
    a, b = np.arange(3, dtype=np.float32), np.int32(7)
    for out in [(a, b), a, b, 5, (a, None, b), [a, (b, {"x": a})], (a, (b,))]:
        want = [np.asarray(x) for x in tree_util.tree_leaves(out)]
        got = _host_leaves(out)
        assert len(got) == len(want) and all(g.dtype == w.dtype and np.array_equal(g, w) for g, w in zip(got, want))


def test_another_io_callback_still_gets_jax_arrays_and_pytrees():
    interpret_params()  # installs the host path
    seen = []

    def callback(tree):
        seen.append(type(tree["x"]))
        return {"sum": tree["x"] + tree["y"][0], "n": np.int32(tree["y"][1])}

    shapes = {"sum": jax.ShapeDtypeStruct((3,), jnp.float32), "n": jax.ShapeDtypeStruct((), jnp.int32)}
    out = jax.jit(lambda x: io_callback(callback, shapes, {"x": x, "y": (2 * x, 4)}))(jnp.arange(3.0))
    assert np.array_equal(np.asarray(out["sum"]), [0.0, 3.0, 6.0]) and int(out["n"]) == 4
    assert seen and issubclass(seen[0], jax.Array)  # jax's path: arguments device_put, as jax documents


def test_an_interpreted_kernel_reads_and_writes_through_the_host_path(monkeypatch):
    from mkdsl.backends.tpu import interpret

    calls = []
    monkeypatch.setattr(interpret, "_host_leaves", lambda out: calls.append(1) or _host_leaves(out))

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)), jnp.float32)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret_params())(x)
    assert np.array_equal(np.asarray(out), np.asarray(x) * 2.0 + 1.0)  # exact: one rounding each way
    assert len(calls) > 4  # its loads, stores and allocations came through the host path
