"""`mkdsl bench`: time the generated kernel's decode step and set it beside the HBM floor.

On a TPU the step is compiled and timed natively: ms per step, tokens per second (batch rows
per step) and the share of the HBM floor it reaches (the plan's bytes per step / the HBM
bandwidth of plan/cost_model.py, over the measured time). Anywhere else it runs in TPU
interpret mode on the CPU, and the output says that those timings are not TPU timings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from mkdsl.api import Spec, build_step, kernel_weights, load_kernel, random_inputs


@dataclass(frozen=True)
class BenchRow:
    batch: int
    context: int
    ms_per_step: float
    floor_us: float  # the plan's HBM floor for this batch and context
    model_us: float = 0.0  # the cost model's step (conservative) for this batch and context

    @property
    def model_ratio(self) -> float:
        """The measured step over the model's: above 1, the model is optimistic."""
        return self.ms_per_step * 1e3 / self.model_us if self.model_us else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1e3 / self.ms_per_step

    @property
    def floor_share(self) -> float:
        """The HBM floor over the measured step: 1.0 means the step runs at the floor."""
        return self.floor_us / (self.ms_per_step * 1e3)


def on_tpu() -> bool:
    import jax

    return jax.default_backend() == "tpu"


def modeled(spec: Spec, batch: int, context: int):
    """The plan's Timing for this batch and context, as `mkdsl plan SPEC` models it (the spec's
    committed static costs; the constants in force: a calibration's when one is applied). Raises
    SpecError when the batch x context does not fit in HBM: call it before any slow work."""
    from mkdsl.plan import make_plan, static_costs

    static, where = static_costs.default_costs(spec.path, spec.profile)
    return make_plan(spec.local, batch=batch, context=context, static=static, static_from=where).timing


def bench_batch(spec: Spec, module, batch: int, seq_len: int, steps: int, weights=None, mesh=None) -> BenchRow:
    """Time `steps` decode steps at the last cache position (after one untimed, compiling step)."""
    import jax
    import jax.numpy as jnp

    ref_weights, state = random_inputs(spec, batch=batch, seq_len=seq_len, seed=batch)
    weights = kernel_weights(ref_weights if weights is None else weights)
    if hasattr(module, "pad_weights"):  # narrow outputs are stored padded (module.PADDED)
        weights = module.pad_weights(weights)
    if mesh is not None:
        weights = module.place_weights(weights, mesh)
    options = {"mesh": mesh} if mesh is not None else {}
    step = build_step(spec, batch, seq_len, interpret=not on_tpu(), module=module, **options)
    state = {k: jnp.asarray(v) for k, v in state.items()}
    tokens = jnp.zeros((batch,), jnp.int32)
    positions = jnp.full((batch,), seq_len - 1, jnp.int32)  # attend over the whole cache
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        logits, tokens, state = step(weights, state, tokens, positions)
        jax.block_until_ready(logits)
        if i:
            times.append(time.perf_counter() - start)
    t = modeled(spec, batch, seq_len - 1)
    return BenchRow(batch, seq_len - 1, statistics.median(times) * 1e3, t.floor_us, t.modeled_us)


def bench(spec: Spec, batches: list[int], seq_len: int, steps: int = 3, weights=None, progress=None) -> list[BenchRow]:
    module = load_kernel(spec)
    mesh = module.make_mesh() if hasattr(module, "MESH_SHAPE") else None
    rows = []
    for b in batches:
        rows.append(bench_batch(spec, module, b, seq_len, steps, weights, mesh))
        if progress:
            progress(rows[-1])
    return rows


def render(spec: Spec, rows: list[BenchRow], native: bool) -> str:
    where = "TPU (native)" if native else "CPU, TPU interpret mode"
    lines = [f"{spec.path}{f' (profile {spec.profile})' if spec.profile else ''} on {where}"]
    lines.append(
        f"{'batch':>5} {'context':>8} {'ms/step':>10} {'tokens/s':>10} {'HBM floor us':>13} {'% of floor':>10}"
        + (f" {'model us':>10} {'measured/model':>15}" if native else "")
    )
    for r in rows:
        lines.append(
            f"{r.batch:>5} {r.context:>8} {r.ms_per_step:>10.3f} {r.tokens_per_s:>10.2f} "
            f"{r.floor_us:>13.1f} {100 * r.floor_share:>9.3f}%"
            + (f" {r.model_us:>10.1f} {r.model_ratio:>15.3f}" if native else "")
        )
    if not native:
        lines.append(
            "note: these are CPU timings of the TPU interpreter, not TPU timings; "
            "the HBM floor is the TPU7x figure (the plan's bytes / HBM bandwidth)."
        )
    return "\n".join(lines)


def parse_batches(values: list[str] | None, low: int, high: int, default: list[int]) -> list[int]:
    """`--batch 4`, `--batch 1..8` (repeatable) -> sorted batches; ValueError outside low..high."""
    out: set[int] = set()
    for v in values or []:
        a, _, b = v.partition("..")
        try:
            first, last = int(a), int(b or a)
        except ValueError:
            raise ValueError(f"--batch {v}: expected N or A..B") from None
        if not low <= first <= last <= high:
            raise ValueError(f"--batch {v} is outside {low} .. {high}")
        out.update(range(first, last + 1))
    return sorted(out) or default


__all__ = ["BenchRow", "bench", "parse_batches", "render"]
