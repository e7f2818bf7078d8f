"""Per-device HBM: what one TPU7x core must hold (weights, the state at the largest batch and
the shortest cache the dims allow, the step's outputs), checked against the core's usable HBM;
the plan also reports the longest cache that fits at the largest batch.

TPU7x has 192 GiB of HBM per chip shared by its 2 TensorCores (Google Cloud's TPU7x
documentation, in ../shared/facts/tpu7x_pallas.md of the project's notes); a public kernel
measured about 94.7 GB usable per core, which is the budget here.
"""

from __future__ import annotations

from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.dtypes import storage_bytes
from mkdsl.lang.ir import Model, Tensor

HBM_PER_CORE = 96 * 2**30  # 192 GiB per TPU7x chip / 2 TensorCores
HBM_USABLE_PER_CORE = 94_700_000_000  # usable per core, as measured by a public TPU7x kernel
GB = 1e9


def size_text(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 100 else f"{n / 1e6:.2f} MB"


def hbm_line(plan) -> str:
    """The plan's HBM figure in words (plan.md and `mkdsl plan`)."""
    line = (
        f"HBM per device {size_text(plan.hbm_bytes)} of {HBM_USABLE_PER_CORE / GB:.1f} GB usable (weights, state at the "
        "largest batch and shortest cache)"
    )
    return line + (f"; caches fit up to {plan.hbm_max_cache} tokens at the largest batch" if plan.hbm_max_cache else "")


def build_sizes(model: Model, cache: str = "low", tokens: int | None = None) -> dict[str, int]:
    """Build-time dims: the batch at its largest, the cache dims at their `cache` end (or `tokens`)."""
    rows, *rest = model.dims
    return {rows.name: rows.high, **{d.name: tokens or getattr(d, cache) for d in rest}}


def tensor_bytes(t: Tensor, sizes: dict[str, int], padded: dict[str, dict[int, int]] | None = None) -> int:
    """One device's bytes of `t` as the kernel stores it (per-device shape, build dims at `sizes`,
    the axes its readers pad at their padded width: `padded[name] = {axis: width}`, `Plan.pads`)."""
    shape = [sizes.get(d, d) if isinstance(d, str) else d for d in t.full_shape]
    for axis, width in (padded or {}).get(t.name, {}).items():
        shape[axis] = width
    return storage_bytes(t.type.dtype, tuple(shape))


def hbm_items(model: Model, vocab: int, sizes: dict[str, int], padded: dict | None = None) -> list[tuple[str, int]]:
    """(what, bytes) one device holds: every tensor, then the step's outputs (logits, tokens)."""
    items = [(f"{t.kind} `{t.name}`", tensor_bytes(t, sizes, padded)) for t in model.tensors]
    return [*items, ("logits and next tokens", sizes[model.dims[0].name] * (vocab * 4 + 4))]


def max_cache(model: Model, vocab: int, padded: dict | None = None, batch: int | None = None) -> int:
    """The longest cache (within the cache dim's range) that fits at `batch` rows (default: the
    largest batch); 0 if none."""
    if len(model.dims) < 2:
        return 0
    lo, hi = model.dims[1].low, model.dims[1].high

    def fits(n: int) -> bool:
        sizes = {**build_sizes(model, tokens=n), **({model.dims[0].name: batch} if batch else {})}
        return sum(b for _, b in hbm_items(model, vocab, sizes, padded)) <= HBM_USABLE_PER_CORE

    if not fits(lo):
        return 0
    while lo < hi:  # state grows with the cache: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def check_hbm(model: Model, items: list[tuple[str, int]], devices: int) -> list[Diagnostic]:
    """A diagnostic at the largest tensor's declaration when one device's total exceeds its HBM."""
    total = sum(b for _, b in items)
    if total <= HBM_USABLE_PER_CORE:
        return []
    top = sorted(items, key=lambda i: -i[1])[:3]
    name = top[0][0].split("`")[1] if "`" in top[0][0] else None
    span = model.tensor(name).span if name else model.step.span
    where = f"per device ({devices} devices)" if devices > 1 else "on one device"
    shown = ", ".join(f"{what} {size_text(b)}" for what, b in top)
    return [
        Diagnostic(
            span,
            f"HBM capacity exceeded {where}: weights and state (batch {model.dims[0].high}, shortest cache) need {total / GB:.2f} GB of the "
            f"{HBM_USABLE_PER_CORE / GB:.1f} GB usable per TPU7x core; the largest: {shown}",
            "split the largest tensors over more devices (`mesh` and `@axis`), or store them in a smaller dtype",
        )
    ]


def check_capacity(model: Model, vocab: int, batch: int, context: int, padded: dict | None = None) -> list[Diagnostic]:
    """A diagnostic when `batch` rows with caches of `context + 1` tokens (weights, caches, state and
    outputs) do not fit one core's HBM, naming the longest context that does at that batch."""
    if len(model.dims) < 2:
        return []
    sizes = {model.dims[0].name: batch, **{d.name: max(d.low, context + 1) for d in model.dims[1:]}}
    total = sum(b for _, b in hbm_items(model, vocab, sizes, padded))
    if total <= HBM_USABLE_PER_CORE:
        return []
    most = max_cache(model, vocab, padded, batch)
    fit = (
        f"the largest context that fits at batch {batch} is {most - 1} tokens (a cache of {most})"
        if most
        else f"no cache of `{model.dims[1].name}` fits at batch {batch}"
    )
    return [
        Diagnostic(
            model.step.span,
            f"batch {batch} x context {context} does not fit in HBM: weights, caches and state need "
            f"{total / GB:.2f} GB per core of the {HBM_USABLE_PER_CORE / GB:.1f} GB usable per TPU7x core; {fit}",
            "a shorter context or a smaller batch, or split the caches over more devices (`mesh` and `@axis`)",
        )
    ]
