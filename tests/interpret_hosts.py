"""A workaround for TPU interpret mode over several virtual CPU devices (jax 0.10.2).

The interpreter runs each device's kernel through io_callbacks. jax's io_callback first
`device_put`s the callback's arguments on the first CPU device; once an argument is large
(about 100 KiB: any input, output or scratch buffer being allocated) that copy waits behind
the device threads, which are blocked in the interpreter waiting for each other's semaphores:
a deadlock. Calling the callback on the host arrays as they come avoids it; the callbacks of
the interpreter take numpy arrays anyway. Found while bringing up the sharded Kimi K3 kernel.
"""

from __future__ import annotations

import contextlib

import numpy as np
from jax._src import callback as _callback
from jax._src import tree_util


def _io_callback_on_host(*args, result_avals, callback, sharding, ordered):
    del result_avals, sharding, ordered
    return tree_util.tree_map(np.asarray, callback(*args))


@contextlib.contextmanager
def host_callbacks():
    """Within: io_callbacks run on the host arrays, without the device_put that deadlocks."""
    original = _callback.io_callback_impl
    _callback.io_callback_impl = _io_callback_on_host
    try:
        yield
    finally:
        _callback.io_callback_impl = original
