"""The collectives of a sharded step: which exchanges run, over which peers, and their cost.

A device's linear index is row-major over the mesh axes, all powers of two, so each axis owns
a group of index bits; a collective over some axes runs one exchange phase per bit, with the
peer `index ^ (1 << bit)` (recursive doubling). Phases run lowest bit first: with the two cores
of a TPU7x chip at adjacent indices (2c, 2c+1) the cheap sibling-core exchange goes first and
the cross-chip ones after (the two-level order). Every figure here is *modeled*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mkdsl.ir import Graph, Model
from mkdsl.ops import OPS

# Per exchange phase at decode sizes (public measurements: a small all-reduce phase costs
# 3.5-4.7 us; sibling-core copies ~101 GB/s at 256 KiB, cross-chip ~45 GB/s per core per direction).
SIBLING_PHASE_US = 3.5
CHIP_PHASE_US = 4.7
SIBLING_BYTES_PER_S = 101e9
CHIP_BYTES_PER_S = 45e9
PAIR_LANES = 128  # an argmax exchange carries [value x 128 | index x 128] f32 per row


@dataclass(frozen=True)
class Collective:
    """One collective of one graph (a layer kind or the step): its phases and bytes per phase."""

    graph: str
    op: str  # the op that exchanges (an internal collective, or a split argmax)
    value: str  # the IR value it produces
    axes: tuple[str, ...]
    bits: tuple[int, ...]  # exchange phases, in order
    phase_bytes: tuple[int, ...]  # bytes one device sends in each phase
    line: int
    width: int  # columns of the value each device contributes
    two_level: bool = False  # an all-reduce run as sibling reduce-scatter, cross-chip phases, sibling gather
    exchange: str = ""  # the op's `exchange` trait: "sum", "gather" or "best"

    def time_us(self) -> float:
        return sum(phase_us(bit, b) for bit, b in zip(self.bits, self.phase_bytes, strict=True))


def phase_us(bit: int, nbytes: int) -> float:
    """Modeled time of one exchange phase over index bit `bit` (bit 0: the chip's other core)."""
    if bit == 0:
        return SIBLING_PHASE_US + nbytes / SIBLING_BYTES_PER_S * 1e6
    return CHIP_PHASE_US + nbytes / CHIP_BYTES_PER_S * 1e6


def axis_bits(mesh: tuple[tuple[str, int], ...]) -> dict[str, tuple[int, ...]]:
    """Mesh axis -> the bits of the row-major linear device index it owns."""
    out, shift = {}, 0
    for name, size in reversed(mesh):
        width = size.bit_length() - 1
        out[name] = tuple(range(shift, shift + width))
        shift += width
    return out


def index_bits(mesh) -> int:
    return sum(size.bit_length() - 1 for _, size in mesh)


def mask_of(mesh, axes) -> int:
    bits = axis_bits(mesh)
    return sum(1 << b for a in axes for b in bits[a])


def exchange_rows(model: Model) -> int | None:
    """Rows an all-reduce exchanges: the largest batch rounded up to 8 (whole f32 sublane tiles)
    when that is fewer than the padded rows; None: all padded rows."""
    high = model.dims[0].high
    rows = -(-high // 8) * 8
    return rows if rows < -(-high // 16) * 16 else None


def wire_bytes(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def graph_collectives(model: Model, g: Graph, rows: int, wire: str) -> list[Collective]:
    from mkdsl.elaborate import graph_value_type

    bits_of = axis_bits(model.mesh)
    out = []
    for node in g.nodes:
        kind = OPS[node.op].exchange if node.op in OPS else ""
        axes = node.attr.get(OPS[node.op].exchange_axes) if kind else None
        if not axes:
            continue
        bits = tuple(sorted(b for a in axes for b in bits_of[a]))
        n = graph_value_type(g, node.inputs[0]).shape[-1]
        if kind == "sum":
            r = min(rows, exchange_rows(model) or rows)
            flat = [r * n * wire_bytes(wire)] * len(bits)
            two = two_level_phases(bits, r, n, wire)
            if two and _cost(*two) < _cost(bits, flat):
                out.append(
                    Collective(g.name, node.op, node.outputs[0].name, tuple(axes), *two, node.span.line, n, True, kind)
                )
                continue
            sizes = flat
        elif kind == "gather":
            sizes = [rows * n * 4 << i for i in range(len(bits))]
        else:
            sizes = [rows * 2 * PAIR_LANES * 4] * len(bits)
        out.append(
            Collective(
                g.name, node.op, node.outputs[0].name, tuple(axes), bits, tuple(sizes), node.span.line, n, exchange=kind
            )
        )
    return out


def two_level_phases(bits, rows: int, n: int, wire: str):
    """(bits, bytes) of the two-level all-reduce, or None where it does not apply: the mask must
    hold bit 0 (the chip's two cores) and others, and half the columns be lane aligned."""
    if 0 not in bits or len(bits) < 2 or n % 256:
        return None
    h = n // 2
    cross = tuple(b for b in bits if b)
    return (0, *cross, 0), (rows * h * wire_bytes(wire), *[rows * h * wire_bytes(wire)] * len(cross), rows * h * 4)


def _cost(bits, sizes) -> float:
    return sum(phase_us(b, n) for b, n in zip(bits, sizes, strict=True))


def step_totals(model: Model, found: list[Collective]) -> tuple[int, float]:
    """(exchange phases per step, modeled us per step): each layer runs its kind's collectives."""
    runs = [*model.schedule, model.step.name]
    return (
        sum(len(c.bits) * runs.count(c.graph) for c in found),
        sum(c.time_us() * runs.count(c.graph) for c in found),
    )


def comm_widths(found: list[Collective], wire: str) -> tuple[int, int]:
    """(widest f32 message, widest bf16 message) in columns, for the receive slots: all-gathers
    send up to half the gathered value, two-level all-reduces their finished half in f32."""
    f32, bf16 = 2 * PAIR_LANES, 0  # the argmax message
    for c in found:
        if c.exchange == "gather":
            f32 = max(f32, c.width * 2 ** len(c.bits) // 2)
        elif c.exchange == "sum":
            if c.two_level:
                f32 = max(f32, c.width // 2)
            if wire == "bf16":
                bf16 = max(bf16, c.width)
            else:
                f32 = max(f32, c.width)
    return lanes(f32), lanes(bf16)


def lanes(n: int) -> int:
    """n rounded up to whole 128-lane vregs."""
    return math.ceil(n / 128) * 128
