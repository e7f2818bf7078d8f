"""Read libtpu's final VLIW bundles of a Mosaic kernel and time each loop against its stream.

libtpu writes, per kernel, `*-final_bundles.txt` (one line per bundle: address, an optional
control-target marker such as `LB` for the first bundle of a loop body, `>` per loop depth, the
bundle's instructions in braces and region comments) and
`*-final_hlo-static-per-bundle-utilization.txt` (per bundle, the slots used of each unit). A loop
is the span from a bundle marked `LB` to the last bundle that branches back to a region that
bundle starts. One iteration issues the bundles of one path through the body (the longest feasible
one is taken: mkdsl/backends/tpu/bundle_paths.py), one bundle per cycle at most, so that count at an assumed
clock is a floor on its compute time; the bytes it waits for (`dma.done.wait` amounts, in 32-byte
granules) over the stream bandwidth is its stream time. Used by `mkdsl plan --static`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mkdsl.backends.tpu.bundle_paths import longest_path, region_starts

# One DMA granule is 32 bytes: the waits of mkdsl's streamed [K, N] bf16 tiles count K*N*2/32
# (tests/test_bundles.py checks this on a committed dump against the plan's tile bytes).
GRANULE_BYTES = 32
# TPU7x's clock is not public; bundles are timed at this assumed rate (stated in every report).
ASSUMED_CLOCK_HZ = 1.9e9
# Achieved HBM stream of a dense-weight ring of 2 MiB banks on one TPU7x core, measured in
# isolation on real hardware (public component measurements of a hand-written megakernel, 2026).
STREAM_BYTES_PER_S = 3.05e12

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+([A-Z]{2})?:\s*(>*)\s*\{", re.M)
_STARTS = re.compile(r"Start region (\d+)")
_TARGET = re.compile(r"target = \$region(\d+)")
_WAIT = re.compile(r"dma\.done\.wait [^;}]*?, (\d+)")
_MATMUL = re.compile(r"\bvmatmul\.")


@dataclass(frozen=True)
class Bundle:
    address: int
    marker: str  # "" or a control-target key: LB (loop body), PF, PB, LH, LE, CT
    depth: int  # loop nesting, the number of `>`
    text: str  # the instructions and comments


@dataclass(frozen=True)
class Utilization:
    units: tuple[str, ...]
    capacity: tuple[int, ...]  # slots per bundle of each unit
    rows: tuple[tuple[int, ...], ...]  # per bundle, the slots used of each unit


@dataclass(frozen=True)
class Loop:
    first: int  # index of the first bundle (the `LB` one)
    last: int  # index of the bundle that branches back
    depth: int
    inner: tuple[int, ...]  # indices (in the loop list) of the loops directly inside

    @property
    def bundles(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class LoopTiming:
    """One loop's static figures; `self_*` leave out the loops nested inside."""

    address: int
    depth: int
    bundles: int  # the whole body's longest path, nested loops counted once
    self_bundles: int  # the longest path outside nested loops: what one iteration issues at most
    code_bundles: int  # every bundle of the body outside nested loops (all branches)
    self_bytes: int  # bytes this body waits for, outside nested loops
    matmuls: int  # vmatmul instructions in the body outside nested loops
    binding_unit: str  # the unit busiest relative to its slots (outside nested loops)
    binding_use: float  # its fraction of slots used
    compute_s: float  # self_bundles (its longest path) at the assumed clock
    stream_s: float  # self_bytes at the stream bandwidth

    @property
    def ratio(self) -> float | None:
        """Compute over stream time (> 1: the loop is slower than its own stream)."""
        return self.compute_s / self.stream_s if self.stream_s else None


def parse_bundles(text: str) -> list[Bundle]:
    """Every bundle of a `*-final_bundles.txt`, in address order."""
    found = list(_BUNDLE.finditer(text))
    out = []
    for k, m in enumerate(found):
        end = found[k + 1].start() if k + 1 < len(found) else len(text)
        out.append(Bundle(int(m[1], 0), m[2] or "", len(m[3]), text[m.end() : end]))
    return out


