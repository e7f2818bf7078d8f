"""TPU interpret mode's host callbacks, on host arrays.

Pallas' TPU interpreter runs every load, store, DMA and semaphore of a kernel as a Python
`io_callback`. jax 0.10.2's `io_callback` first `device_put`s each argument on the first CPU
device and hands the callback jax arrays, which the interpreter turns straight back into numpy
(`int(...)`, `np.asarray`). Measured with py-spy on SmolLM2-135M's decode step: that round trip was
more than half of the time spent in the interpreter's callbacks, and a step took 2.5-3.5x longer
than with the arguments passed as the numpy arrays XLA already holds. Over several virtual
devices it also deadlocks: once an argument is large (~100 KiB) the copy waits behind the device
threads, which are blocked in the interpreter waiting for each other's semaphores.

`use_host_callbacks()` routes the interpreter's callbacks (and only those: any other io_callback
keeps jax's own path) straight to the callback with the host arrays. It is installed by whatever
in mkdsl asks for interpret mode, once per process. The route is decided once per callback, and
the interpreter's function is called with the flat arguments themselves (it takes no pytrees):
jax's pytree round trip around each call and the per-call routing check were ~25% of the
callbacks' time (py-spy, Kimi K3 mini); a step takes 8-15% less (SmolLM2-135M: 2.39 -> 2.19 s,
Kimi K3 mini on 8 devices: ~11 -> ~10 s).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable

import numpy as np

INTERPRETER = "jax._src.pallas.mosaic.interpret"


def _from_interpreter(callback) -> bool:
    func = getattr(callback, "callback_func", None)
    while isinstance(func, functools.partial):
        func = func.func
    return func is not None and getattr(inspect.unwrap(func), "__module__", "").startswith(INTERPRETER)


_LEAVES = (np.ndarray, np.generic, int, float, bool)


def _direct(callback) -> Callable | None:
    """How to call one of the interpreter's callbacks on XLA's host arrays: its function itself
    when the flat arguments are its positional arguments (the interpreter's callbacks take no
    pytrees), else the callback (it unflattens them); None for any other io_callback."""
    if not _from_interpreter(callback):
        return None
    from jax import tree_util

    flat = callback.in_tree == tree_util.tree_structure((tuple(range(callback.in_tree.num_leaves)), {}))
    return callback.callback_func if flat else callback


def _host_leaves(out) -> list:
    """The callback's results as jax flattens them (`tree_leaves`: None is no leaf), on the host."""
    if type(out) is tuple and all(isinstance(x, _LEAVES) for x in out):
        return [np.asarray(x) for x in out]
    if isinstance(out, _LEAVES):
        return [np.asarray(out)]
    from jax import tree_util

    return [np.asarray(x) for x in tree_util.tree_leaves(out)]


def use_host_callbacks() -> None:
    """Install the host path for the interpreter's callbacks (idempotent)."""
    from jax._src import callback as jax_callback

    original = jax_callback.io_callback_impl
    if getattr(original, "mkdsl_host_path", False):
        return
    # Decided once per callback (a program's callbacks run thousands of times a step): weakly
    # keyed, so that callbacks of programs no longer held are not kept.
    routes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        try:
            direct = routes[callback]
        except KeyError:
            direct = routes.setdefault(callback, _direct(callback))
        if direct is None:
            return original(*args, result_avals=result_avals, callback=callback, sharding=sharding, ordered=ordered)
        return _host_leaves(direct(*args))

    io_callback_impl.mkdsl_host_path = True
    jax_callback.io_callback_impl = io_callback_impl


def use_fast_interpreter() -> None:
    """Install mkdsl's two speed-ups of jax's TPU interpreter (idempotent): the host path for its
    callbacks, and the vectorised race detector (mkdsl/backends/tpu/race_detection.py)."""
    from mkdsl.backends.tpu.race_detection import use_vectorised_race_detection

    use_host_callbacks()
    use_vectorised_race_detection()


def interpret_params(**options):
    """`pltpu.InterpretParams(**options)`, with mkdsl's speed-ups of the interpreter installed."""
    from jax.experimental.pallas import tpu as pltpu

    use_fast_interpreter()
    return pltpu.InterpretParams(**options)
