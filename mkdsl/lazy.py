"""Import jax only when an op actually computes, so `mkdsl check` stays fast."""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule(ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self._target = name

    def __getattr__(self, attr: str):
        module = importlib.import_module(self._target)
        return getattr(module, attr)


jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")
