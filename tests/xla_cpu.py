"""XLA_FLAGS for the test suite's processes: tests/conftest.py sets them for pytest's workers (and
so for every subprocess that inherits the environment); the subprocesses that choose their own
virtual device count take them from `xla_flags`.

Most of the suite's time is XLA:CPU compiling many small programs: the unfused references, eager
ops, and the interpret-mode kernels, whose work is in host callbacks rather than compiled code.
With LLVM at optimisation level 0 and without XLA:CPU's fusion emitters those programs compile
about twice as fast and run no slower. Measured on the 2-core dev machine: 183 reference-heavy
tests (tests/test_ops_*.py and four others) 88 -> 41 s; test_kernel_interpret 44 -> 27 s; the
Kimi K3 mini kernel tests 96 -> 93 s. Real weights are the exception: at SmolLM2-135M's size
the interpreted kernel's matmuls and dequantisation are compiled code worth optimising
(tests/test_speculative_cli.py's two `mkdsl run --interpret`: 104 s optimised, 160 s without), so
such subprocesses get `optimised` flags. The programs perform the same IEEE operations, and every
tolerance in the suite is derived from the arithmetic, not from one compiler's rounding. libtpu's
TPU7x compiles are unaffected: the compiled text of tiny, llama3_8b and qwen3_30b_a3b was
byte-identical with and without these flags.
"""

from __future__ import annotations

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int | None = None, base: str = "") -> str:
    """`base` (e.g. the inherited XLA_FLAGS) with the fast-compile flags, and `devices` virtual
    CPU devices unless `base` already asks for a count."""
    flags = base.split()
    flags += [f for f in FAST_COMPILE.split() if f.split("=")[0] not in base]
    if devices is not None and "xla_force_host_platform_device_count" not in base:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def optimised(flags: str) -> str:
    """`flags` without the fast-compile ones: XLA:CPU's default optimisation, for a process whose
    time is in running large compiled programs rather than in compiling many small ones."""
    fast = FAST_COMPILE.split()
    return " ".join(f for f in flags.split() if f not in fast)
