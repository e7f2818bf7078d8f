"""Compile a generated module with the real TPU compiler (libtpu) for a compile-only TPU7x topology.

No TPU is needed: `jax.experimental.topologies` gives compile-only TPU7x devices on a CPU, and
lowering runs under an abstract one-core TPU7x mesh for the Pallas lowerings that ask for the
TPU's parameters. libtpu does not report a successful kernel's VMEM use, so `compiler_vmem` reads
it from the error of a second compile with the module's VMEM limit patched to 4 MiB ("Scoped
allocation with size 44.80M and limit 4.00M exceeded ..."); that compile must fail, which also
shows the limit is enforced. Used by `mkdsl verify` and by the test suite's compile tests.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from types import ModuleType

from mkdsl.lazy import jax, jnp

MIB = 1 << 20
TINY_LIMIT = 4 * MIB
SCOPED = re.compile(r"Scoped allocation with size ([0-9.]+)([KMG]) and limit ([0-9.]+)([KMG])")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# Compile-only topologies by core count (TPU7x: two cores per chip, one JAX device each).
TOPOLOGIES = {1: "tpu7x:2x2x1", 8: "tpu7x:2x2x1", 32: "tpu7x:4x4x1", 128: "tpu7x:4x4x4"}


class CompilerVmemUnknown(Exception):
    """The 4 MiB-limit compile did not fail with a scoped-allocation figure."""


def tpu7x_devices(topology: str) -> list:
    """The compile-only TPU7x devices of a topology (e.g. tpu7x:2x2x1: 8 cores)."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def topology_for(module: ModuleType) -> str:
    """The smallest listed topology with at least as many cores as the module's mesh."""
    cores = math.prod(getattr(module, "MESH_SHAPE", (1,)))
    fits = [n for n in TOPOLOGIES if n >= cores]
    if not fits:
        raise ValueError(f"no compile-only TPU7x topology with {cores} cores")
    return TOPOLOGIES[min(fits)]


def _abstract_tpu7x_mesh():
    device = jax.sharding.AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    return jax.sharding.AbstractMesh((1,), ("_sim",), abstract_device=device)


def _verify(rows: int) -> tuple[tuple[int, ...], dict]:
    """The ids' trailing shape and the build options of a step with `rows` verify rows."""
    return ((rows,), {"verify_rows": rows}) if rows > 1 else ((), {})


