"""Check a parsed spec and elaborate it into the graph IR.

Runs as a sequence of small named steps over one `Reporter`, so every independent error in
the spec is reported in one run. Blocks are inlined; each layer kind becomes one graph whose
parameters and results are the values carried from layer to layer.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import partial

from mkdsl.checkpoint.mapping import check_checkpoints
from mkdsl.lang import dtypes
from mkdsl.lang.block_attrs import resolve_block_attrs
from mkdsl.lang.consts import MATH, ConstEnv, walk
from mkdsl.lang.context import check_context
from mkdsl.lang.diagnostics import NOWHERE, Diagnostic, Reporter, Span, SpecError, did_you_mean
from mkdsl.lang.ir import DimRange, Graph, Hint, LayerExpr, Model, Node, Ref, Tensor, TensorType, Value
from mkdsl.lang.syntax import (
    AssignStmt,
    BinOp,
    Call,
    CheckpointDecl,
    ConstDecl,
    ContextDecl,
    DimDecl,
    Expr,
    FuncDef,
    HintsDecl,
    Kwarg,
    LayersDecl,
    MeshDecl,
    ModelDecl,
    Module,
    MtpDef,
    Name,
    Num,
    ProfileDecl,
    ReturnStmt,
    TensorDecl,
    TypeExpr,
    UnOp,
    parse,
)
from mkdsl.ops import OPS, REQUIRED, Operand, OpError
from mkdsl.ops.state import READ_STATE

# Schedule hints the planner understands (checked here, used by the planner).
HINTS = {
    "ring_depth": "weight-stream ring depth (VMEM banks)",
    "tile_n": "weight tile width in columns (a multiple of 128)",
    "kv_tile": "KV cache tile in tokens",
    "expert_slots": "expert weight slots in flight",
    "vmem_cap_mib": "VMEM budget cap in MiB",
    "wire_bf16": "1: all-reduces send bf16 partial sums between devices (half the bytes); 0: f32",
}
HINT_MINIMUM = {"wire_bf16": 0}  # a 0/1 switch; the others are sizes and counts
_OPERATORS = {"+": "add", "-": "sub", "*": "mul", "/": "div"}  # tensor (op) tensor
# tensor (op) scalar and scalar (op) tensor: the op that takes the scalar as its attribute `s`
_SCALAR_RIGHT = {"+": "add_scalar", "-": "sub_scalar", "*": "mul_scalar", "/": "div_scalar", "**": "pow_scalar"}
_SCALAR_LEFT = {"+": "add_scalar", "-": "rsub_scalar", "*": "mul_scalar", "/": "rdiv_scalar"}
_SCALAR_CALLS = {"minimum": "minimum_scalar", "maximum": "maximum_scalar"}  # op(x, scalar) or op(scalar, x)
NOT_ON_TENSORS = "tensors support `+ - * /` (with tensors or constants), `**` with a constant exponent, and prefix `-`"


@dataclass(frozen=True)
class Const:
    """A block's constant parameter in a body's environment (tensor names map to `Ref`s)."""

    value: int | float | bool


MAX_NESTING = 100  # tensor expressions and block calls nested deeper are reported, not recursed into
F32_MAX, F32_TINY = 3.4028234663852886e38, 1.401298464324817e-45  # largest and smallest float32
# Bounds on what a kernel can use (beyond them a spec is a mistake, and slow to check):
MAX_LAYERS = (4096, "every layer index is checked and scheduled one by one")
MAX_SIZE = (2**31 - 1, "kernels index dimensions with 32-bit integers")
MAX_DEVICES = (2**16, "collectives run one exchange phase per bit of the device index")


@dataclass
class _Decls:
    model: ModelDecl | None = None
    consts: dict[str, ConstDecl] = field(default_factory=dict)
    dims: dict[str, DimDecl] = field(default_factory=dict)
    meshes: list[MeshDecl] = field(default_factory=list)
    profiles: dict[str, ProfileDecl] = field(default_factory=dict)
    hints: list[HintsDecl] = field(default_factory=list)
    tensors: dict[str, TensorDecl] = field(default_factory=dict)
    blocks: dict[str, FuncDef] = field(default_factory=dict)
    layer_defs: dict[str, FuncDef] = field(default_factory=dict)
    layers: list[LayersDecl] = field(default_factory=list)
    steps: list[FuncDef] = field(default_factory=list)
    redefined: set[str] = field(default_factory=set)  # names defined twice: reported once, not as unknown
    checkpoints: list[CheckpointDecl] = field(default_factory=list)
    contexts: list[ContextDecl] = field(default_factory=list)
    mtps: list[MtpDef] = field(default_factory=list)


def load(path: str, profile: str | None = None) -> Model:
    """Read, parse and elaborate a spec file."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    return elaborate(parse(source), profile, source)


def elaborate(module: Module, profile: str | None, source: str = "") -> Model:
    return _Elaborator(module, profile, source).run()


