"""The TPU lowering registry: one `Lowering` per op, looked up by op (as JAX registers a lowering
rule per primitive).

A lowering owns everything the TPU backend must know about its op: the checks that only the
kernel imposes (run by `mkdsl check`, `mkdsl plan` and `mkdsl compile` alike), the buffers,
scratch and semaphores it asks the planner for, the bytes and DMAs its schedule moves (one
function, summed into the plan's byte counts and read by the cost model), the record the emitter
prepares for its template macro, and the runtime part its kernel code needs. The planner and the
emitter hold no list of op names: they ask the lowering. An elementwise op needs no lowering of
its own: `ELEMENTWISE` lowers every op with a `kernel_expr`.

The lowerings live in `lowerings/`, one module per op family, mirroring `mkdsl/ops/`; their
macros in `templates/lowerings/`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Graph, LayerExpr, Model, Node
from mkdsl.ops import OPS


@dataclass(frozen=True)
class Site:
    """A node where it sits: its graph and its index there (scratch is keyed by both)."""

    graph: Graph
    index: int
    node: Node


@dataclass(frozen=True)
class Traffic:
    """What an op's schedule moves per step: bytes between HBM and VMEM, and DMA descriptors."""

    bytes: int = 0
    dmas: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes + other.bytes, self.dmas + other.dmas)


Part = tuple[tuple, str, str, str]  # (shape, dtype, purpose, memory) of one scratch buffer


class PlanContext(Protocol):
    """What a lowering may ask of the planner (mkdsl.plan.planner._State)."""

    model: Model
    batch: int
    rows: int
    context: int
    kv_tile: int

    def alloc(self, name: str, shape: tuple, dtype: str, purpose: str, span, memory: str = "VMEM") -> None: ...
    def buffer(self, graph: Graph, ref) -> str: ...
    def type_of(self, graph: Graph, ref): ...
    def cost(self, at: Site): ...
    def stream_of(self, at: Site): ...


class EmitContext(Protocol):
    """What a lowering may ask of the emitter (mkdsl.backends.tpu.emit._Emitter)."""

    m: Model
    plan: Any
    seq: str
    layer_var: str
    objects: list[str]
    drained: list[dict]
    shared: dict[str, Any]

    def output(self, at: Site) -> str | None: ...
    def fetched(self, name: str, pre: list[str]) -> str: ...
    def slot_expr(self, tensor: str, layer: str) -> str: ...
    def value_width(self, g: Graph, ref) -> int: ...
    def attr_codes(self, node: Node) -> dict[str, str]: ...
    def scratch_of(self, at: Site): ...
    def mask(self, axes) -> int: ...
    def group_index(self, axes) -> str: ...
    def setup_once(self, fn: Callable[[EmitContext], list[str]]) -> None: ...


def _no_check(model: Model, at: Site) -> list[Diagnostic]:
    return []


def _no_traffic(s: PlanContext, at: Site) -> Traffic:
    return Traffic()


@dataclass(frozen=True)
class Lowering:
    """How one op becomes kernel code. The callables receive the planner (`s`, a `PlanContext`)
    or the emitter (`em`, an `EmitContext`), and the node's `Site`."""

    op: str
    template: str  # under templates/, holding the macro
    macro: str  # renders the record: `{{ macro(n) }}`
    record: Callable[[EmitContext, Site, list[str], list[str]], dict]  # (em, at, operand buffers, pre-lines)
    check: Callable[[Model, Site], list[Diagnostic]] = _no_check  # what the kernel cannot lower
    allocate: Callable[[PlanContext, Site], None] | None = None  # named buffers (s.alloc), not numbered scratch
    scratch: Callable[[PlanContext, Site], dict[str, Part]] | None = None  # numbered scratch parts
    scratch_base: str = ""  # scratch names are `<base><i>_<part>`
    synchronous: bool = False  # all DMAs done on return: every instance may share one scratch set
    after_all: Callable[[PlanContext, int], None] | None = None  # once, with the count of this base's instances
    traffic: Callable[[PlanContext, Site], Traffic] = _no_traffic  # per layer (or step) the node runs in
    runtime: tuple[str, ...] = ()  # runtime parts it needs, as templates ("runtime/<part>.py.jinja")
    runtime_of: Callable[[Model, Site], tuple[str, ...]] | None = None  # more parts, by node (e.g. decoders)
    layer_attrs: bool = False  # takes layer-dependent attributes as traced scalars
    # tensors it needs stored wider than their per-device shape (zero-padded): name -> {axis of one
    # layer's shape (negative): padded width}; the planner collects them into `Plan.pads`
    pads: Callable[[Model, Site], dict[str, dict[int, int]]] | None = None


