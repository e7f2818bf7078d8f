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
in mkdsl asks for interpret mode, once per process.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

INTERPRETER = "jax._src.pallas.mosaic.interpret"


def _from_interpreter(callback) -> bool:
    func = getattr(callback, "callback_func", None)
    while isinstance(func, functools.partial):
        func = func.func
    return func is not None and getattr(inspect.unwrap(func), "__module__", "").startswith(INTERPRETER)


def use_host_callbacks() -> None:
    """Install the host path for the interpreter's callbacks (idempotent)."""
    from jax._src import callback as jax_callback
    from jax._src import tree_util

    original = jax_callback.io_callback_impl
    if getattr(original, "mkdsl_host_path", False):
        return

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        if not _from_interpreter(callback):
            return original(*args, result_avals=result_avals, callback=callback, sharding=sharding, ordered=ordered)
        return tree_util.tree_map(np.asarray, callback(*args))

    io_callback_impl.mkdsl_host_path = True
    jax_callback.io_callback_impl = io_callback_impl


def interpret_params(**options):
    """`pltpu.InterpretParams(**options)`, with the host path for its callbacks installed."""
    from jax.experimental.pallas import tpu as pltpu

    use_host_callbacks()
    return pltpu.InterpretParams(**options)
