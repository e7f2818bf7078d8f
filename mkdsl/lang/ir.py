"""Graph IR: the checked, constant-folded model that every later stage reads.

Frozen dataclasses only; nothing here refers to spec text except through `Span`s, which say
where each value came from so that later stages can still point at the spec.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from mkdsl.lang.diagnostics import Span
from mkdsl.lang.dtypes import DType

Dim = int | str  # str: a size bound when the step is built (a `dim`, e.g. "B")


@dataclass(frozen=True)
class TensorType:
    dtype: DType
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class DimRange:
    name: str
    low: int
    high: int


@dataclass(frozen=True)
class LayerExpr:
    """An op attribute that depends on the layer index `l` (constants already folded in).

    `py` evaluates with plain Python ints (the reference); `kernel` is the same expression for
    traced int32 scalars inside the kernel's layer loop, where the index is named `li`.
    """

    py: str
    kernel: str
    first: int | float | bool  # its value at the first layer that uses it (for shape rules)

    def at(self, layer: int):
        return eval(self.py, {"__builtins__": {}}, {"l": layer})  # noqa: S307 (mkdsl wrote it)


@dataclass(frozen=True)
class Hint:
    """A schedule hint from the spec's `hints` section; the span lets the planner blame it."""

    name: str
    value: int
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Tensor:
    """A declared weight or state tensor.

    `type` is one layer's slice; stacked tensors have a leading axis of `stack` slices and
    `slots[l]` gives layer l's slice (-1 where the layer's kind has no such tensor).
    """

    name: str
    kind: str  # "weight" | "state"
    type: TensorType
    sharding: tuple[tuple[str, ...], ...]  # per dimension of `type`: the mesh axes it is split over (mesh order)
    stacked: bool
    stack: int
    slots: tuple[int, ...]
    span: Span = field(compare=False)

    @property
    def full_shape(self) -> tuple[Dim, ...]:
        return ((self.stack,) if self.stacked else ()) + self.type.shape


@dataclass(frozen=True)
class Ref:
    """An operand: a value computed in this graph, a declared tensor, or a step input."""

    kind: str  # "value" | "tensor" | "input"
    name: str


@dataclass(frozen=True)
class Value:
    name: str  # unique within its graph
    type: TensorType
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[Ref, ...]
    attrs: tuple[tuple[str, object], ...]
    outputs: tuple[Value, ...]
    writes: tuple[str, ...]  # state tensors this node updates in place
    span: Span = field(compare=False)
    block: str = ""  # the spec block it was inlined from ("" when written in the layer or step)

    @property
    def attr(self) -> dict[str, object]:
        return dict(self.attrs)

    def arg(self, name: str) -> Ref:
        """The operand the op names `name` (its `OpDef.operands`), so stages need not count positions."""
        from mkdsl.ops.registry import OPS  # the registry's modules import this one

        return self.inputs[OPS[self.op].operands.index(name)]

    def opt_arg(self, name: str) -> Ref | None:
        """An optional operand (`OpDef.optional`), or None where the call leaves it out."""
        from mkdsl.ops.registry import OPS

        i = OPS[self.op].operands.index(name)
        return self.inputs[i] if i < len(self.inputs) else None


@dataclass(frozen=True)
class Graph:
    name: str
    params: tuple[Value, ...]
    nodes: tuple[Node, ...]
    results: tuple[Ref, ...]
    span: Span = field(compare=False)


@dataclass(frozen=True)
class BlockAttr:
    """An op attribute that is a spec block of elementwise ops, elaborated on its own (e.g. the
    gated activation `act=` of `moe_experts`, applied by the op to each chosen expert's gate and up
    results). `graph` has the block's parameters as params and one result."""

    graph: Graph

    def __repr__(self) -> str:  # deterministic and short, for `--dump ir` and attribute tuples
        ops = "; ".join(f"{n.outputs[0].name} = {n.op}" for n in self.graph.nodes)
        return f"<block {self.graph.name}({', '.join(p.name for p in self.graph.params)}): {ops}>"


@dataclass(frozen=True)
class Model:
    name: str
    profile: str | None
    consts: tuple[tuple[str, int | float | bool], ...]
    dims: tuple[DimRange, ...]
    mesh: tuple[tuple[str, int], ...]
    tensors: tuple[Tensor, ...]
    kinds: tuple[Graph, ...]  # one graph per layer kind; params and results are the carries
    schedule: tuple[str, ...]  # layer kind of each layer index
    step: Graph  # inputs tokens/positions; calls the layer stack through a `layers` node
    inputs: tuple[Value, ...]
    hints: tuple[Hint, ...]
    warnings: tuple = field(default=(), compare=False)  # Diagnostics that do not stop compilation
    checkpoints: tuple = ()  # mkdsl.checkpoint.mapping.CheckpointMap records: where weights come from
    # A drafter's target context (`context NAME at POS from layers ...`): the state tensors the host
    # fills (the rows, their positions) and the target layers whose hidden states (residual stream
    # outputs) the rows hold, in order
    context: tuple[str, str, tuple[int, ...]] | None = None
    # A multi-token prediction head (`mtp(h: ..., tokens, positions) { ... }`), run by the host (the
    # kernel does not lower it): params (hidden), inputs (tokens, positions), results (hidden, logits)
    mtp: Graph | None = None
    mtp_inputs: tuple[Value, ...] = ()

    def tensor(self, name: str) -> Tensor:
        return self._tensors_by_name[name]

    @functools.cached_property
    def _tensors_by_name(self) -> dict[str, Tensor]:
        """The tensors by name (the planner and the reference look tensors up ~10^5 times a compile)."""
        return {t.name: t for t in self.tensors}

    def kind(self, name: str) -> Graph:
        return next(k for k in self.kinds if k.name == name)

    def hint(self, name: str) -> Hint | None:
        return next((h for h in self.hints if h.name == name), None)

    @property
    def const(self) -> dict[str, int | float | bool]:
        return dict(self.consts)

    @property
    def weights(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.kind == "weight")

    @property
    def states(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.kind == "state")

    def row_states(self) -> dict[str, int]:
        """State not indexed by a cache position (recurrent state), which a verify step keeps per
        row (mkdsl/run/rows.py) -> the axis of its batch dimension in the stored array."""
        batch, caches = self.dims[0].name, {d.name for d in self.dims[1:]}
        out = {}
        for t in self.states:
            shape = t.full_shape
            if batch in shape and not caches & set(shape):
                out[t.name] = shape.index(batch)
        return out