def parse_utilization(text: str) -> Utilization:
    """The unit table of a `*-final_hlo-static-per-bundle-utilization.txt`."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    head = next(i for i, line in enumerate(lines) if line.startswith("== CAPAC"))
    units = tuple(u.strip() for u in lines[head + 1].split(","))
    capacity = tuple(int(x) for x in lines[head + 2].split())
    body = next(i for i, line in enumerate(lines) if line.startswith("== UTIL"))
    rows = tuple(tuple(int(x) for x in line.split()) for line in lines[body + 1 :] if line[0].isdigit())
    return Utilization(units, capacity, rows)


def find_loops(bundles: list[Bundle]) -> list[Loop]:
    """The loops, outermost first within each nest, each with the loops directly inside it."""
    starts: dict[str, int] = {}
    for i, b in enumerate(bundles):
        for region in _STARTS.findall(b.text):
            starts.setdefault(region, i)
    spans: dict[int, int] = {}
    for i, b in enumerate(bundles):
        for region in _TARGET.findall(b.text):
            s = starts.get(region)
            if s is not None and s <= i and bundles[s].marker == "LB":
                spans[s] = max(spans.get(s, s), i)
    ordered = sorted(spans.items(), key=lambda se: (se[0], -se[1]))
    parents: list[int | None] = []
    stack: list[int] = []  # the loops that contain the current one, innermost last
    for first, last in ordered:
        while stack and ordered[stack[-1]][1] < first:
            stack.pop()
        parents.append(stack[-1] if stack and last <= ordered[stack[-1]][1] else None)
        stack.append(len(parents) - 1)
    return [
        Loop(first, last, bundles[first].depth, tuple(k for k, p in enumerate(parents) if p == n))
        for n, (first, last) in enumerate(ordered)
    ]


def time_loops(
    bundles: list[Bundle],
    util: Utilization | None,
    clock_hz: float = ASSUMED_CLOCK_HZ,
    stream: float = STREAM_BYTES_PER_S,
) -> list[LoopTiming]:
    """Each loop's bundles per iteration, bytes waited for, binding unit and times."""
    loops = find_loops(bundles)
    texts = [b.text for b in bundles]
    starts = region_starts(texts)
    out = []
    for loop in loops:
        nested = {i for k in loop.inner for i in range(loops[k].first, loops[k].last + 1)}
        mine = [i for i in range(loop.first, loop.last + 1) if i not in nested]
        text = " ".join(bundles[i].text for i in mine)
        waited = sum(int(n) for n in _WAIT.findall(text)) * GRANULE_BYTES
        unit, use = _binding(util, mine)
        path = longest_path(texts, loop.first, loop.last, set(mine), starts)
        out.append(
            LoopTiming(
                address=bundles[loop.first].address,
                depth=loop.depth,
                bundles=longest_path(texts, loop.first, loop.last, set(range(loop.first, loop.last + 1)), starts),
                self_bundles=path,
                code_bundles=len(mine),
                self_bytes=waited,
                matmuls=len(_MATMUL.findall(text)),
                binding_unit=unit,
                binding_use=use,
                compute_s=path / clock_hz,
                stream_s=waited / stream,
            )
        )
    return out


def _binding(util: Utilization | None, indices: list[int]) -> tuple[str, float]:
    if util is None or not indices or max(indices) >= len(util.rows):
        return "?", 0.0
    best = ("none", 0.0)
    for u, (name, cap) in enumerate(zip(util.units, util.capacity, strict=True)):
        used = sum(util.rows[i][u] for i in indices) / (cap * len(indices))
        if used > best[1]:
            best = (name, used)
    return best


def render_static(name: str, dump, timings: list[LoopTiming], total_bundles: int, clock_hz: float) -> str:
    """The `mkdsl plan --static` table: every loop that waits for bytes or runs 50+ bundles."""
    shown = [t for t in timings if t.self_bytes or t.self_bundles >= 50]
    lines = [
        f"{name}: libtpu schedule for {dump.topology} (compile-only; no TPU), one core",
        f"  code: {total_bundles} bundles, {dump.code_bytes / 1e6:.2f} MB generated code",
        f"  times at an assumed {clock_hz / 1e9:.2f} GHz (one bundle per cycle at most: a floor) against a "
        f"{STREAM_BYTES_PER_S / 1e12:.2f} TB/s stream (measured ring of 2 MiB banks, one core)",
        "",
        "bundles/iter: the longest path through one iteration (nested loops once; self: without them);"
        " code: the body's bundles, every branch",
        "",
        "| loop at | depth | bundles/iter | self | code | bytes/iter | compute us | stream us | compute/stream | binds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in shown:
        ratio = f"{t.ratio:.2f}" + (" (compute-bound)" if t.ratio > 1 else "") if t.ratio is not None else "no stream"
        lines.append(
            f"| {t.address:#x} | {t.depth} | {t.bundles} | {t.self_bundles} | {t.code_bundles} | {t.self_bytes} | "
            f"{t.compute_s * 1e6:.3f} | {t.stream_s * 1e6:.3f} | {ratio} | {t.binding_unit} {t.binding_use:.0%} |"
        )
    hidden = len(timings) - len(shown)
    if hidden:
        lines.append(f"\n{hidden} more loops of under 50 bundles that wait for no bytes (scalar bookkeeping).")
    return "\n".join(lines)
