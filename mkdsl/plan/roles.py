"""How the kernel reaches each weight operand: the one table the planner and emitter share.

- "stream": cut into tiles that flow through the weight ring (matmul weights);
- "own": the op's lowering moves it itself (embedding rows, expert tiles, MLA absorption);
- "fetch": everything else (norm weights, conv taps, gate vectors) is DMA'd per layer into a
  small VMEM buffer when the layer starts and waited for at its first use.

Each op says which of its operands are streamed or its own (`OpDef.reach`).
"""

from __future__ import annotations

import dataclasses

from mkdsl.lang.ir import Graph, Model, Tensor, TensorType
from mkdsl.ops import OPS


def fetched_weights(model: Model, graph: Graph) -> list[str]:
    """Weights of `graph` that are fetched, in order of first use."""
    out: list[str] = []
    for node in graph.nodes:
        if node.op not in OPS:  # the layer stack
            continue
        op = OPS[node.op]
        for operand, ref in zip(op.operands[: len(node.inputs)], node.inputs, strict=True):
            if ref.kind == "tensor" and op.reached(operand) == "fetch" and model.tensor(ref.name).kind == "weight":
                if ref.name not in out:
                    out.append(ref.name)
    return out


def fetch_block(t: Tensor) -> int:
    """Rows fetched for a stack of vectors, 0 for a whole slice of a bigger tensor.

    HBM arrays are tiled (8 or 16 rows), and a DMA window must start on a tile: a small stack
    is fetched whole; a big one in tile-aligned blocks, its rows padded to a whole block by the
    step wrapper (a few MB per step at most)."""
    if len(t.type.shape) != 1:
        return 0
    rows = t.stack if t.stacked else 1
    tile = 16 if t.type.dtype.bits == 16 else 8
    return rows if rows <= tile else tile


def padded_rows(t: Tensor) -> int:
    """Rows of a stack of vectors as the kernel receives it (a whole number of fetch blocks)."""
    rows = t.stack if t.stacked else 1
    block = fetch_block(t)
    return -(-rows // block) * block if block else rows


def fetch_shape(t: Tensor) -> tuple[int, ...]:
    if len(t.type.shape) == 1:
        return (fetch_block(t), t.type.shape[0])
    return tuple(t.type.shape)


def stored(t: Tensor, pads: dict[str, dict[int, int]]) -> Tensor:
    """`t` as the kernel stores it: the axes its readers pad (`Plan.pads`) at their padded width."""
    shape = list(t.type.shape)
    for axis, width in pads.get(t.name, {}).items():
        shape[axis] = width
    return dataclasses.replace(t, type=TensorType(t.type.dtype, tuple(shape)))