def compile_one_core(module: ModuleType, device, batch: int, seq_len: int, rows: int = 1):
    """Lower and compile one decode step of a one-device module for `device`: (compiled, seconds).
    `rows`: verify rows per sequence (speculative decoding)."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    weights = {k: sds(v) for k, v in module.weight_layout().items()}
    state = {k: sds(v) for k, v in module.state_layout(batch, seq_len, rows).items()}
    trailing, options = _verify(rows)
    ints = jax.ShapeDtypeStruct((batch, *trailing), jnp.int32, sharding=sharding)
    step = module.build_decode_step(batch, seq_len, **options)

    def lower():
        with jax.sharding.use_abstract_mesh(_abstract_tpu7x_mesh()):
            return step.lower(weights, state, ints, ints)

    t0 = time.perf_counter()
    return _compiled(module, lower), time.perf_counter() - t0


def compile_sharded(module: ModuleType, devices: list, batch: int, seq_len: int, rows: int = 1):
    """Lower and compile one sharded decode step over `devices`: (compiled, seconds)."""
    mesh = module.make_mesh(devices[: math.prod(module.MESH_SHAPE)])
    ws, ss = module.weight_shardings(mesh), module.state_shardings(mesh)
    weights = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=ws[k]) for k, v in module.weight_layout().items()}
    state = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=ss[k])
        for k, v in module.state_layout(batch, seq_len, rows).items()
    }
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    trailing, options = _verify(rows)
    ints = jax.ShapeDtypeStruct((batch, *trailing), jnp.int32, sharding=whole)
    step = module.build_decode_step(batch, seq_len, mesh=mesh, **options)
    t0 = time.perf_counter()
    return _compiled(module, lambda: step.lower(weights, state, ints, ints)), time.perf_counter() - t0


def _compiled(module: ModuleType, lower: Callable[[], object]):
    """`lower()` compiled; a kernel Mosaic rejects (other than for its VMEM limit, which
    `compiler_vmem` provokes) raises `KernelCompileError` naming the spec line it came from."""
    from mkdsl.backends.tpu import mosaic_errors

    try:
        return lower().compile()
    except Exception as e:  # libtpu's MosaicError (a JaxRuntimeError subclass or not, by version)
        if not mosaic_errors.is_mosaic_failure(e) or "RESOURCE_EXHAUSTED" in str(e):
            raise
        raise mosaic_errors.explain(e, lower, module.__file__) from None


def compile_module(module: ModuleType, devices: list, batch: int, seq_len: int, rows: int = 1):
    """One decode step compiled for its devices, one-core or sharded: (compiled, seconds)."""
    if hasattr(module, "MESH_SHAPE"):
        return compile_sharded(module, devices, batch, seq_len, rows)
    return compile_one_core(module, devices[0], batch, seq_len, rows)


def compiler_vmem(
    module: ModuleType, compile_step: Callable[[ModuleType], object], limit: int = TINY_LIMIT
) -> tuple[float, float]:
    """(the compiler's scoped VMEM in bytes, seconds): `compile_step(module)` with a VMEM limit of
    `limit` (default 4 MiB; pass less than the kernel needs). Patches the module's VMEM_LIMIT_BYTES:
    pass a fresh import of the module."""
    module.VMEM_LIMIT_BYTES = limit
    t0 = time.perf_counter()
    try:
        compile_step(module)
    except jax.errors.JaxRuntimeError as e:
        message = str(e)
    else:
        raise CompilerVmemUnknown(f"the compile with a {limit / MIB:.2f} MiB VMEM limit succeeded")
    seconds = time.perf_counter() - t0
    m = SCOPED.search(message)
    if "RESOURCE_EXHAUSTED" not in message or not m:
        raise CompilerVmemUnknown(f"no scoped-allocation figure in the compiler's error:\n{message[:2000]}")
    if abs(float(m[3]) * UNITS[m[4]] - limit) >= 0.01 * limit:
        raise CompilerVmemUnknown(f"the {limit / MIB:.2f} MiB limit was not the one applied")
    return float(m[1]) * UNITS[m[2]], seconds


def missing() -> str | None:
    """Why libtpu cannot compile here (it is not installed), or None. Checked before slow work."""
    import importlib.util

    try:
        found = importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return "libtpu (the TPU compiler) is not installed: `pip install -e '.[tpu]'` installs it"


_KERNEL_LINE = re.compile(r"kernel[\w]*\.py\"?[:,]\s*(?:line\s+)?(\d+)")
_SPEC_LINE = re.compile(r"# spec line (\d+)")
_MESSAGE = re.compile(r"(Mosaic|INTERNAL|error:|Error:|failed)")


def describe_failure(output: str, kernel: str) -> str:
    """A libtpu failure as a compiler error: the compiler's own message (Mosaic's, not the Python
    traceback around it) and, where it names a line of the generated kernel, the spec line that
    line was generated from (the kernel's `# spec line N` comments)."""
    lines = [s for s in output.splitlines() if s.strip() and not s.startswith(("Traceback", "  File", "    "))]
    message = "\n".join(s for s in lines if _MESSAGE.search(s)) or "\n".join(lines[-3:])
    where = ""
    at = _KERNEL_LINE.findall(output)
    if at:
        above = kernel.splitlines()[: int(at[-1])]
        spec = next((m[1] for s in reversed(above) if (m := _SPEC_LINE.search(s))), None)
        if spec:
            where = f" (generated from spec line {spec})"
    return f"libtpu failed to compile the kernel{where}:\n{message[-3000:]}"
