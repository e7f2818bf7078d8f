"""libtpu's static schedule of a spec's kernel, read without a TPU: `mkdsl plan --static` for one
spec, `mkdsl static-costs` for every spec (the committed specs/costs/<spec>.json that `mkdsl plan`
and `compile` use by default). Every time derived from it is *modeled* (an assumed clock)."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mkdsl.backends.tpu import bundle_dump, bundles
from mkdsl.backends.tpu.bundle_dump import DumpError
from mkdsl.backends.tpu.libtpu import describe_failure


@dataclass(frozen=True)
class StaticRead:
    out: object  # the compiler's Output
    dump: object  # bundle_dump.KernelDump (its files are gone; names and sizes stay)
    timings: list
    total_bundles: int


def seq_len(context: int | None, kv_tile: int) -> int:
    """The cache length to compile for: the context and the new token, in whole KV tiles (0: the
    default, two tiles). The loops' code does not depend on it."""
    return -(-(context + 1) // kv_tile) * kv_tile if context else 0


def read_schedule(source: str, spec: str, profile: str | None, batch: int, context: int | None, clock: float):
    """Compile the spec's kernel with libtpu (compile-only TPU7x) and time every loop of its final
    bundles. Raises bundle_dump.DumpError, with the op and spec line described, when the compile fails."""
    from mkdsl.compiler import compile_source

    out, _ = compile_source(source, spec, profile, None)
    with tempfile.TemporaryDirectory(prefix="mkdsl-static-") as tmp:
        kernel = Path(tmp) / "kernel.py"
        kernel.write_text(out.files["kernel.py"], encoding="utf-8")
        try:
            dump = bundle_dump.dump_kernel(kernel, batch, seq_len(context, out.plan.kv_tile), Path(tmp) / "dump")
        except DumpError as e:  # name the op and the spec line Mosaic refused, from the kernel's comments
            raise DumpError(describe_failure(str(e), out.files["kernel.py"])) from None
        found = bundles.parse_bundles(dump.bundles.read_text())
        util = bundles.parse_utilization(dump.utilization.read_text()) if dump.utilization else None
        timings = bundles.time_loops(found, util, clock_hz=clock)
    return StaticRead(out, dump, timings, len(found))


def save_costs(read: StaticRead, spec: str, batch: int, clock: float, path: Path) -> dict:
    """Write the cost model's static figures (per-op ratios, the per-layer code) to `path`, with the
    hash of the spec they were read from."""
    from mkdsl.lang.elaborate import spec_sha256
    from mkdsl.plan import static_costs

    ratios, skipped = static_costs.ratios(read.out.model, read.out.plan, read.timings)
    code = static_costs.layer_code_us(read.timings)
    source = f"mkdsl plan {spec} --static (libtpu, {read.dump.topology}, batch {batch}), loops matched by bytes"
    sha = spec_sha256(Path(spec).read_text(encoding="utf-8"))
    static_costs.save(path, ratios, skipped, clock, source, code, sha)
    return {**ratios, **({"layer_code_us": code} if code is not None else {})}


def write_all(specs: list[str], clock: float) -> int:
    """`mkdsl static-costs`: each spec's kernel compiled with libtpu, one after the other (each
    compile is large), its figures written to specs/costs/<spec>.json. Returns the failures."""
    from mkdsl.backends.tpu.bundle_dump import DumpError
    from mkdsl.lang.diagnostics import SpecError
    from mkdsl.plan import static_costs

    failed = 0
    for spec in specs:
        start, path = time.monotonic(), static_costs.default_path(spec)
        try:
            read = read_schedule(Path(spec).read_text(encoding="utf-8"), spec, None, 1, None, clock)
            found = save_costs(read, spec, 1, clock, path)
        except (DumpError, OSError, SpecError) as e:
            failed += 1
            print(f"{spec}: not read ({e}); `mkdsl plan` keeps the per-op estimate for it", file=sys.stderr)
            continue
        code = found.get("layer_code_us")
        print(
            f"{spec}: {read.total_bundles} bundles, {len(found)} figures, per-layer code "
            f"{f'{code:.2f} us' if code is not None else 'not found'} -> {path} ({time.monotonic() - start:.0f} s)"
        )
    return failed
