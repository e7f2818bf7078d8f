"""The kernel runtime the microbenchmarks run: mkdsl's own runtime templates
(backends/tpu/templates/runtime/), rendered through the emitter's Jinja environment with
templates/calibrate/runtime.py.jinja and loaded as a module, one per ring depth. A
microbenchmark that calls `linear`, `Attention`, `Comm`, `topk_into` or `rmsnorm` from it times
the code a generated kernel runs for that component, not a stand-in."""

from __future__ import annotations

import functools
import sys
import types

# The parts the microbenchmarks call, in a generated module's order (emit.RUNTIME_PARTS).
PARTS = (
    "runtime/core.py.jinja",
    "runtime/comm.py.jinja",
    "runtime/attention.py.jinja",
    "runtime/decode.py.jinja",
    "runtime/qlinear.py.jinja",
    "runtime/routing.py.jinja",
    "runtime/moe.py.jinja",
)


def source(ring_depth: int) -> str:
    """The rendered module text."""
    from mkdsl.backends.tpu.emit import _env

    return _env().get_template("calibrate/runtime.py.jinja").render(ring_depth=ring_depth, runtime=list(PARTS))


@functools.cache
def module(ring_depth: int) -> types.ModuleType:
    """The rendered runtime as a module (registered in sys.modules: dataclasses need it)."""
    name = f"mkdsl_calibrate_runtime_{ring_depth}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(source(ring_depth), f"<{name}>", "exec"), mod.__dict__)  # noqa: S102 (mkdsl's own template)
    return mod
