"""The plan report (`plan.md` beside each kernel, and `mkdsl plan --full`): where the time goes
(timing.py, with the picture of svg.py), phases, the DMA schedule, the VMEM table,
bytes per step, the HBM floor and the modeled time. Every time is modeled."""

from __future__ import annotations

from mkdsl.lang.ir import Model
from mkdsl.plan import collectives, speculative
from mkdsl.plan.breakdown import breakdown
from mkdsl.plan.hbm import hbm_line
from mkdsl.plan.types import Plan
from mkdsl.plan.vmem import MIB
from mkdsl.report.svg import render_svg
from mkdsl.report.timing import assumptions_section, time_section, verdict


def _header(model: Model, plan: Plan, spec_path: str, wide: Plan | None) -> list[str]:
    """The title, what the figures are for, and the command that prints them."""
    profile = f" --profile {model.profile}" if model.profile else ""
    other = (
        f" (`--batch {wide.batch}` the batch-{wide.batch} rows)"
        if wide is not None and wide.batch != plan.batch
        else ""
    )
    return [
        f"# {model.name}: decode step plan",
        "",
        f"Spec `{spec_path}`, profile {model.profile or 'none'}. Figures for batch {plan.batch} "
        f"(rows padded to {plan.rows}) with {plan.context} cached tokens per row.",
        "No TPU measured anything here: every time below is **modeled**, the conservative reading unless it "
        "says optimistic (docs/performance.md says what each reading grants); "
        f"`mkdsl plan {spec_path}{profile} --full` prints them{other}.",
        "",
    ]


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


