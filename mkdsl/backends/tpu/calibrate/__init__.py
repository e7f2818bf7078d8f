"""`mkdsl calibrate`: microbenchmarks built by mkdsl for the constants of plan/measured.py, timed on
a TPU into a calibration file that `mkdsl plan --calibration FILE` (and `bench`) read instead of
the borrowed constants. With `--interpret` every microbenchmark runs in TPU interpret mode on the
CPU at tiny sizes and only its *result* is checked (CPU times say nothing about a TPU): CI proves
they run. The suite and what each constant is derived from: suite.py."""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = "mkdsl-calibration/1"


def read(path: Path) -> dict[str, float]:
    """The constants of a calibration file (name -> value). Raises ValueError on anything else."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("constants"), dict):
        raise ValueError(f"not a calibration file (`schema` {SCHEMA!r} and `constants`; `mkdsl calibrate` writes one)")
    try:
        return {str(k): float(v) for k, v in data["constants"].items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"a constant is not a number: {e}") from None


def write(path: Path, constants: dict[str, float], meta: dict, results: list[dict]) -> None:
    """The calibration file, whole or not at all."""
    data = {"schema": SCHEMA, **meta, "constants": dict(sorted(constants.items())), "benchmarks": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def calibrate(out: Path | None, interpret: bool, devices: int) -> int:
    """Run the suite (timed on a TPU; results checked everywhere), print a line per microbenchmark,
    write the calibration file. Returns the count of microbenchmarks that failed."""
    import importlib.metadata
    import sys

    import jax

    from mkdsl.backends.tpu.calibrate import suite
    from mkdsl.backends.tpu.interpret import interpret_params

    on_tpu = jax.default_backend() == "tpu" and not interpret
    interp = None if on_tpu else interpret_params()
    tiny = not on_tpu
    benches = [
        *suite.stream_benches(tiny, interp),
        *suite.exchange_benches(tiny, devices, interp),
        *suite.compute_benches(tiny, interp),
    ]
    for b in benches:
        suite.run(b, timed=on_tpu)
        shown = f"{b.seconds * 1e6:10.1f} us" if b.seconds else ("checked" if b.checked else "FAILED")
        print(
            f"{b.name:<44} {shown}{f'  {b.error}' if b.error else ''}", file=sys.stdout if not b.error else sys.stderr
        )
    failed = sum(1 for b in benches if not b.checked)
    constants = suite.derive(benches, devices) if on_tpu and not failed else {}
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "not installed"
    dev = jax.devices()[0]
    meta = {
        "device_kind": dev.device_kind
        if on_tpu
        else f"{dev.platform} (TPU interpret mode: results checked, not timed)",
        "topology": f"{devices} devices" + (f" of {len(jax.devices())}" if on_tpu else " (virtual)"),
        "jax": jax.__version__,
        "libtpu": libtpu,
        "timed": on_tpu,
    }
    results = [
        {
            "name": b.name,
            "group": b.group,
            "params": b.params,
            "seconds": b.seconds,
            "checked": b.checked,
            "error": b.error,
        }
        for b in benches
    ]
    if out is not None and not failed:
        write(out, constants, meta, results)
        print(f"{len(benches)} microbenchmarks checked; {len(constants)} constants -> {out}")
    return failed