class _Elaborator:
    def __init__(self, module: Module, profile: str | None, source: str):
        self.rep = Reporter()
        self.module, self.profile, self.source = module, profile, source
        self.d = _Decls()

    def run(self) -> Model:
        self.collect()
        self.consts = ConstEnv(self.d.consts, self.profile_overrides(), self.rep, self.d.dims)
        const_values = self.fold_constants()
        dims = self.check_dims()
        mesh = self.check_mesh()
        hints = self.check_hints()
        schedule = self.check_layer_schedule()
        tensors = self.check_tensors(mesh, schedule)
        step, kinds, inputs, used = self.elaborate_functions(tensors, schedule, dims)
        mtp, mtp_inputs = self.elaborate_mtp(tensors, schedule, dims, used)
        checkpoints = check_checkpoints(self.d.checkpoints, tensors, self.consts, self.rep, self.d.tensors)
        context = check_context(self.d.contexts, tensors, self.consts, self.rep)
        self.rep.check()
        return Model(
            name=self.d.model.name,
            profile=self.profile,
            consts=tuple(const_values.items()),
            dims=tuple(dims.values()),
            mesh=tuple(mesh.items()),
            tensors=tuple(tensors.values()),
            kinds=kinds,
            schedule=schedule,
            step=step,
            inputs=inputs,
            hints=tuple(hints.values()),
            warnings=self.unused_weights(used),
            checkpoints=checkpoints,
            context=context,
            mtp=mtp,
            mtp_inputs=mtp_inputs,
        )

    def unused_weights(self, used: set[str]) -> tuple[Diagnostic, ...]:
        """A warning at each weight that no elaborated body reads (a typo'd name, a forgotten bias)."""
        return tuple(
            Diagnostic(
                t.span,
                f"weight `{t.name}` is declared but never used",
                "use it, or delete its declaration (it would be loaded and allocated for nothing)",
                severity="warning",
            )
            for t in self.d.tensors.values()
            if t.kind == "weight" and t.name not in used
        )

    # ------------------------------------------------------------------ declarations

    def collect(self) -> None:
        """Sort items by kind; every top-level name is defined once."""
        seen: dict[str, Span] = {}

        def define(name: str, span: Span, table: dict, item) -> None:
            if name in seen:
                self.rep.error(span, f"`{name}` is already defined at line {seen[name].line}")
                self.d.redefined.add(name)
                return
            seen[name] = span
            table[name] = item

        for it in self.module.items:
            if isinstance(it, FuncDef):
                for p in dict.fromkeys(p for p in it.params if it.params.count(p) > 1):
                    self.rep.error(it.span, f"`{it.name}` has two parameters named `{p}`")
            if isinstance(it, ModelDecl):
                if self.d.model:
                    self.rep.error(it.span, f"second `model` declaration (first at line {self.d.model.span.line})")
                self.d.model = self.d.model or it
            elif isinstance(it, ConstDecl):
                define(it.name, it.span, self.d.consts, it)
            elif isinstance(it, DimDecl):
                define(it.name, it.span, self.d.dims, it)
            elif isinstance(it, MeshDecl):
                self.d.meshes.append(it)
            elif isinstance(it, ProfileDecl):
                if it.name in self.d.profiles:
                    self.rep.error(
                        it.span, f"profile `{it.name}` is already defined at line {self.d.profiles[it.name].span.line}"
                    )
                self.d.profiles.setdefault(it.name, it)
            elif isinstance(it, HintsDecl):
                self.d.hints.append(it)
            elif isinstance(it, TensorDecl):
                define(it.name, it.span, self.d.tensors, it)
            elif isinstance(it, FuncDef) and it.kind == "block":
                define(it.name, it.span, self.d.blocks, it)
            elif isinstance(it, FuncDef) and it.kind == "layer":
                define(it.name, it.span, self.d.layer_defs, it)
            elif isinstance(it, LayersDecl):
                self.d.layers.append(it)
            elif isinstance(it, CheckpointDecl):
                self.d.checkpoints.append(it)
            elif isinstance(it, ContextDecl):
                self.d.contexts.append(it)
            elif isinstance(it, MtpDef):
                self.d.mtps.append(it)
            elif isinstance(it, FuncDef):
                self.d.steps.append(it)
        if self.d.model is None:
            self.rep.error(NOWHERE, "the spec has no `model NAME` declaration")
        for extra, what in (
            (self.d.meshes, "mesh"),
            (self.d.hints, "hints"),
            (self.d.layers, "layers"),
            (self.d.steps, "step"),
        ):
            for dup in extra[1:]:
                self.rep.error(dup.span, f"second `{what}` section (first at line {extra[0].span.line})")
        if not self.d.steps:
            self.rep.error(NOWHERE, "the spec has no `step(tokens, positions) { ... }`")
        if self.d.model is None or not self.d.steps:
            self.rep.check()  # nothing below makes sense without one model and one step

    def profile_overrides(self) -> dict[str, Expr]:
        for p in self.d.profiles.values():
            for i, a in enumerate(p.overrides):
                if any(b.name == a.name for b in p.overrides[:i]):
                    self.rep.error(a.span, f"profile `{p.name}` overrides `{a.name}` twice")
                elif a.name not in self.d.consts:
                    self.rep.error(
                        a.span,
                        f"profile `{p.name}` overrides `{a.name}`, which is not a constant",
                        partial(did_you_mean, a.name, self.d.consts),
                    )
        if self.profile is None:
            return {}
        if self.profile not in self.d.profiles:
            known = ", ".join(sorted(self.d.profiles)) or "none"
            self.rep.error(
                self.d.model.span,
                f"no profile named `{self.profile}` (profiles in this spec: {known})",
                did_you_mean(self.profile, self.d.profiles),
            )
            self.rep.check()
        return {a.name: a.value for a in self.d.profiles[self.profile].overrides}

    def fold_constants(self) -> dict[str, object]:
        return {name: self.consts.get(name) for name in self.d.consts}

    def check_dims(self) -> dict[str, DimRange]:
        out = {}
        for d in self.d.dims.values():
            lo = self.consts.eval_int(d.low, f"the lower bound of `{d.name}`", maximum=MAX_SIZE)
            hi = self.consts.eval_int(d.high, f"the upper bound of `{d.name}`", maximum=MAX_SIZE)
            if lo is not None and hi is not None:
                if lo > hi:
                    self.rep.error(d.span, f"empty range for `{d.name}`: {lo} .. {hi}")
                out[d.name] = DimRange(d.name, lo, hi)
        if not self.d.dims:
            self.rep.error(
                NOWHERE, "the spec declares no `dim`: the first one is the row count", "add `dim B in 1 .. 8`"
            )
        return out

    def check_mesh(self) -> dict[str, int]:
        mesh: dict[str, int] = {}
        for m in self.d.meshes[:1]:
            for a in m.axes:
                if a.name in mesh:
                    self.rep.error(a.span, f"mesh axis `{a.name}` is declared twice")
                size = self.consts.eval_int(a.value, f"mesh axis `{a.name}`", maximum=MAX_DEVICES)
                if size is not None and (size < 1 or size & (size - 1)):
                    self.rep.error(
                        a.value.span,
                        f"mesh axis `{a.name}` has size {size}; it must be a power of two",
                        "in-kernel collectives pair devices by XOR of their mesh coordinates",
                    )
                    size = None
                mesh.setdefault(a.name, size or 1)
            if math.prod(mesh.values()) > MAX_DEVICES[0]:
                self.rep.error(
                    m.span,
                    f"the mesh has {math.prod(mesh.values())} devices, more than {MAX_DEVICES[0]}",
                    MAX_DEVICES[1],
                )
                mesh = dict.fromkeys(mesh, 1)
        return mesh

    def check_dim_axes(self, name: str, i: int, d, size, mesh: dict[str, int]) -> tuple[str, ...]:
        """The mesh axes dimension i of `name` is split over, checked: declared, not repeated, dividing."""
        axes: list[str] = []
        for axis, span in zip(d.axes, d.axis_spans, strict=True):
            if axis not in mesh:
                self.rep.error(
                    span,
                    f"`{axis}` is not a mesh axis",
                    did_you_mean(axis, mesh)
                    or ("declare it: `mesh { " + axis + " = N }`" if not mesh else f"mesh axes: {', '.join(mesh)}"),
                )
            elif axis in axes:
                self.rep.error(span, f"dimension {i + 1} of `{name}` is split over mesh axis `{axis}` twice")
            else:
                axes.append(axis)
        if len(axes) != len(d.axes) or not axes:
            return tuple(axes)
        order = sorted(axes, key=list(mesh).index)
        if axes != order:  # blocks are numbered row-major in mesh order, by the kernel and by shard_map alike
            self.rep.error(
                d.axis_spans[0],
                f"dimension {i + 1} of `{name}` lists mesh axes out of mesh order",
                f"write @({', '.join(order)}): blocks are numbered row-major in the order of `mesh`",
            )
            return tuple(order)
        if isinstance(size, str):
            self.rep.error(
                d.span,
                f"dimension {i + 1} of `{name}` is `{size}`, a size given when the step is built; it cannot be split",
            )
            return ()
        ways = math.prod(mesh[a] for a in axes)
        if isinstance(size, int) and size % ways:
            over = (
                f"mesh axis `{axes[0]}` (size {ways}) does not divide"
                if len(axes) == 1
                else f"mesh axes {' x '.join(f'`{a}`' for a in axes)} ({' x '.join(str(mesh[a]) for a in axes)} = {ways}) "
                "do not divide"
            )
            self.rep.error(d.span, f"dimension {i + 1} of `{name}` has size {size}, which {over}")
        return tuple(a for a in axes if mesh[a] > 1)  # a split over a size-1 axis keeps the whole dimension

    def check_hints(self) -> dict[str, Hint]:
        hints = {}
        for h in self.d.hints[:1]:
            for i, a in enumerate(h.hints):
                if any(b.name == a.name for b in h.hints[:i]):
                    self.rep.error(a.span, f"hint `{a.name}` is given twice")
                    continue
                if a.name not in HINTS:
                    self.rep.error(
                        a.span,
                        f"unknown schedule hint `{a.name}`",
                        did_you_mean(a.name, HINTS) or f"known hints: {', '.join(HINTS)}",
                    )
                    continue
                v = self.consts.eval_int(a.value, f"hint `{a.name}`", minimum=HINT_MINIMUM.get(a.name, 1))
                if v is not None:
                    hints[a.name] = Hint(a.name, v, a.span)
        return hints

    def check_layer_schedule(self) -> tuple[str, ...]:
        """Layer kind of every layer index: the first rule whose predicate holds."""
        if not self.d.layers:
            if self.d.layer_defs:
                first = next(iter(self.d.layer_defs.values()))
                self.rep.error(first.span, "layer kinds are defined but there is no `layers N { ... }` schedule")
            return ()
        decl = self.d.layers[0]
        count = self.consts.eval_int(decl.count, "the layer count", maximum=MAX_LAYERS)
        for r in decl.rules:
            if r.kind not in self.d.layer_defs and r.kind not in self.d.redefined:
                self.rep.error(
                    r.span, f"unknown layer kind `{r.kind}`", partial(did_you_mean, r.kind, self.d.layer_defs)
                )
        for r in decl.rules[:-1]:
            if r.when is None:
                self.rep.error(r.span, "`otherwise` must be the last rule: the rules after it are never used")
        for name, f in self.d.layer_defs.items():
            if all(r.kind != name for r in decl.rules):
                self.rep.error(
                    f.span, f"layer kind `{name}` is never scheduled", f"add a rule `{name}: ...` to `layers`"
                )
        if count is None:
            return ()
        schedule, uncovered, broken = [], [], set()
        for layer in range(count):
            kind = None
            for i, r in enumerate(decl.rules):
                if i in broken:  # its error was reported for an earlier layer
                    continue
                hit = True if r.when is None else self.consts.eval(r.when, {"l": layer})
                if hit is not None and not isinstance(hit, bool):
                    self.rep.error(
                        r.when.span,
                        f"a layer rule must be true or false, got {hit!r}",
                        "compare the layer index, e.g. `l % 4 == 3`",
                    )
                    hit = None
                if hit is None:
                    broken.add(i)
                elif hit:
                    kind = r.kind
                    break
            if kind is None:
                uncovered.append(layer)
            schedule.append(kind or "")
        if uncovered and not broken:
            shown = ", ".join(map(str, uncovered[:8])) + (", ..." if len(uncovered) > 8 else "")
            self.rep.error(
                decl.span,
                f"{len(uncovered)} of {count} layers match no rule (layers {shown})",
                "add a last rule `KIND: otherwise`",
            )
        return tuple(schedule)

    def check_type(self, t: TypeExpr, name: str, allow_dims: bool) -> tuple[dtypes.DType | None, tuple]:
        dt = None
        args = {a.name: a for a in t.dtype_args}
        seen: set[str] = set()
        for a in t.dtype_args:  # as with op attributes: a parameter given twice is an error, not the last wins
            if a.name in seen:
                self.rep.error(a.span, f"parameter `{a.name}` of {t.dtype} is given twice")
            seen.add(a.name)
        if t.dtype in dtypes.SCALED and (t.dtype_args or t.dtype in ("int4", "int8")):
            dt = self.scaled_dtype(t, args)
        elif t.dtype in dtypes.PLAIN or t.dtype in dtypes.FIXED_GROUP or t.dtype in dtypes.GGUF:
            dt = (
                dtypes.GGUF[t.dtype].dtype
                if t.dtype in dtypes.GGUF
                else dtypes.PLAIN.get(t.dtype) or dtypes.FIXED_GROUP[t.dtype]
            )
            for a in t.dtype_args:
                self.rep.error(a.span, f"dtype {t.dtype} takes no parameters")
        else:
            self.rep.error(t.span, f"unknown dtype `{t.dtype}`", did_you_mean(t.dtype, dtypes.ALL_NAMES))
        shape = []
        for i, d in enumerate(t.dims):
            if isinstance(d.size, Name) and d.size.id in self.d.dims:
                if not allow_dims:
                    self.rep.error(
                        d.size.span,
                        f"weight `{name}` cannot depend on `{d.size.id}`, which is only known when the step is built",
                    )
                shape.append(d.size.id if allow_dims else None)
                continue
            shape.append(self.consts.eval_int(d.size, f"dimension {i + 1} of `{name}`", maximum=MAX_SIZE))
        return dt, tuple(shape)

    def scaled_dtype(self, t: TypeExpr, args: dict) -> dtypes.DType | None:
        """`int4(group=G)`, `int4(group=G, scale=f32)`, `int8(group=G)`, `fp8_e4m3(group=G)` or
        `fp8_e4m3(block=B)`."""
        allowed = ("group", "block") if t.dtype.startswith("fp8") else ("group",)
        scale = self.int4_scale(t, args) if t.dtype == "int4" else None
        for a in t.dtype_args:
            if a.name == "scale" and t.dtype == "int4":
                continue
            if a.name not in allowed:
                self.rep.error(
                    a.span, f"{t.dtype} has no parameter `{a.name}`", f"its parameters: {', '.join(allowed)}"
                )
        given = [a for a in allowed if a in args]
        if len(given) != 1:
            if len(allowed) == 1:
                self.rep.error(t.span, f"{t.dtype} needs a group size", f"write `{t.dtype}(group=128)[...]`")
            else:
                self.rep.error(
                    t.span,
                    f"{t.dtype} takes `group` or `block`",
                    f"write `{t.dtype}(group=K)` or `{t.dtype}(block=128)`",
                )
            return None
        size = self.consts.eval_int(args[given[0]].value, f"the {t.dtype} {given[0]} size")
        if not size or size <= 0:
            return None
        if t.dtype == "int4":
            return dtypes.int4(size, scale) if scale else None
        if t.dtype == "int8":
            return dtypes.int8(size)
        return dtypes.fp8(t.dtype, **{given[0]: size})

    def int4_scale(self, t: TypeExpr, args: dict) -> str | None:
        """The numpy name of an int4's scales: `scale=bf16` (the default) or `scale=f32`."""
        if "scale" not in args:
            return "bfloat16"
        v = args["scale"].value
        if isinstance(v, Name) and v.id in dtypes.INT4_SCALES:
            return dtypes.INT4_SCALES[v.id]
        self.rep.error(args["scale"].span, "int4 scales are bf16 or f32", "write `scale=bf16` or `scale=f32`")
        return None

    def check_tensors(self, mesh: dict[str, int], schedule: tuple[str, ...]) -> dict[str, Tensor]:
        out = {}
        for t in self.d.tensors.values():
            dt, shape = self.check_type(t.type, t.name, allow_dims=t.kind == "state")
            sharding = []
            for i, (d, size) in enumerate(zip(t.type.dims, shape, strict=True)):
                sharding.append(self.check_dim_axes(t.name, i, d, size, mesh))
            if dt is not None and dt.quantised and None not in shape:
                if len(shape) < 2:
                    self.rep.error(t.type.span, f"a {dt} tensor needs at least 2 dimensions [.., in, out]")
                elif isinstance(shape[-2], int) and shape[-2] % dt.k_multiple():
                    why = dtypes.GGUF[dt.name].why if dt.gguf else ""
                    self.rep.error(
                        t.type.dims[-2].span,
                        f"the input dimension of {dt} weight `{t.name}` "
                        f"({shape[-2]}) must be a multiple of {dt.k_multiple()}" + (f" ({why})" if why else ""),
                    )
                if t.kind == "state":
                    self.rep.error(t.type.span, f"state `{t.name}` cannot be quantised ({dt})")
            kinds = t.layer_kinds
            for k in kinds:
                if k not in self.d.layer_defs and k not in self.d.redefined:
                    self.rep.error(
                        t.stacking_span, f"unknown layer kind `{k}`", partial(did_you_mean, k, self.d.layer_defs)
                    )
            slots, n = [], 0
            for kind in schedule:
                if t.per_layer and (not kinds or kind in kinds):
                    slots.append(n)
                    n += 1
                else:
                    slots.append(-1)
            if dt is None or None in shape:
                continue
            out[t.name] = Tensor(
                t.name,
                t.kind,
                TensorType(dt, shape),
                tuple(sharding),
                t.per_layer,
                n if t.per_layer else 0,
                tuple(slots) if t.per_layer else (),
                t.span,
            )
        return out

    # ------------------------------------------------------------------ functions

    def elaborate_functions(self, tensors, schedule, dims):
        step = self.d.steps[0]
        rows = next(iter(dims), None)
        if len(step.params) != 2:
            self.rep.error(
                step.span,
                f"`step` takes 2 inputs (token ids, positions), got {len(step.params)}",
                "write `step(tokens, positions) { ... }`",
            )
        inputs = tuple(Value(p, TensorType(dtypes.I32, (rows,)), step.span) for p in step.params[:2])
        ctx = _Context(self, tensors, {v.name: v for v in inputs}, schedule)
        graph = ctx.build_graph("step", step, params=(), layer_kind=None)
        if graph is not None and ctx.layers_node is None and schedule:
            self.rep.error(step.span, "the step never calls `layers(...)`, so no layer is run")
        if graph is not None:
            self.check_step_results(graph, step, rows, ctx)
        return graph, tuple(ctx.kind_graphs.values()), inputs, ctx.used

    def elaborate_mtp(self, tensors, schedule, dims, used: set[str]) -> tuple[Graph | None, tuple[Value, ...]]:
        """The `mtp` head's graph: the hidden state `[rows, W]` and the step's inputs in, the head's
        hidden state (the same type) and logits `[rows, V]` out."""
        for dup in self.d.mtps[1:]:
            self.rep.error(dup.span, f"second `mtp` head (first at line {self.d.mtps[0].span.line})")
        if not self.d.mtps:
            return None, ()
        d, rows = self.d.mtps[0], next(iter(dims), None)
        h, tok, pos = d.func.params
        dt, shape = self.check_type(d.hidden_type, h, allow_dims=True)
        if dt is None or None in shape:
            return None, ()
        hidden = TensorType(dt, shape)
        if len(shape) != 2 or shape[0] != rows or not dt.float:
            self.rep.error(d.hidden_type.span, f"the hidden state `{h}` must be a float [{rows}, width], not {hidden}")
            return None, ()
        inputs = tuple(Value(p, TensorType(dtypes.I32, (rows,)), d.span) for p in (tok, pos))
        ctx = _Context(self, tensors, {v.name: v for v in inputs}, schedule)
        graph = ctx.build_graph("mtp", d.func, params=(Value(h, hidden, d.span),), layer_kind=None)
        used |= ctx.used
        if graph is None:
            return None, ()
        types = [ctx.type_of(graph, r) for r in graph.results]
        if len(types) != 2 or types[0] != TensorType(dtypes.F32, shape) or types[1].shape[:1] != (rows,):
            got = ", ".join(str(t) for t in types)
            self.rep.error(
                _return_span(d.func),
                f"`mtp` must return (hidden f32[{rows}, {shape[1]}], logits f32[{rows}, V]); it returns ({got})",
            )
            return None, ()
        return graph, inputs

    def check_step_results(self, graph: Graph, step: FuncDef, rows: str, ctx: _Context) -> None:
        types = [ctx.type_of(graph, r) for r in graph.results]
        ok = (
            len(types) == 2
            and types[0].dtype == dtypes.F32
            and len(types[0].shape) == 2
            and types[0].shape[0] == rows
            and types[1] == TensorType(dtypes.I32, (rows,))
        )
        if not ok:
            got = ", ".join(str(t) for t in types)
            self.rep.error(
                _return_span(step),
                f"`step` must return (logits f32[{rows}, V], next tokens i32[{rows}]); it returns ({got})",
                "end the step with `return logits, argmax(logits)`",
            )