def _dims(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# Public figures for comparison, measured on hardware by others (not by mkdsl).
PUBLIC = {
    "kimi_k3": (
        "709 accepted tokens/s: a hand-written Pallas megakernel on 16 TPU7x chips (32 cores), speculative "
        "decoding with 8 rows per step and acceptance length 6",
        "452 tokens/s on 16 GB200 GPUs",
    ),
}


def render_plan(model: Model, plan: Plan, spec_path: str, wide: Plan | None = None, verify: Plan | None = None) -> str:
    """Markdown; deterministic for the same model and plan. `wide`: the plan at the largest batch,
    for the speculative-decoding comparison of sharded models; `verify`: the verify step of
    speculative.PUBLIC_ROWS rows (`make_plan(verify_rows=...)`), when it differs from `wide`."""
    t = plan.timing
    out = [
        *_header(model, plan, spec_path, wide),
        *time_section(model, plan, breakdown(model, plan)),
        *assumptions_section(plan, spec_path),
        "## Summary (modeled)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| weight bytes per step | {_bytes(plan.weight_bytes)} |",
        f"| state bytes per step (KV read + written) | {_bytes(plan.state_bytes)} |",
        f"| bytes the schedule moves | {_bytes(plan.schedule_bytes)} |",
        f"| HBM floor at {t.hbm_bytes_per_s / 1e12:.2f} TB/s (modeled) | {t.floor_us:.1f} us |",
        f"| modeled step time (conservative) | {t.modeled_us:.1f} us ({t.modeled_us / t.floor_us:.3f} x floor) |",
        f"| modeled step time, optimistic (see Assumptions) | {t.optimistic_us:.1f} us |",
        f"| modeled tokens/s per sequence | {t.tokens_per_s:.1f} |",
        f"| DMAs per step | {plan.dma_count} |",
        f"| VMEM planned (explicit) | {_mib(plan.vmem_total)} of {_mib(plan.vmem_cap)} cap |",
        "| HBM per device | " + hbm_line(plan).removeprefix("HBM per device ") + " |",
        "",
        "Modeled time = dispatch + every phase in order, each op max(its compute, its bytes not yet landed)"
        + (", each collective its exchange phases:" if plan.mesh else ":"),
        f"stream {t.stream_us:.1f} us (every phase's bytes at its measured rate), compute {t.compute_us:.1f} us "
        f"(of which MXU at peak {t.mxu_us:.1f} us), dispatch {t.fixed_us:.1f} us per step"
        + (f", collectives {t.comm_us:.1f} us" if plan.mesh else "")
        + f"; overlapped {t.overlap_us:.1f} us.",
        "",
        *(_devices(model, plan, wide, verify) if plan.mesh else []),
        "## Layers",
        "",
        "| kind | layers | count |",
        "|---|---|---|",
    ]
    for k in model.kinds:
        idx = [i for i, name in enumerate(model.schedule) if name == k.name]
        shown = ", ".join(map(str, idx[:12])) + (", ..." if len(idx) > 12 else "")
        out.append(f"| {k.name} | {shown} | {len(idx)} |")
    out += [
        "",
        "## Phases and weight streams",
        "",
        f"One ring of {plan.ring_depth} VMEM banks of [{plan.bank[0]}, {plan.bank[1]}] bf16; "
        f"{plan.ring_depth - 1} tiles stay in flight across op and layer boundaries and into the epilogue. "
        f"KV caches stream in {plan.kv_tile}-token tiles.",
        "",
    ]
    out += _phases(model, plan)
    split = traffic_split(model, plan)
    out += ["## Bytes per step", "", "| share | bytes per step | of all |", "|---|---|---|"]
    total = sum(split.values()) or 1
    for name, size in split.items():
        out.append(f"| {name} | {_bytes(size)} | {100 * size / total:.1f}% |")
    out += ["", "| tensor | kind | read by | bytes per step |", "|---|---|---|---|"]
    for tt in plan.traffic:
        out.append(f"| `{tt.name}` | {tt.kind} | {tt.group} | {_bytes(tt.bytes)} |")
    out += [
        "",
        "## VMEM budget",
        "",
        "Sizes padded to Mosaic's tiles (f32 [8,128], bf16 [16,128], 8-bit [32,128]); `rows` and `batch` "
        f"at {plan.rows} and {plan.batch}{_wire_rows(plan)}.",
        "",
        "| buffer | shape | dtype | memory | bytes | purpose | spec line |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in plan.vmem:
        size = _mib(a.bytes) if a.memory == "VMEM" else (f"{a.bytes} B" if a.memory == "SMEM" else "")
        out.append(
            f"| `{a.name}` | {_dims(a.shape)} | {a.dtype} | {a.memory} | {size} | {a.purpose} | {a.line or ''} |"
        )
    out += ["", f"Total VMEM: {_mib(plan.vmem_total)} of the {_mib(plan.vmem_cap)} cap.", ""]
    return "\n".join(out)


def _wire_rows(plan: Plan) -> str:
    """The rows the collectives' messages carry, where the VMEM table has buffers sized by them."""
    if not any(d == "wire_rows" for a in plan.vmem for d in a.shape):
        return ""
    rows = collectives.exchange_rows(plan.batch)
    return f", `wire_rows` (rows on the wire) at {rows}" + (
        " (1-row comm buffers at their (1, 128) tile)" if rows == 1 else ""
    )


def _phases(model: Model, plan: Plan) -> list[str]:
    """One table per tile sequence: each op of the layer kind (or the prologue, the epilogue) and its stream."""
    out: list[str] = []
    for seq in plan.sequences:
        step = seq.name in ("prologue", "epilogue")
        g = model.step if step else model.kind(seq.name)
        out += [
            f"### {seq.name} ({seq.tiles} weight tiles{' per layer' if not step else ''})",
            "",
            "| phase | op | spec line | weight | tile | tiles |",
            "|---|---|---|---|---|---|",
        ]
        streams = {st.node: st for st in seq.streams}
        during = {i: value for graph, value, run in plan.windows if graph == seq.name for i in run}
        nodes = g.nodes
        if step:
            cut = next((i for i, n in enumerate(nodes) if n.op == "layers"), -1)
            nodes = nodes[cut + 1 :] if seq.name == "epilogue" else nodes[:cut]
        for i, n in enumerate(nodes):
            if n.op == "layers":
                continue
            st = streams.get(n.outputs[0].name) if n.outputs else None
            w = f"`{st.tensor}` [{st.k}, {st.n}]" if st else ""
            tile = f"[{st.tk}, {st.tn}]" if st else ""
            op = f"{n.op} -> `{n.outputs[0].name}`" + (
                f" (during the exchange of `{during[i]}`)" if i in during else ""
            )
            out.append(f"| {i} | {op} | {n.span.line} | {w} | {tile} | {st.tiles if st else ''} |")
        out.append("")
    return out


def render_picture(model: Model, plan: Plan) -> str:
    """plan.svg, the picture plan.md links: the step by layer kind and cost kind, and VMEM."""
    b = breakdown(model, plan)
    return render_svg(model, plan, b, verdict(model, b, plan))


def _devices(model: Model, plan: Plan, wide: Plan | None, verify: Plan | None = None) -> list[str]:
    """The sharded step: mesh, per-core figures, collectives and the modeled tokens/s of the whole mesh."""
    t = plan.timing
    mesh = " x ".join(f"{name} {size}" for name, size in plan.mesh)
    chips = plan.devices / 2
    out = [
        "## Devices and collectives (modeled)",
        "",
        f"Mesh {mesh} = {plan.devices} devices (TPU7x cores; {chips:g} chips of 2 cores). Every byte, VMEM "
        "and time figure in this report is **per core**: each device runs the per-device model; the step "
        "time is the same on every core (they exchange values every layer).",
        "",
        "| figure (modeled) | value |",
        "|---|---|",
        f"| weight + state bytes per core per step | {_bytes(plan.weight_bytes + plan.state_bytes)} |",
        f"| HBM floor per core at {t.hbm_bytes_per_s / 1e12:.2f} TB/s | {t.floor_us:.1f} us |",
        f"| exchange phases per step | {plan.exchange_phases} |",
        f"| collectives per step | {t.comm_us:.1f} us |",
        f"| modeled step time (conservative) | {t.modeled_us:.1f} us |",
        f"| modeled tokens/s, {plan.devices} cores ({chips:g} chips), batch {plan.batch} | "
        f"{plan.batch * 1e6 / t.modeled_us:.1f} |",
    ]
    if wide is not None and wide.batch >= speculative.PUBLIC_ROWS:
        out += _speculative_rows(model, plan, wide, verify)
    out.append(f"| collectives' wire type (all-reduce partial sums) | {plan.wire} |")
    for line in PUBLIC.get(model.name, ()):
        out.append(f"| public, measured (not mkdsl) | {line} |")
    out += [
        "",
        "Collectives exchange directly: in one phase every core sends a message to each peer of its group "
        "(the cores that differ only in the collective's mesh axes), then waits for theirs. Messages carry the "
        "batch's rows only, as int32 lanes (f32 bits, or two bf16 values per lane on a bf16 wire). An all-gather "
        "and an argmax take one phase; an all-reduce runs as the cheapest modeled of reduce-scatter + all-gather "
        "(rs_ag, two phases), one phase of whole partials (oneshot) and chip first (hier: the chip's two cores "
        "reduce-scatter halves, the chips all-reduce the half, the cores gather the halves). Phase costs "
        f"(measured components): the chip's other core {collectives.measured.SIBLING_COPY_US} us + bytes at "
        f"{collectives.measured.SIBLING_COPY_BYTES_PER_S / 1e9:g} GB/s, one cross-chip peer "
        f"{collectives.measured.CROSS_CHIP_COPY_US} us + bytes at "
        f"{collectives.measured.CROSS_CHIP_COPY_BYTES_PER_S / 1e9:g} GB/s, several peers "
        f"{collectives.direct_latency_us(7):.2f} us at 7 peers (measured; a straight line through 1 and 7 peers "
        f"elsewhere, extrapolated above 7: {collectives.direct_latency_us(31):.2f} us at 31) + all the bytes a core "
        f"sends at {collectives.measured.DIRECT_BYTES_PER_S / 1e9:g} GB/s. Collectives ready together (none needs "
        "another's result) share their first phase: one exchange to the union of their peers, all their bytes "
        "(`one exchange with`).",
        "",
        "| graph | collective | value | axes | phases (peers each) | bytes a core sends per phase | modeled us | spec line |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in plan.collectives:
        peers = ", ".join(str(p.peers) for p in c.phases)
        sent = ", ".join(_bytes(p.bytes) for p in c.phases)
        values = ", ".join(f"`{m.value}`" for m in c.apart())
        axes = "; ".join(", ".join(m.axes) for m in c.apart())
        out.append(
            f"| {c.graph} | {c.label} | {values} | {axes} | {len(c.phases)} ({peers}) "
            f"| {sent} | {c.time_us():.1f} | {c.line} |"
        )
    out.append("")
    return out


def _speculative_rows(model: Model, plan: Plan, wide: Plan, verify: Plan | None) -> list[str]:
    """The modeled speculative figure at the public setting (one sequence, 8 rows verified per
    step, 6 accepted) with the n-gram drafter: mkdsl/plan/speculative.py, each part shown."""
    from mkdsl.plan import make_plan

    rows = speculative.PUBLIC_ROWS
    if verify is None:
        verify = (
            wide
            if wide.batch == rows
            else make_plan(model, batch=rows, context=plan.context, ring_depth=wide.ring_depth, verify_rows=rows)
        )
    figure = speculative.ngram(1, rows, speculative.PUBLIC_ACCEPTANCE, verify.timing.modeled_us)
    series = sum(a.effect_us for a in verify.timing.assumptions if a.name == "rows_in_series")
    what = f"; {series:.1f} us of it the recurrent state of the rows in series" if series else ""
    return [
        f"| modeled step time of the verify step of {rows} rows (one sequence; conservative{what}) | {verify.timing.modeled_us:.1f} us |",
        f"| modeled accepted tokens/s, speculative decoding: one sequence, {rows} rows verified per step, "
        f"acceptance {figure.acceptance:g} (the public setting), n-gram drafter on the host, accept step "
        f"estimated (`mkdsl plan --draft`) | {figure.formula()} |",
    ]


def traffic_split(model: Model, plan: Plan) -> dict[str, int]:
    """Bytes per step in five shares: routed experts, attention (the blocks that attend), other
    dense weights, the output head (and embedding rows), KV cache and recurrent state."""
    from mkdsl.ops import OPS

    attending = {n.block or "layer" for k in model.kinds for n in k.nodes if OPS[n.op].attends}
    split = {"experts": 0, "attention": 0, "other dense": 0, "lm_head and embedding": 0, "KV cache and state": 0}
    for tt in plan.traffic:
        if tt.kind == "state":
            split["KV cache and state"] += tt.bytes
        elif tt.group == "experts":
            split["experts"] += tt.bytes
        elif tt.group in attending:
            split["attention"] += tt.bytes
        elif tt.group in ("output", "input"):
            split["lm_head and embedding"] += tt.bytes
        else:
            split["other dense"] += tt.bytes
    return split
