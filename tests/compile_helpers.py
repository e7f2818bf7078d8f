"""What the libtpu compile tests share: the package's compile helpers (mkdsl/backends/tpu/libtpu.py: the
compile-only TPU7x devices, one-core and sharded compiles, the compiler's VMEM figure read from a
4 MiB-limit compile), a fresh import of a generated module, and a section in pytest's terminal
summary. libtpu comes with the `test` extra (jax[tpu]), so a missing topology is a failure, never
a skip.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from mkdsl.backends.tpu.libtpu import MIB, compile_one_core, compile_sharded, compiler_vmem, tpu7x_devices

__all__ = ["MIB", "compile_one_core", "compile_sharded", "compiler_vmem", "tpu7x_devices", "load_module"]


def load_module(path: Path, name: str) -> ModuleType:
    """A fresh import of a generated module (tests patch its VMEM limit)."""
    spec = importlib.util.spec_from_file_location(f"{name}_{id(object())}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Summary:
    """A titled section of lines in pytest's terminal summary."""

    def __init__(self, title: str):
        self.title = title
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        print("\n" + line)
        self.lines.append(line)

    def pytest_terminal_summary(self, terminalreporter):
        if self.lines:
            terminalreporter.section(self.title)
            for line in self.lines:
                terminalreporter.write_line(line)


def summary_fixture(title: str):
    """A module-scoped fixture yielding a registered Summary."""

    @pytest.fixture(scope="module")
    def summary(pytestconfig):
        plugin = Summary(title)
        pytestconfig.pluginmanager.register(plugin, f"mkdsl_summary_{id(plugin)}")
        yield plugin
        pytestconfig.pluginmanager.unregister(plugin)

    return summary