def _return_span(f: FuncDef) -> Span:
    return next((s.span for s in f.body if isinstance(s, ReturnStmt)), f.span)


def _shown(e: Expr) -> str:
    """An operand as messages name it: as written in the spec, not by its SSA value name."""
    if isinstance(e, Name):
        return e.id
    if isinstance(e, Call):
        return f"{e.func}(...)"
    if isinstance(e, BinOp):
        left, right = (_shown(x) if not isinstance(x, BinOp) else "(...)" for x in (e.left, e.right))
        return f"{left} {e.op} {right}"
    return "..."


def _means_unset(op, name: str, v) -> bool:
    """Whether `v` is the value the op reads as "attribute not given" (`OpDef.unset`)."""
    return any(n == name and type(v) is type(u) and v == u for n, u in op.unset)


def graph_value_type(graph: Graph, ref: Ref) -> TensorType:
    for v in graph.params:
        if v.name == ref.name:
            return v.type
    for n in graph.nodes:
        for v in n.outputs:
            if v.name == ref.name:
                return v.type
    raise KeyError(ref.name)


class _Context:
    """Elaborates function bodies: inlines blocks, builds each layer kind's graph once."""

    def __init__(self, el: _Elaborator, tensors, inputs: dict[str, Value], schedule):
        self.el, self.rep, self.tensors, self.inputs, self.schedule = el, el.rep, tensors, inputs, schedule
        self.kind_graphs: dict[str, Graph] = {}
        self.layers_node: Node | None = None
        self.depth, self.too_deep = 0, False  # nesting of tensor expressions and block calls
        self.used: set[str] = set()  # declared tensors some elaborated body reads

    def build_graph(self, name: str, f: FuncDef, params: tuple[Value, ...], layer_kind: str | None) -> Graph | None:
        g = _GraphBuilder(name, layer_kind)
        env = {}
        for v in params:
            g.types[v.name] = v.type
            env[v.name] = Ref("value", v.name)
        results = self.run_body(f, env, g, inline_stack=())
        if results is None:
            return None
        return Graph(name, params, tuple(g.nodes), tuple(results), f.span)

    def run_body(self, f: FuncDef, env: dict[str, Ref], g, inline_stack) -> list[Ref] | None:
        returns = [s for s in f.body if isinstance(s, ReturnStmt)]
        if not returns:
            self.rep.error(f.span, f"`{f.name}` has no `return`")
            return None
        body = f.body
        if f.body[-1] is not returns[0]:
            self.rep.error(returns[0].span, "`return` must be the last statement")
            body = (*(s for s in f.body if isinstance(s, AssignStmt)), returns[0])  # no follow-on errors
        failed = False
        for s in body:
            if isinstance(s, AssignStmt):
                refs = self.expr(s.value, env, g, inline_stack, name_hint=s.targets[0])
                if refs is not None and len(refs) != len(s.targets):
                    self.rep.error(
                        s.span,
                        f"the right side gives {len(refs)} value{'s' if len(refs) != 1 else ''} "
                        f"but {len(s.targets)} name{'s are' if len(s.targets) != 1 else ' is'} assigned",
                    )
                    refs = None
                if refs is None:
                    failed = True
                    for t in s.targets:  # poison: uses of these names are not reported again
                        env[t] = None
                    continue
                for t, r in zip(s.targets, refs):
                    env[t] = r
            elif s is returns[0]:
                out = []
                for e in s.values:
                    refs = self.expr(e, env, g, inline_stack)
                    if refs is None:
                        failed = True
                    elif len(refs) != 1:
                        self.rep.error(e.span, f"this returns {len(refs)} values where one is expected")
                        failed = True
                    else:
                        out.extend(refs)
                return None if failed else out
        return None

    # ---------------------------------------------------------------- expressions

    def expr(self, e: Expr, env, g, inline_stack, name_hint: str | None = None) -> list[Ref] | None:
        """The values of a tensor expression (None after reporting an error)."""
        if self.depth >= MAX_NESTING:  # bounded: elaboration recurses through expressions and blocks
            if not self.too_deep:
                self.rep.error(
                    e.span,
                    f"expressions and block calls nest more than {MAX_NESTING} deep here",
                    "name intermediate values (`y = ...`) or inline some blocks",
                )
            self.too_deep = True
            return None
        self.depth += 1
        try:
            return self._expr(e, env, g, inline_stack, name_hint)
        finally:
            self.depth -= 1

    def _expr(self, e: Expr, env, g, inline_stack, name_hint: str | None) -> list[Ref] | None:
        if isinstance(e, Name):
            r = self.lookup(e, env, g)
            return None if r is None else [r]
        scalar = self.is_scalar(e, env, g)
        if isinstance(e, Call) and not scalar:
            return self.call(e, env, g, inline_stack, name_hint)
        if isinstance(e, BinOp) and not scalar:
            left, right = self.is_scalar(e.left, env, g), self.is_scalar(e.right, env, g)
            if not left and not right and e.op in _OPERATORS:
                call = Call(e.span, _OPERATORS[e.op], e.span, (e.left, e.right), ())
                return self.call(call, env, g, inline_stack, name_hint)
            if right and e.op in _SCALAR_RIGHT:
                return self.scalar_op(_SCALAR_RIGHT[e.op], e, e.left, e.right, env, g, inline_stack, name_hint)
            if left and e.op in _SCALAR_LEFT:
                return self.scalar_op(_SCALAR_LEFT[e.op], e, e.right, e.left, env, g, inline_stack, name_hint)
        if isinstance(e, UnOp) and e.op == "-" and not scalar:
            call = Call(e.span, "neg", e.span, (e.operand,), ())
            return self.call(call, env, g, inline_stack, name_hint)
        if isinstance(e, Num):
            self.rep.error(
                e.span,
                f"expected a tensor, got the number {e.value!r}",
                "numbers can be passed as keyword attributes, e.g. `eps=1e-5`",
            )
            return None
        if scalar:
            self.rep.error(
                e.span,
                "expected a tensor, got a constant expression",
                "constants combine with tensors through `+ - * /` (`x * 2.0`) or as attributes",
            )
            return None
        op = e.op if isinstance(e, (BinOp, UnOp)) else "?"
        self.rep.error(e.span, f"operator `{op}` is not defined on tensors", NOT_ON_TENSORS)
        return None

    def is_scalar(self, e: Expr, env, g) -> bool:
        """A constant expression here: numbers, constants, a block's constant parameters, the layer
        index in a layer, and math functions of them (`ln`, `sqrt`, ...; consts.MATH)."""
        for n in walk(e):
            if isinstance(n, Name):
                if isinstance(env.get(n.id), Const):
                    continue
                if n.id in env or n.id in self.tensors or n.id in self.inputs or n.id in self.el.d.tensors:
                    return False
                if n.id not in self.el.d.consts and not (n.id == "l" and g.layer_kind is not None):
                    return False
            elif isinstance(n, Call) and (n.func not in MATH or n.func in self.el.d.blocks or n.kwargs):
                return False
        return True

    def scalar_op(self, name: str, e: Expr, tensor: Expr, scalar: Expr, env, g, inline_stack, name_hint):
        """A tensor with a constant (`x * 2.5`, `1.0 - x`, `maximum(x, 0.0)`): op `name`, the constant
        folded into its attribute `s`."""
        call = Call(e.span, name, e.span, (tensor,), (Kwarg(scalar.span, "s", scalar),))
        return self.apply(OPS[name], call, env, g, inline_stack, name_hint)

    def scalar_value(self, e: Expr, env, g):
        """The value of a constant expression in a body (a `LayerExpr` if it varies by layer), or None."""
        local = {k: v.value for k, v in env.items() if isinstance(v, Const)}
        layers = [i for i, kind in enumerate(self.schedule) if kind == g.layer_kind] if g.layer_kind else []
        return self.el.consts.layer_attr(e, layers, local) if layers else self.el.consts.eval(e, local)

    def lookup(self, e: Name, env, g) -> Ref | None:
        if isinstance(env.get(e.id), Const):
            self.rep.error(
                e.span,
                f"`{e.id}` is a constant parameter of this block, not a tensor",
                "use it in attributes or with `+ - * /` on a tensor",
            )
            return None
        if e.id in env:
            return env[e.id]  # None when poisoned by an earlier error
        if e.id in self.el.d.tensors:
            self.used.add(e.id)
        if e.id in self.tensors:
            t = self.tensors[e.id]
            if t.stacked and g.layer_kind is None:
                self.rep.error(e.span, f"`{e.id}` is declared per layer, so it can only be used inside a layer")
                return None
            if (
                t.stacked
                and t.slots
                and all(s < 0 for s, k in zip(t.slots, self.schedule) if k == g.layer_kind)
                and g.layer_kind in self.schedule
            ):
                self.rep.error(
                    e.span,
                    f"`{e.id}` has no slice for layer kind `{g.layer_kind}`",
                    f"declare it `per layer({g.layer_kind}, ...)` or use it in another kind",
                )
                return None
            return Ref("tensor", e.id)
        if e.id in self.inputs:
            return Ref("input", e.id)
        if e.id in self.el.d.tensors or e.id in self.el.d.redefined:
            return None  # the declaration itself was already reported
        if e.id in self.el.d.consts:
            self.rep.error(
                e.span, f"`{e.id}` is a constant, not a tensor", "pass constants as attributes, e.g. `eps=EPS`"
            )
            return None
        known = [*env, *self.tensors, *self.inputs]
        self.rep.error(e.span, f"unknown name `{e.id}`", partial(did_you_mean, e.id, known))
        return None

    def operand(self, ref: Ref, g, shown: str | None = None) -> Operand:
        if ref.kind == "tensor":
            t = self.tensors[ref.name]
            return Operand(t.type, "tensor", shown or ref.name, t.kind == "state")
        if ref.kind == "input":
            return Operand(self.inputs[ref.name].type, "input", shown or ref.name)
        return Operand(g.types[ref.name], "value", shown or ref.name)

    def type_of(self, graph: Graph, ref: Ref) -> TensorType:
        """Type of a result of a built graph: a value it computes, a declared tensor or a step input."""
        return graph_value_type(graph, ref) if ref.kind == "value" else self.operand(ref, None).type

    def call(self, e: Call, env, g, inline_stack, name_hint) -> list[Ref] | None:
        if e.func == "layers":
            return self.call_layers(e, env, g, inline_stack)
        if e.func in self.el.d.blocks:
            return self.inline_block(e, env, g, inline_stack)
        if e.func in self.el.d.redefined and e.func not in OPS:
            return None  # a block defined twice (reported), or its name taken by another item
        if e.func in _SCALAR_CALLS and len(e.args) == 2:
            left, right = (self.is_scalar(a, env, g) for a in e.args)
            if left != right:
                tensor, scalar = (e.args[1], e.args[0]) if left else e.args
                return self.scalar_op(_SCALAR_CALLS[e.func], e, tensor, scalar, env, g, inline_stack, name_hint)
        if e.func not in OPS or OPS[e.func].internal:
            known = [*(k for k, o in OPS.items() if not o.internal), *self.el.d.blocks, "layers"]
            self.rep.error(e.func_span, f"unknown op or block `{e.func}`", partial(did_you_mean, e.func, known))
            return None
        return self.apply(OPS[e.func], e, env, g, inline_stack, name_hint)

    def apply(self, op, e: Call, env, g, inline_stack, name_hint) -> list[Ref] | None:
        """The node of op `op` for call `e`: operands, attributes, shape rule, in-place writes."""
        if not len(op.operands) - op.optional <= len(e.args) <= len(op.operands):
            least = f"{len(op.operands) - op.optional} to " if op.optional else ""
            self.rep.error(
                e.span,
                f"`{op.name}` takes {least}{len(op.operands)} operand{'s' if len(op.operands) != 1 else ''} "
                f"({', '.join(op.operands)}), got {len(e.args)}",
            )
            return None
        args = [self.expr(a, env, g, inline_stack) for a in e.args]
        attrs = self.attributes(e, op, env, g)
        if any(a is None for a in args) or attrs is None:
            return None
        refs = []
        for a, arg_e in zip(args, e.args):
            if len(a) != 1:
                self.rep.error(arg_e.span, f"this gives {len(a)} values where one operand is expected")
                return None
            refs.append(a[0])
        operands = [self.operand(r, g, _shown(a)) for r, a in zip(refs, e.args)]
        if op.block_attrs and not resolve_block_attrs(self, e, op, attrs, operands, g.layer_kind):
            return None
        try:
            out_types = op.infer(operands, {k: v.first if isinstance(v, LayerExpr) else v for k, v in attrs.items()})
        except OpError as err:
            span = e.span
            if isinstance(err.arg, int):
                span = e.args[err.arg].span
            elif isinstance(err.arg, str):
                span = next((k.span for k in e.kwargs if k.name == err.arg), e.span)
            self.rep.error(span, f"{op.name}: {err}", err.hint)
            return None
        writes = self.in_place_writes(op, e, refs, operands)
        if writes is None:
            return None
        block = inline_stack[-1] if inline_stack else ""
        refs = [self.read_state(op, name, r, o, g, e, block) for name, r, o in zip(op.operands, refs, operands)]
        outs = tuple(Value(g.fresh(name_hint or op.name), t, e.span) for t in out_types)
        g.add(Node(op.name, tuple(refs), tuple(sorted(attrs.items())), outs, tuple(writes), e.span, block))
        return [Ref("value", v.name) for v in outs]

    def read_state(self, op, name: str, ref: Ref, operand: Operand, g, e: Call, block: str) -> Ref:
        """A state tensor the op reads as a plain value (not in place, not moved by the op itself)
        is read through a `read_state` node (mkdsl/ops/state.py): one kernel copy into VMEM."""
        if ref.kind != "tensor" or not operand.is_state or name in op.inout or op.reached(name) == "own":
            return ref
        v = Value(g.fresh(f"{ref.name}_value"), operand.type, e.span)
        g.add(Node(READ_STATE, (ref,), (), (v,), (), e.span, block))
        return Ref("value", v.name)

    def in_place_writes(self, op, e: Call, refs: list[Ref], operands: list[Operand]) -> list[str] | None:
        """The state tensors the node updates in place: declared states, each passed once."""
        writes: list[str] = []
        for name in op.inout:
            i = op.operands.index(name)
            if refs[i].kind != "tensor" or not operands[i].is_state:
                self.rep.error(
                    e.args[i].span,
                    f"{op.name}: operand `{name}` is updated in place, so it must be a declared state tensor",
                )
                return None
            if refs[i].name in writes:
                first = op.inout[writes.index(refs[i].name)]
                self.rep.error(
                    e.args[i].span,
                    f"{op.name}: `{refs[i].name}` is passed as both `{first}` and `{name}`, which are updated in place",
                    "give each its own state tensor",
                )
                return None
            writes.append(refs[i].name)
        return writes

    def attributes(self, e: Call, op, env, g) -> dict | None:
        attrs, ok = {}, True
        for k in e.kwargs:
            if k.name in attrs:
                self.rep.error(k.span, f"attribute `{k.name}` is given twice")
                ok = False
                continue
            v = k.value
            if k.name in dict(op.block_attrs):  # a block's name, elaborated once the operands are known
                attrs[k.name] = v
                continue
            if (
                isinstance(v, Name)
                and not isinstance(env.get(v.id), Const)
                and v.id not in self.el.d.consts
                and (v.id in env or v.id in self.el.d.tensors or v.id in self.inputs)
            ):
                self.rep.error(
                    v.span,
                    f"attribute `{k.name}` must be a constant, but `{v.id}` is a tensor",
                    "tensors are operands: pass them before the attributes",
                )
                attrs[k.name], ok = None, False
                continue
            if k.name not in op.attrs:
                hint = did_you_mean(k.name, op.attrs) or (
                    f"`{op.name}` takes: {', '.join(op.attrs)}" if op.attrs else f"`{op.name}` takes no attributes"
                )
                self.rep.error(k.span, f"`{op.name}` has no attribute `{k.name}`", hint)
                ok = False
                continue
            v = self.scalar_value(k.value, env, g)
            if v is None or not self.representable(k, v.first if isinstance(v, LayerExpr) else v):
                ok = False
            attrs[k.name] = None if _means_unset(op, k.name, v) else v
        for name, default in op.attrs.items():
            if name not in attrs:
                if default is REQUIRED:
                    self.rep.error(e.span, f"`{op.name}` needs the attribute `{name}=...`")
                    ok = False
                attrs[name] = default
        return attrs if ok else None

    def representable(self, k, v) -> bool:
        """A real-valued attribute must survive the kernel's float32 (the reference's too)."""
        if not isinstance(v, float) or v == 0 or F32_TINY <= abs(v) <= F32_MAX:
            return True
        what = "beyond float32's range" if abs(v) > F32_MAX else "rounds to 0 in float32"
        self.rep.error(k.value.span, f"attribute `{k.name}` = {v!r} is {what}", "kernels compute in float32")
        return False

    def inline_block(self, e: Call, env, g, inline_stack) -> list[Ref] | None:
        f = self.el.d.blocks[e.func]
        if e.func in inline_stack:
            chain = " -> ".join((*inline_stack[inline_stack.index(e.func) :], e.func))
            self.rep.error(
                e.func_span, f"block `{e.func}` calls itself ({chain}); blocks are inlined, so recursion is not allowed"
            )
            return None
        bound = self.bind_block_args(e, f)
        if bound is None:
            return None
        inner, ok = {}, True
        for p in f.params:
            a, caller = bound[p]
            scope = env if caller else {}  # a default is a constant of the spec, not of the caller
            if self.is_scalar(a, scope, g):
                inner[p] = self.const_arg(a, scope, g)
                ok = ok and inner[p] is not None
                continue
            refs = self.expr(a, env, g, inline_stack)
            if refs is not None and len(refs) != 1:
                self.rep.error(a.span, f"this gives {len(refs)} values where one argument is expected")
                refs = None
            inner[p] = None if refs is None else refs[0]  # poisoned, but the body's other errors are still found
            ok = ok and refs is not None
        results = self.run_body(f, inner, g, (*inline_stack, e.func))
        return results if ok else None

    def bind_block_args(self, e: Call, f: FuncDef) -> dict[str, tuple[Expr, bool]] | None:
        """Each parameter's argument (positional, then by name, then its default), and whether the
        caller wrote it; None after reporting a mismatch."""
        defaults = dict(f.defaults)
        if len(e.args) > len(f.params) or (not e.kwargs and not defaults and len(e.args) != len(f.params)):
            self.rep.error(
                e.span,
                f"block `{f.name}` takes {len(f.params)} argument{'s' if len(f.params) != 1 else ''} "
                f"({', '.join(f.params)}), got {len(e.args)}",
            )
            return None
        bound = {p: (a, True) for p, a in zip(f.params, e.args)}
        ok = True
        for k in e.kwargs:
            if k.name not in f.params:
                hint = did_you_mean(k.name, f.params) or f"its parameters: {', '.join(f.params) or 'none'}"
                self.rep.error(k.span, f"block `{f.name}` has no parameter `{k.name}`", hint)
                ok = False
            elif k.name in bound:
                self.rep.error(k.span, f"parameter `{k.name}` of block `{f.name}` is given twice")
                ok = False
            else:
                bound[k.name] = (k.value, True)
        for p in f.params:
            if p not in bound and p in defaults:
                bound[p] = (defaults[p], False)
            elif p not in bound and ok:
                self.rep.error(e.span, f"block `{f.name}` needs an argument for its parameter `{p}`")
                ok = False
        return bound if ok else None

    def const_arg(self, a: Expr, env, g) -> Const | None:
        """A block's constant argument: one value at every layer of the kind it is inlined into."""
        v = self.scalar_value(a, env, g)
        if isinstance(v, LayerExpr):
            self.rep.error(
                a.span,
                "a block's constant argument must have one value at every layer of a kind",
                "split the layer kind, or pass the layer-dependent expression as an attribute",
            )
            return None
        return None if v is None else Const(v)

    def call_layers(self, e: Call, env, g, inline_stack) -> list[Ref] | None:
        if g.layer_kind is not None or g.name != "step" or inline_stack:
            self.rep.error(e.func_span, "`layers(...)` can only be called from `step`")
            return None
        if self.layers_node is not None:
            self.rep.error(e.func_span, "`layers(...)` is called twice; the layer stack runs once per step")
            return None
        refs = []
        for a in e.args:
            r = self.expr(a, env, g, inline_stack)
            if r is None:
                return None
            refs.extend(r)
        if self.layers_node is not None:  # `layers(layers(...))`: the inner call ran first
            self.rep.error(e.func_span, "`layers(...)` is called twice; the layer stack runs once per step")
            return None
        carries = tuple(Value(f"carry{i}", self.operand(r, g).type, e.span) for i, r in enumerate(refs))
        used = [k for k in dict.fromkeys(self.schedule) if k in self.el.d.layer_defs]  # others are reported
        ok = True
        for kind in used:
            f = self.el.d.layer_defs[kind]
            if len(f.params) != len(carries):
                self.rep.error(
                    f.span,
                    f"layer `{kind}` takes {len(f.params)} carried value{'s' if len(f.params) != 1 else ''} "
                    f"but `layers(...)` at line {e.span.line} passes {len(carries)}",
                )
                ok = False
                continue
            params = tuple(Value(p, c.type, f.span) for p, c in zip(f.params, carries))
            graph = self.build_graph(kind, f, params, layer_kind=kind)
            if graph is None:
                ok = False
                continue
            got = [self.type_of(graph, r) for r in graph.results]
            want = [c.type for c in carries]
            if got != want:
                self.rep.error(
                    _return_span(f),
                    f"layer `{kind}` must return what it carries ({', '.join(map(str, want))}), "
                    f"but returns ({', '.join(map(str, got))})",
                )
                ok = False
                continue
            self.kind_graphs[kind] = graph
        if not ok:
            return None
        outs = tuple(Value(g.fresh(f"{p}_out"), c.type, e.span) for p, c in zip(("x",) * len(carries), carries))
        writes = tuple(sorted({w for kg in self.kind_graphs.values() for n in kg.nodes for w in n.writes}))
        node = Node("layers", tuple(refs), (), outs, writes, e.span)
        self.layers_node = node
        g.add(node)
        return [Ref("value", v.name) for v in outs]


class _GraphBuilder:
    """SSA construction: every value gets a unique name derived from the spec's own names."""

    def __init__(self, name: str, layer_kind: str | None):
        self.name, self.layer_kind = name, layer_kind
        self.nodes: list[Node] = []
        self.types: dict[str, TensorType] = {}
        self._counts: dict[str, int] = {}

    def fresh(self, hint: str) -> str:
        n = self._counts.get(hint, 0)
        self._counts[hint] = n + 1
        name = hint if n == 0 else f"{hint}_{n}"
        while name in self.types:
            n += 1
            self._counts[hint] = n + 1
            name = f"{hint}_{n}"
        return name

    def add(self, node: Node) -> None:
        self.nodes.append(node)
        for v in node.outputs:
            self.types[v.name] = v.type


def spec_sha256(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


__all__ = ["HINTS", "SpecError", "elaborate", "load", "spec_sha256"]
