"""Emit the Pallas TPU megakernel module for a planned model, through Jinja2 templates.

emit.py decides names and, for each IR node, asks the op's lowering (lowering.py, lowerings/)
for the record its macro renders; it names no op. The templates hold all the code text
(module.py.jinja: the module and kernel skeleton; lowerings/*.jinja: one macro per op;
runtime/*.py.jinja: the building blocks the generated module carries).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from mkdsl.backends.tpu.lowering import Site, lowering_for, sites
from mkdsl.backends.tpu.lowerings.attention import KV_SLOTS
from mkdsl.backends.tpu.wrapper import wrapper_context
from mkdsl.lang.dtypes import storage
from mkdsl.lang.ir import Graph, LayerExpr, Model, Node, Ref
from mkdsl.ops import OPS
from mkdsl.plan import roles
from mkdsl.plan.buffers import buffer_of
from mkdsl.plan.planner import ROW_TILE
from mkdsl.plan.types import Alloc, OpScratch, Plan
from mkdsl.plan.vmem import VMEM_PER_CORE
from mkdsl.version import __version__

TEMPLATES = Path(__file__).parent / "templates"
# The runtime parts lowerings may ask for (`Lowering.runtime`), in the order a module carries them.
RUNTIME_PARTS = (
    "runtime/attention.py.jinja",
    "runtime/mla.py.jinja",
    "runtime/kda.py.jinja",
    "runtime/residual.py.jinja",
    "runtime/decode.py.jinja",
    "runtime/qlinear.py.jinja",
    "runtime/gguf.py.jinja",
    "runtime/scales.py.jinja",
    "runtime/routing.py.jinja",
    "runtime/moe.py.jinja",
    "runtime/elementwise.py.jinja",
    "runtime/draft.py.jinja",
    "runtime/norm.py.jinja",
)


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )


@dataclass(frozen=True)
class Source:
    """Where the spec lives, for the header and the per-phase comments."""

    path: str
    text: str
    sha256: str
    command: str  # the command that regenerates the output, for the header

    def line(self, n: int) -> str:
        lines = self.text.splitlines()
        return lines[n - 1].strip() if 1 <= n <= len(lines) else ""


def emit_module(model: Model, local: Model, plan: Plan, source: Source) -> str:
    """The generated kernel module's text (deterministic: same inputs, same bytes).

    `model` is the spec's model (the layouts a loader sees), `local` what one device runs
    (mkdsl.spmd.shard; the same model on a one-device mesh), `plan` the plan of `local`."""
    return _Emitter(model, local, plan, source).render()


class _Emitter:
    """Renders the module; also the services a lowering's `record` uses: `m` (the per-device
    model), `plan`, `seq` and `layer_var` (the body being lowered), `operand`, `output`,
    `fetched`, `slot_expr`, `value_width`, `attr_codes`, `scratch_of`, `stream_const`, `mask`,
    `group_index`; what the kernel builds once at entry (`objects`; `drained`: objects with DMAs
    still in flight when their call returns, built first and drained at the end), per-step setup
    code (`setup_once`), and `shared`, state a lowering keeps across the nodes of a module."""

    def __init__(self, model: Model, local: Model, plan: Plan, source: Source):
        self.whole, self.m, self.plan, self.src = model, local, plan, source
        self.sharded = bool(plan.collectives)
        self.slot_tables: dict[tuple[int, ...], str] = {}
        self.drained: list[dict] = []  # dict(obj, ctor)
        self.setup: dict = {}  # setup function -> None, in order of first use
        self.shared: dict[str, object] = {}
        self.casts: set[tuple[str, str]] = set()  # (graph, value) already cast to bf16
        self.where = {(g, v): b for g, v, b in plan.buffers}
        self.scratch = {(sc.graph, sc.node): sc for sc in plan.scratch}
        self.fetch_index: dict[str, int] = {}
        self.objects: list[str] = []  # lowering objects built once at kernel entry
        self.layer_var, self.waited = "li", set()
        self.seq = ""  # the tile sequence of the body being lowered

    # ------------------------------------------------------------------ names

    def stream_const(self, seq: str, st) -> str:
        return f"S_{seq}_{st.node}".upper()

    def slot_expr(self, tensor: str, layer: str) -> str:
        t = self.m.tensor(tensor)
        if not t.stacked:
            return "0"
        if t.slots == tuple(range(len(self.m.schedule))):
            return layer
        if t.slots not in self.slot_tables:
            self.slot_tables[t.slots] = f"slots{len(self.slot_tables)}"
        return f"{self.slot_tables[t.slots]}_ref[{layer}]"

    def slot_table(self, tensor: str) -> str:
        """The module's table of `tensor`'s layer slices ("None": the layer index, or not stacked)."""
        expr = self.slot_expr(tensor, "layer")
        return expr.removesuffix("_ref[layer]").upper() if expr.endswith("_ref[layer]") else "None"

    # ------------------------------------------------------------------ nodes

    def lower_body(self, g: Graph, nodes, seq: str, layer: str = "li") -> tuple[list[str], list[dict]]:
        """(fetch starts, lowered nodes) of one body; each spec line is quoted once, above its first node."""
        self.layer_var, self.waited = layer, set()
        names = roles.fetched_weights(self.m, Graph(g.name, g.params, tuple(node for _, node in nodes), (), g.span))
        starts = [f"{self.fetch_copy(name)}.start()" for name in names]
        runs = self.windows(g)
        inside = {j for run in runs.values() for j in run}
        out, last = [], None
        for idx, node in nodes:
            if idx in inside:  # lowered into its collective's `during` function
                continue
            during = [self.lower_node(g, j, g.nodes[j], seq) for j in runs.get(idx, ())]
            n = self.lower_node(g, idx, node, seq, during)
            n["comment"] = node.span.line != last
            last = node.span.line
            out.append(n)
        return starts, out

    def windows(self, g: Graph) -> dict[int, tuple[int, ...]]:
        """Index of the node whose code calls a collective -> the nodes run during its first
        exchange (Plan.windows)."""
        heads = {v: i for i, n in enumerate(g.nodes) for v in (n.outputs[0].name,) if n.outputs}
        return {heads[value]: run for graph, value, run in self.plan.windows if graph == g.name}

    @staticmethod
    def during_def(name: str, records: list[dict]) -> list[str]:
        """The function a collective runs while its first exchange travels: the window's code."""
        lines, last = [f"def {name}():  # runs while the exchange's messages travel: needs none of it"], None
        for n in records:
            if n["line"] != last:
                lines.append(f"    # spec line {n['line']}: {n['source']}")
                last = n["line"]
            lines += [f"    {line}" if line else "" for line in n["code"].rstrip("\n").split("\n")]
        return lines

    def mask(self, axes) -> int:
        from mkdsl.plan.collectives import mask_of

        return mask_of(self.m.mesh, axes)

    def group_index(self, axes) -> str:
        """Kernel code for this device's index among the shards over `axes`."""
        return f"comm.group_index({self.mask(axes)})"

    def fetch_copy(self, name: str) -> str:
        t = self.m.tensor(name)
        i = self.fetch_index.setdefault(name, len(self.fetch_index))
        slot = "None" if not t.stacked and len(t.type.shape) > 1 else self.slot_expr(name, self.layer_var)
        return f"fetch(r.{name}, r.f_{name}, r.fetch_sem.at[{i}], {slot}, {roles.fetch_block(t)})"

    def fetched(self, name: str, pre: list[str]) -> str:
        """Code for a fetched weight at its use: waits on the first use in this body."""
        if name not in self.waited:
            self.waited.add(name)
            pre.append(f"{self.fetch_copy(name)}.wait()")
        t = self.m.tensor(name)
        if len(t.type.shape) == 1:
            return f"pick_row(r.f_{name}, {self.slot_expr(name, self.layer_var)})"
        return f"r.f_{name}"

    def lower_node(self, g: Graph, idx: int, node: Node, seq: str, during: list[dict] | None = None) -> dict:
        """The node's record, from its op's lowering, and the kernel code its macro renders;
        `during`: the records of the nodes its collective runs while it exchanges."""
        pre: list[str] = self.during_def(f"during_{idx}", during) if during else []
        at, lw = Site(g, idx, node), lowering_for(node.op)
        outs = [buffer_of(self.where, g, Ref("value", v.name)) for v in node.outputs]
        n = {"op": node.op, "line": node.span.line, "source": self.src.line(node.span.line), "pre": pre}
        n.update(out=outs[0] if outs else None, outs=outs, during=f"during_{idx}" if during else "")
        self.seq = seq
        n.update(lw.record(self, at, [self.operand(g, r) for r in node.inputs], pre))
        macro = getattr(_env().get_template(lw.template).module, lw.macro)
        n["code"] = "".join(f"{line}\n" for line in pre) + str(macro(n))
        return n

    def output(self, at: Site) -> str | None:
        """The buffer of the node's first result."""
        outs = at.node.outputs
        return buffer_of(self.where, at.graph, Ref("value", outs[0].name)) if outs else None

    def scratch_of(self, at: Site) -> OpScratch:
        return self.scratch[(at.graph.name, at.index)]

    def setup_once(self, fn) -> None:
        """Run `fn(em) -> lines` once, after every node is lowered, for the kernel's per-step setup."""
        self.setup.setdefault(fn, None)

    def attr_codes(self, node: Node) -> dict[str, str]:
        return {k: attr_code(v) for k, v in node.attr.items()}

    def operand(self, g: Graph, ref: Ref) -> str:
        if ref.kind == "value":
            return buffer_of(self.where, g, ref)
        return ref.name

    def value_width(self, g: Graph, ref: Ref) -> int:
        from mkdsl.lang.elaborate import graph_value_type

        return graph_value_type(g, ref).shape[1]

    # ------------------------------------------------------------------ module

    def sequences(self) -> list[dict]:
        out = []
        for seq in self.plan.sequences:
            streams = []
            for st in seq.streams:
                streams.append(
                    dict(
                        const=self.stream_const(seq.name, st),
                        ref=st.tensor,
                        k=st.k,
                        n=st.n,
                        tk=st.tk,
                        tn=st.tn,
                        start=st.start,
                        stacked=st.stacked,
                        line=st.line,
                        slot_table=self.slot_table(st.tensor),
                        quant=bool(st.parts),
                        transposed=st.transposed,
                        valid=st.valid,
                        fmt=st.fmt,
                        group=st.group,
                        parts=repr(tuple(st.parts)),
                    )
                )
            out.append(dict(name=seq.name, const=f"{seq.name.upper()}_TILES", tiles=seq.tiles, streams=streams))
        return out

    def bodies(self, seqs: dict) -> dict:
        """The lowered layer kinds, prologue, carries and epilogue (lowered in that order)."""
        m = self.m
        kinds = []
        for k in m.kinds:
            starts, body = self.lower_body(k, list(enumerate(k.nodes)), k.name)
            results = [dict(buf=f"carry{i}", value=buffer_of(self.where, k, r)) for i, r in enumerate(k.results)]
            kinds.append(
                dict(
                    name=k.name,
                    index=len(kinds),
                    line=k.span.line,
                    body=body,
                    starts=starts,
                    results=[r for r in results if r["buf"] != r["value"]],
                    **{key: seqs[k.name][key] for key in ("streams", "const", "tiles")},
                )
            )
        cut = next(i for i, n in enumerate(m.step.nodes) if n.op == "layers")
        steps = list(enumerate(m.step.nodes))
        prologue_starts, prologue = self.lower_body(m.step, steps[:cut], "prologue", layer="0")
        carries = [dict(buf=f"carry{i}", init=self.operand(m.step, r)) for i, r in enumerate(m.step.nodes[cut].inputs)]
        epilogue_starts, epilogue_body = self.lower_body(m.step, steps[cut + 1 :], "epilogue", layer="0")
        return dict(
            kinds=kinds,
            prologue_starts=prologue_starts,
            prologue=prologue,
            prologue_streams=seqs.get("prologue", {}).get("streams", []),
            carries=[c for c in carries if c["buf"] != c["init"]],  # values built in their carry need no copy
            epilogue=dict(seqs["epilogue"], body=epilogue_body, starts=epilogue_starts),
            traced=[dict(name=v.name, buf=f"carry{i}", width=v.type.shape[1]) for i, v in enumerate(m.kinds[0].params)],
        )

    def layer_tables(self, seqs: dict) -> dict:
        """Kind index and first global tile of each layer (after the prologue's; and the epilogue's first)."""
        m = self.m
        base, bases = seqs["prologue"]["tiles"] if "prologue" in seqs else 0, []  # the prologue's tiles come first
        for name in m.schedule:
            bases.append(base)
            base += seqs[name]["tiles"]
        bases.append(base)
        layer_kind = [[k.name for k in m.kinds].index(name) for name in m.schedule]
        slot_tables = [
            dict(
                name=name,
                table=repr(list(slots)),
                users=", ".join(t.name for t in m.tensors if t.stacked and t.slots == slots),
            )
            for slots, name in self.slot_tables.items()
        ]
        return dict(layer_kind=repr(layer_kind), layer_base=repr(bases), slot_tables=slot_tables)

    def padded_arrays(self) -> dict[str, tuple[tuple[int, int, int, int], ...]]:
        """Storage arrays stored wider than one device's slice (the plan's `pads`: a streamed
        matrix's outputs to whole 128-lane tiles, expert widths, ...): name -> per padded axis
        (axis, width per device, padded width, devices along it). Parts a padding leaves alone
        (e.g. block scales that already cover the padded width) are not listed."""
        pads: dict[str, dict[int, int]] = {}
        for name, axis, width in self.plan.pads:
            pads.setdefault(name, {})[axis] = width
        out = {}
        for name, axes in pads.items():
            local, whole = self.m.tensor(name), self.whole.tensor(name)
            if local.kind != "weight":
                continue
            wide = roles.stored(local, pads)
            parts = zip(
                storage(local.type.dtype, local.full_shape),
                storage(local.type.dtype, wide.full_shape),
                storage(whole.type.dtype, whole.full_shape),
                strict=True,
            )
            for part, padded, glob in parts:
                entry = tuple(
                    (axis, part.shape[axis], padded.shape[axis], glob.shape[axis] // part.shape[axis])
                    for axis in sorted(axes)
                    if padded.shape[axis] != part.shape[axis]
                )
                if entry:
                    out[_part_name(name, part)] = entry
        return out

    def arrays(self) -> dict:
        """The kernel's weight and state arrays: global and per-device layouts, splits, fetch padding."""
        m, weights, pads = self.m, list(self.m.weights), self.padded_arrays()

        def shape(name: str, dims: tuple, local: bool) -> str:
            dims = list(dims)
            for axis, _, padded, blocks in pads.get(name, ()):
                dims[axis] = padded if local else padded * blocks
            return repr(tuple(dims))

        return dict(
            pads=[dict(name=k, axes=repr(v)) for k, v in pads.items()],
            weights=[
                dict(
                    name=_part_name(w.name, part),
                    shape=shape(_part_name(w.name, part), part.shape, False),
                    dtype=part.dtype,
                    local=shape(_part_name(w.name, part), local.shape, True),
                    split=_split(w),
                )
                for w in self.whole.weights
                for part, local in zip(
                    storage(w.type.dtype, w.full_shape),
                    storage(w.type.dtype, m.tensor(w.name).full_shape),
                    strict=True,
                )
            ],
            states=[self.state(s) | {"split": _split(s)} for s in self.whole.states],
            local_states=[self.state(s) for s in m.states],
            row_states=self.m.row_states(),
            hbm_inputs=[_part_name(w.name, part) for w in weights for part in storage(w.type.dtype, w.full_shape)],
            vectors=[w.name for w in weights if len(w.type.shape) == 1 and not w.stacked],
            padded=[
                dict(name=w.name, rows=roles.padded_rows(w))
                for w in weights
                if len(w.type.shape) == 1 and w.stacked and roles.padded_rows(w) != w.stack
            ],
        )

    def render(self) -> str:
        m, plan = self.m, self.plan
        seqs = {s["name"]: s for s in self.sequences()}
        bodies = self.bodies(seqs)
        context = dict(
            version=__version__,
            spec_path=self.src.path,
            spec_sha=self.src.sha256,
            command=self.src.command,
            profile=m.profile,
            model=m.name,
            num_layers=len(m.schedule),
            ring_depth=plan.ring_depth,
            bank=plan.bank,
            kv_tile=plan.kv_tile,
            kv_slots=KV_SLOTS,
            row_tile=ROW_TILE,
            batch_range=(m.dims[0].low, m.dims[0].high),
            vmem_limit=vmem_limit(plan),
            sharded=self.sharded,
            mesh_axes=repr(tuple(a for a, _ in m.mesh)),
            mesh_shape=repr(tuple(n for _, n in m.mesh)),
            logits_split=repr(_logits_axes(m)),
            collective_id=self.plan.collective_id,
            comm_masks=self.plan.comm_masks,
            sequences=list(seqs.values()),
            scratch=[dict(name=a.name, ctor=_ctor(a)) for a in plan.vmem if a.scratch],
            drained=self.drained,
            objects=self.objects,
            setup=[line for fn in self.setup for line in fn(self)],
            seq_tiles=any("seq_tiles" in str(d) for a in plan.vmem for d in a.shape),
            wire_rows=any(d == "wire_rows" for a in plan.vmem for d in a.shape),
            runtime=self.runtime_parts(),
            logits=self.operand(m.step, m.step.results[0]),
            next_tokens=self.operand(m.step, m.step.results[1]),
            vocab=_vocab(m),
            **bodies,
            **self.layer_tables(seqs),
            **self.arrays(),
            wrapper=wrapper_context(self.whole, self.plan.kv_tile),
        )
        return _env().get_template("module.py.jinja").render(**context)

    def runtime_parts(self) -> list[str]:
        """The runtime templates this module needs (its lowerings' parts), so a dense model
        carries no KDA code."""
        needed = set()
        for at in sites(self.m):
            lw = lowering_for(at.node.op)
            needed.update(lw.runtime, lw.runtime_of(self.m, at) if lw.runtime_of else ())
        parts = ["core"] + (["comm", "sharded"] if self.sharded else [])
        return [f"runtime/{p}.py.jinja" for p in parts] + [p for p in RUNTIME_PARTS if p in needed]

    def state(self, t) -> dict:
        dims = [d.name for d in self.m.dims]
        names = {dims[0]: "batch", **({dims[1]: "seq_len"} if len(dims) > 1 else {})}
        shape = [names.get(d, d) if isinstance(d, str) else d for d in t.full_shape]
        per_row = t.name in self.m.row_states()  # a slot per verify row
        expr = [f"{d} * rows" if per_row and d == "batch" else str(d) for d in shape]
        expr = "(" + ", ".join(expr) + ("," if len(shape) == 1 else "") + ")"
        doc = "(" + ", ".join(f'"{d}"' if isinstance(d, str) else str(d) for d in shape) + ")"
        return dict(name=t.name, shape_expr=expr, shape_doc=doc, dtype=t.type.dtype.numpy)


def _split(t) -> str:
    """PartitionSpec entries of a tensor's stored dims: None (whole) or the mesh axes it splits over."""
    dims = ((),) * t.stacked + tuple(t.sharding)
    return repr(tuple(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in dims))


def _logits_axes(m: Model):
    """The mesh axes the step's logits are split over (by vocabulary), or None: those of the
    exchange that picks the next token from them (`OpDef.exchange` "best")."""
    for node in m.step.nodes:
        op = OPS.get(node.op)
        if op is not None and op.exchange == "best" and node.attr.get(op.exchange_axes):
            axes = node.attr[op.exchange_axes]
            return axes[0] if len(axes) == 1 else tuple(axes)
    return None


def _part_name(name: str, part) -> str:
    """Kernel input name of one storage array: `w`, or `w_codes` / `w_scales` when quantised."""
    return f"{name}_{part.suffix}" if part.suffix else name


def attr_code(v) -> str:
    """An attribute as kernel code: a literal, or a layer-dependent expression in `li`."""
    if isinstance(v, LayerExpr):
        return v.kernel
    return repr(float(v)) if isinstance(v, float) else repr(v)


def _vocab(m: Model) -> int:
    from mkdsl.lang.elaborate import graph_value_type

    return graph_value_type(m.step, m.step.results[0]).shape[1]


def _ctor(a: Alloc) -> str:
    shape = ", ".join(str(d) for d in a.shape) + ("," if len(a.shape) == 1 else "")
    if a.memory == "SEM":
        return f"pltpu.SemaphoreType.DMA(({shape}))"
    ctor = "pltpu.VMEM" if a.memory == "VMEM" else "pltpu.SMEM"
    return f"{ctor}(({shape}), jnp.{a.dtype})"


def vmem_limit(plan: Plan) -> int:
    """The compiler's VMEM limit: the core's whole VMEM. The planner fits its buffers under its cap;
    Mosaic's own scratch comes on top and varies by kernel (2.7 MiB seen for Kimi K3, 4.8 MiB for
    Mixtral's 4096-wide bf16 experts, which a limit of the plan + 4 MiB refused), and nothing else
    uses the core's VMEM while the kernel runs."""
    assert plan.vmem_total <= VMEM_PER_CORE
    return VMEM_PER_CORE
