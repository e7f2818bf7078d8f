"""What the libtpu compile tests share: compile-only TPU7x devices, a fresh import of a generated
module, the compiler's VMEM figure, and a section in pytest's terminal summary.

libtpu does not report a successful kernel's VMEM use, so `compiler_vmem` reads it from the error
of a second compile with the module's VMEM limit patched to 4 MiB: "Scoped allocation with size
44.80M and limit 4.00M exceeded ..." (M = MiB). That compile must fail with RESOURCE_EXHAUSTED,
which also shows the limit is enforced. libtpu comes with the `test` extra (jax[tpu]), so a
missing topology is a failure, never a skip.
"""

from __future__ import annotations

import importlib.util
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies

MIB = 1 << 20
TINY_LIMIT = 4 * MIB
SCOPED = re.compile(r"Scoped allocation with size ([0-9.]+)([KMG]) and limit ([0-9.]+)([KMG])")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def tpu7x_devices(topology: str) -> list:
    """The compile-only TPU7x devices of a topology (e.g. tpu7x:2x2x1: 8 cores)."""
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def load_module(path: Path, name: str) -> ModuleType:
    """A fresh import of a generated module (tests patch its VMEM limit)."""
    spec = importlib.util.spec_from_file_location(f"{name}_{id(object())}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_one_core(module: ModuleType, device, batch: int, seq_len: int):
    """Lower and compile one decode step of a one-device module for `device`; returns (compiled,
    seconds). Lowering runs under an abstract one-core TPU7x mesh: some Pallas lowerings ask for
    the TPU's parameters, which a CPU process has no device to give."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    weights = {k: sds(v) for k, v in module.weight_layout().items()}
    state = {k: sds(v) for k, v in module.state_layout(batch, seq_len).items()}
    ints = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sharding)
    step = module.build_decode_step(batch, seq_len)
    mesh = jax.sharding.AbstractMesh(
        (1,), ("_sim",), abstract_device=jax.sharding.AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    )
    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = step.lower(weights, state, ints, ints)
    return lowered.compile(), time.perf_counter() - t0


def compiler_vmem(module: ModuleType, compile_step: Callable[[ModuleType], object]) -> tuple[float, float]:
    """(the compiler's scoped VMEM in bytes, seconds of the failing compile): `compile_step(module)`
    run with the module's limit at 4 MiB."""
    module.VMEM_LIMIT_BYTES = TINY_LIMIT
    t0 = time.perf_counter()
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as e:
        compile_step(module)
    seconds = time.perf_counter() - t0
    m = SCOPED.search(str(e.value))
    assert m, f"no scoped-allocation figure in the compiler's error:\n{str(e.value)[:2000]}"
    assert abs(float(m[3]) * UNITS[m[4]] - TINY_LIMIT) < 0.01 * MIB, "the tiny limit was not the one applied"
    return float(m[1]) * UNITS[m[2]], seconds


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