LOWERINGS: dict[str, Lowering] = {}


def register_lowering(lw: Lowering) -> Lowering:
    assert lw.op in OPS and lw.op not in LOWERINGS, lw.op
    LOWERINGS[lw.op] = lw
    return lw


def lowering_for(op: str) -> Lowering | None:
    """The op's lowering; every op with a `kernel_expr` shares the elementwise one."""
    if op in LOWERINGS:
        return LOWERINGS[op]
    return ELEMENTWISE if op in OPS and OPS[op].kernel_expr is not None else None


def sites(model: Model) -> list[Site]:
    """Every op node of every graph (layer kinds, then the step), without the layer stack."""
    return [Site(g, i, n) for g in (*model.kinds, model.step) for i, n in enumerate(g.nodes) if n.op in OPS]


def check_lowerable(model: Model) -> list[Diagnostic]:
    """Every diagnostic of the TPU lowerings for a (per-device) model, in one list."""
    out: list[Diagnostic] = []
    for at in sites(model):
        node, lw = at.node, lowering_for(at.node.op)
        if lw is None:
            out.append(Diagnostic(node.span, f"op `{node.op}` has no TPU lowering yet"))
            continue
        dynamic = [k for k, v in node.attrs if isinstance(v, LayerExpr)]
        if dynamic and not lw.layer_attrs:
            out.append(
                Diagnostic(
                    node.span,
                    f"`{node.op}` needs `{dynamic[0]}` to be the same at every layer of a kind",
                    "split the layer kind, or use a constant",
                )
            )
        out.extend(lw.check(model, at))
    return out + unread_states(model)


def unread_states(model: Model) -> list[Diagnostic]:
    """Every read of a state tensor the kernel cannot make (`_state_reads`)."""
    return [d for at in sites(model) for d in _state_reads(model, at)]


def _state_reads(model: Model, at: Site) -> list[Diagnostic]:
    """A state tensor the op reads without owning it (not one of its in-place operands): the kernel
    holds state in HBM, and only the ops that own a state move it (in place, or read by their own
    lowering: `OpDef.reach` "own", e.g. `block_attention`'s context positions)."""
    op = OPS[at.node.op]
    out = []
    for name, ref in zip(op.operands, at.node.inputs):
        if (
            ref.kind == "tensor"
            and model.tensor(ref.name).kind == "state"
            and name not in op.inout
            and op.reached(name) != "own"
        ):
            out.append(
                Diagnostic(
                    at.node.span,
                    f"`{at.node.op}` reads the state `{ref.name}` as its `{name}`: the kernel cannot read a state "
                    "tensor as a value yet (the reference can)",
                    "the reference path runs it (`mkdsl.reference_step`; drafters: mkdsl/run/drafters.py)",
                )
            )
    return out


def _elementwise_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    op, node = OPS[at.node.op], at.node
    values = {}
    for name, b, ref in zip(op.operands[: len(node.inputs)], ins, node.inputs, strict=True):
        is_weight = ref.kind == "tensor" and em.m.tensor(ref.name).kind == "weight"
        values[name] = em.fetched(ref.name, pre) if is_weight else f"r.{b}[...]"
    expr = op.kernel_expr.format(**values, **em.attr_codes(node))
    out = em.output(at)
    if out in ("logits", "next_tokens"):  # the step's outputs hold batch rows, not padded rows
        expr = f"({expr})[0:batch]"
    return {"op": "elementwise", "expr": expr}


# A jnp expression evaluates a layer-dependent attribute as the traced scalar it is.
ELEMENTWISE = Lowering(
    "elementwise", "lowerings/elementwise.jinja", "elementwise", _elementwise_record, layer_attrs=True
)

from mkdsl.backends.tpu import lowerings  # noqa: E402, F401  (registers every lowering)
