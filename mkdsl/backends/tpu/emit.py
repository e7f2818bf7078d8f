"""Emit the Pallas TPU megakernel module for a planned model, through Jinja2 templates.

emit.py decides names and prepares one small record per IR node; the templates hold all the
code text (module.py.jinja: the module and kernel skeleton; ops.jinja: one macro per op;
runtime.py.jinja: the building blocks every generated module carries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from mkdsl import __version__
from mkdsl.backends.tpu.wrapper import wrapper_context
from mkdsl.diagnostics import Diagnostic, SpecError
from mkdsl.dtypes import storage
from mkdsl.ir import Graph, LayerExpr, Model, Node, Ref
from mkdsl.ops import OPS
from mkdsl.plan import roles
from mkdsl.plan.buffers import buffer_of
from mkdsl.plan.planner import KV_SLOTS, ROW_TILE
from mkdsl.plan.types import Alloc, Plan

TEMPLATES = Path(__file__).parent / "templates"
# Ops whose lowering takes layer-dependent attributes (`layer=l`) as traced scalars.
DYNAMIC_ATTRS = {"res_mix", "res_snapshot"}


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
    (mkdsl.shard; the same model on a one-device mesh), `plan` the plan of `local`."""
    return _Emitter(model, local, plan, source).render()


class _Emitter:
    def __init__(self, model: Model, local: Model, plan: Plan, source: Source):
        self.whole, self.m, self.plan, self.src = model, local, plan, source
        self.sharded = bool(plan.collectives)
        self.errors: list[Diagnostic] = []
        self.slot_tables: dict[tuple[int, ...], str] = {}
        self.attentions: list[dict] = []
        self.rope_tables: dict[tuple[int, float], str] = {}
        self.casts: set[tuple[str, str]] = set()  # (graph, value) already cast to bf16
        self.where = {(g, v): b for g, v, b in plan.buffers}
        self.scratch = {(g, i): p for g, i, p in plan.scratch}
        self.fetch_index: dict[str, int] = {}
        self.objects: list[str] = []  # lowering objects built once at kernel entry
        self.moe_objects: set[str] = set()
        self.layer_var, self.waited = "li", set()

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

    # ------------------------------------------------------------------ nodes

    def lower_body(self, g: Graph, nodes, seq: str, layer: str = "li") -> tuple[list[str], list[dict]]:
        """(fetch starts, lowered nodes) of one body; each spec line is quoted once, above its first node."""
        self.layer_var, self.waited = layer, set()
        names = roles.fetched_weights(self.m, Graph(g.name, g.params, tuple(node for _, node in nodes), (), g.span))
        starts = [f"{self.fetch_copy(name)}.start()" for name in names]
        out, last = [], None
        for idx, node in nodes:
            n = self.lower_node(g, idx, node, seq)
            n["comment"] = node.span.line != last
            last = node.span.line
            out.append(n)
        return starts, out

    def moe_object(self, g: Graph, idx: int, node: Node) -> str | None:
        """The MoE object of a moe_experts node (built once), or of the one a route node feeds."""
        if node.op == "route":
            ids = node.outputs[1].name
            users = [(i, n) for i, n in enumerate(g.nodes) if n.op == "moe_experts" and n.inputs[2].name == ids]
            if len(users) != 1 or any(r.name == ids for n in g.nodes if n.op != "moe_experts" for r in n.inputs):
                self.errors.append(
                    Diagnostic(
                        node.span,
                        "the kernel lowers `route` together with the one "
                        "`moe_experts` that uses its ids; here they are used elsewhere too",
                    )
                )
                return None
            idx, node = users[0]
        prefix = self.scratch[(g.name, idx)]
        obj = f"{prefix}_{g.name}_{idx}"
        if obj not in self.moe_objects:
            self.moe_objects.add(obj)
            w1, w3, w2 = (r.name for r in node.inputs[3:6])
            e, d, f = self.m.tensor(w1).type.shape
            k = self.value_width(g, node.inputs[2])
            slots, _, tn = self.alloc_shape(f"{prefix}_w1c")  # [slots, D/8, tn], as the planner sized it
            names = {
                "w1c": f"{w1}_codes",
                "w1s": f"{w1}_scales",
                "w3c": f"{w3}_codes",
                "w3s": f"{w3}_scales",
                "w2c": f"{w2}_codes",
                "w2s": f"{w2}_scales",
            }
            route = next(n for n in g.nodes if n.op == "route" and n.outputs[1].name == node.inputs[2].name)
            e_route = self.value_width(g, route.inputs[0])
            expert_axes = node.attr.get("expert_axes", ())
            lo = f", E_route={e_route}, lo={self.group_index(expert_axes)} * {e}" if expert_axes else ""
            self.objects.append(
                f"{obj} = MoE(r, rows=rows, batch=batch, E={e}, k={k}, D={d}, F={f}, tn={tn}, slots={slots}, "
                f"names={names!r}, prefix={prefix + '_'!r}, beta={float(node.attr['beta'])!r}, "
                f"linear_beta={float(node.attr['linear_beta'])!r}{lo})"
            )
        return obj

    def mask(self, axes) -> int:
        from mkdsl.plan.collectives import mask_of

        return mask_of(self.m.mesh, axes)

    def group_index(self, axes) -> str:
        """Kernel code for this device's index among the shards over `axes`."""
        return f"comm.group_index({self.mask(axes)})"

    def alloc_shape(self, name: str) -> tuple:
        return next(a.shape for a in self.plan.vmem if a.name == name)

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

    def lower_node(self, g: Graph, idx: int, node: Node, seq: str) -> dict:
        pre: list[str] = []
        n = {"op": node.op, "line": node.span.line, "source": self.src.line(node.span.line), "pre": pre}
        ins = [self.operand(g, r) for r in node.inputs]
        outs = [buffer_of(self.where, g, Ref("value", v.name)) for v in node.outputs]
        prefix = self.scratch.get((g.name, idx))
        n["out"] = outs[0] if outs else None
        n["outs"] = outs
        op = OPS[node.op]
        attr = {k: attr_code(v) for k, v in node.attr.items()}
        dynamic = [k for k, v in node.attr.items() if isinstance(v, LayerExpr)]
        if dynamic and node.op not in DYNAMIC_ATTRS and op.kernel_expr is None:
            self.errors.append(
                Diagnostic(
                    node.span,
                    f"`{node.op}` needs `{dynamic[0]}` to be the same at every layer of a kind",
                    "split the layer kind, or use a constant",
                )
            )
        if node.op == "linear":
            st = self.plan.sequence(seq).stream(node.outputs[0].name)
            key = (g.name, node.inputs[0].name)
            n.update(
                x=ins[0],
                xb=f"{ins[0]}_bf16",
                cast=key not in self.casts,
                stream=self.stream_const(seq, st),
                slot=self.slot_expr(st.tensor, "li"),
                base="base",
            )
            self.casts.add(key)
        elif node.op == "rmsnorm":
            n.update(x=ins[0], w=self.fetched(node.inputs[1].name, pre), eps=attr["eps"], heads=node.attr["heads"])
        elif node.op == "l2norm":
            n.update(x=ins[0], heads=node.attr["heads"], scale=attr["scale"], eps=attr["eps"])
        elif node.op == "short_conv":
            state = node.inputs[2].name
            obj = f"{prefix}_{g.name}_{idx}"
            self.objects.append(f"{obj} = ShortConv(r.{state}, r.{state}_out, r.{prefix}_buf, r.{prefix}_sem, batch)")
            n.update(
                obj=obj, slot=self.slot_expr(state, self.layer_var), x=ins[0], w=self.fetched(node.inputs[1].name, pre)
            )
        elif node.op == "kda_gate":
            n.update(
                f=ins[0],
                a_log=self.fetched(node.inputs[1].name, pre),
                dt_bias=self.fetched(node.inputs[2].name, pre),
                scale=f"{prefix}_scale",
                heads=node.attr["heads"],
                lower=attr["lower"],
            )
        elif node.op == "delta_rule":
            state = node.inputs[5].name
            obj = f"{prefix}_{g.name}_{idx}"
            self.objects.append(
                f"{obj} = DeltaRule(r.{state}, r.{state}_out, r.{prefix}_in, r.{prefix}_out, "
                f"r.{prefix}_sem, batch, {node.attr['heads']})"
            )
            n.update(obj=obj, slot=self.slot_expr(state, self.layer_var), args=", ".join(f"r.{b}" for b in ins[:5]))
        elif node.op == "route":
            experts = self.moe_object(g, idx, node)
            w1 = next(
                u.inputs[3].name for u in g.nodes if u.op == "moe_experts" and u.inputs[2].name == node.outputs[1].name
            )
            n.update(
                obj=experts,
                scores=ins[0],
                bias=self.fetched(node.inputs[1].name, pre),
                slot=self.slot_expr(w1, self.layer_var),
            )
        elif node.op == "moe_experts":
            n.update(
                obj=self.moe_object(g, idx, node),
                slot=self.slot_expr(node.inputs[3].name, self.layer_var),
                z=ins[0],
                weights=ins[1],
            )
        elif node.op == "res_init":
            n.update(x=ins[0])
        elif node.op == "res_mix":
            n.update(
                blocks=ins[0],
                prefix=ins[1],
                w=self.fetched(node.inputs[2].name, pre),
                layer=attr["layer"],
                block=attr["block"],
                after=attr["after_snapshot"],
                eps=attr["eps"],
            )
        elif node.op == "res_snapshot":
            n.update(blocks=ins[0], prefix=ins[1], layer=attr["layer"], block=attr["block"])
        elif node.op == "rope":
            width = self.value_width(g, node.inputs[0])
            d = width // node.attr["heads"]
            key = (d, float(node.attr["theta"]))
            if key not in self.rope_tables:
                self.rope_tables[key] = f"rope{len(self.rope_tables)}"
            n.update(x=ins[0], table=self.rope_tables[key], heads=node.attr["heads"])
        elif node.op == "attention":
            n.update(self.attention(node, ins, prefix))
        elif node.op == "mla_attention":
            n.update(self.latent_attention(node, ins, prefix))
        elif node.op == "embedding":
            axes = node.attr.get("shard_axes", ())
            rows = self.m.tensor(node.inputs[1].name).type.shape[0]
            n.update(
                table=node.inputs[1].name,
                block="emb_block",
                offset=f"{self.group_index(axes)} * {rows}" if axes else "0",
            )
        elif node.op == "argmax":
            width = self.value_width(g, node.inputs[0])
            axes = node.attr.get("shard_axes", ())
            n.update(x=ins[0], chunk=_chunk(width), mask=self.mask(axes) if axes else None)
            if axes:
                n.update(offset=f"{self.group_index(axes)} * {width}")
        elif node.op == "all_reduce":
            from mkdsl.plan.collectives import exchange_rows

            two = any(
                c.two_level and (c.graph, c.value) == (g.name, node.outputs[0].name) for c in self.plan.collectives
            )
            n.update(
                x=ins[0],
                mask=self.mask(node.attr["axes"]),
                wire="BF16" if self.plan.wire == "bf16" else "F32",
                rows=exchange_rows(self.m),
                method="all_reduce_two_level" if two else "all_reduce",
            )
        elif node.op == "all_gather":
            n.update(x=ins[0], mask=self.mask(node.attr["axes"]))
        elif node.op == "shard_slice":
            n.update(x=ins[0], index=self.group_index(node.attr["axes"]), ways=node.attr["ways"])
        elif op.kernel_expr is not None:
            values = {}
            for name, b, ref in zip(op.operands, ins, node.inputs, strict=True):
                is_weight = ref.kind == "tensor" and self.m.tensor(ref.name).kind == "weight"
                values[name] = self.fetched(ref.name, pre) if is_weight else f"r.{b}[...]"
            n["op"] = "elementwise"
            n["expr"] = op.kernel_expr.format(**values, **attr)
            if n["out"] in ("logits", "next_tokens"):  # the outputs hold batch rows, not padded rows
                n["expr"] = f"({n['expr']})[0:batch]"
        else:
            self.errors.append(Diagnostic(node.span, f"op `{node.op}` has no TPU lowering yet"))
        return n

    def operand(self, g: Graph, ref: Ref) -> str:
        if ref.kind == "value":
            return buffer_of(self.where, g, ref)
        return ref.name

    def value_width(self, g: Graph, ref: Ref) -> int:
        from mkdsl.elaborate import graph_value_type

        return graph_value_type(g, ref).shape[1]

    def attention(self, node: Node, ins: list[str], prefix: str) -> dict:
        i = int(prefix[3:])
        kc, vc = self.m.tensor(node.inputs[3].name), self.m.tensor(node.inputs[4].name)
        _, kvh, _, dk = kc.type.shape
        dv = vc.type.shape[3]
        scale = node.attr["scale"] if node.attr["scale"] is not None else dk**-0.5
        names = {
            key: f"att{i}_{key}"
            for key in ("q2d", "k2d", "v2d", "o2d", "ktiles", "vtiles", "m", "l", "acc", "wb", "kv_sem", "wb_sem")
        }
        names.update(k_cache=kc.name, v_cache=vc.name, k_cache_out=f"{kc.name}_out", v_cache_out=f"{vc.name}_out")
        obj = f"attention{i}"
        self.attentions.append(
            dict(
                obj=obj,
                ctor=(
                    f"Attention(r, positions_ref, {i}, rows=rows, batch=batch, heads={node.attr['heads']}, kv_heads={kvh}, "
                    f"dk={dk}, dv={dv}, kv_tile=KV_TILE, kv_slots=KV_SLOTS, scale={float(scale)!r}, names={names!r})"
                ),
            )
        )
        return dict(obj=obj, slot=self.slot_expr(kc.name, "li"), q=ins[0], k=ins[1], v=ins[2])

    def latent_attention(self, node: Node, ins: list[str], prefix: str) -> dict:
        i = int(prefix[3:])
        cache = self.m.tensor(node.inputs[4].name)
        a = node.attr
        scale = a["scale"] if a["scale"] is not None else (a["nope"] + a["extra"]) ** -0.5
        names = {
            key: f"att{i}_{key}"
            for key in ("ql", "ol", "wtiles", "w_sem", "tiles", "m", "l", "acc", "new", "wb", "kv_sem", "wb_sem")
        }
        names.update(cache=cache.name, cache_out=f"{cache.name}_out", w_kvb=node.inputs[3].name)
        obj = f"attention{i}"
        self.attentions.append(
            dict(
                obj=obj,
                ctor=(
                    f"LatentAttention(r, positions_ref, {i}, rows=rows, batch=batch, heads={a['heads']}, nope={a['nope']}, "
                    f"extra={a['extra']}, vdim={a['vdim']}, kv_tile=KV_TILE, kv_slots=KV_SLOTS, scale={float(scale)!r}, "
                    f"names={names!r})"
                ),
            )
        )
        return dict(obj=obj, slot=self.slot_expr(cache.name, "li"), q=ins[0], c=ins[1], e=ins[2])

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
                        slot_expr_issue=self.slot_expr(st.tensor, "layer"),
                    )
                )
            out.append(dict(name=seq.name, const=f"{seq.name.upper()}_TILES", tiles=seq.tiles, streams=streams))
        return out

    def render(self) -> str:
        m, plan = self.m, self.plan
        seqs = {s["name"]: s for s in self.sequences()}
        kinds = []
        for k in m.kinds:
            starts, body = self.lower_body(k, list(enumerate(k.nodes)), k.name)
            results = [dict(buf=f"carry{i}", value=buffer_of(self.where, k, r)) for i, r in enumerate(k.results)]
            results = [r for r in results if r["buf"] != r["value"]]
            kinds.append(
                dict(
                    name=k.name,
                    index=len(kinds),
                    line=k.span.line,
                    body=body,
                    starts=starts,
                    results=results,
                    **{key: seqs[k.name][key] for key in ("streams", "const", "tiles")},
                )
            )
        cut = next(i for i, n in enumerate(m.step.nodes) if n.op == "layers")
        steps = list(enumerate(m.step.nodes))
        prologue_starts, prologue = self.lower_body(m.step, steps[:cut], "epilogue", layer="0")
        layers = m.step.nodes[cut]
        carries = [dict(buf=f"carry{i}", init=self.operand(m.step, r)) for i, r in enumerate(layers.inputs)]
        carries = [c for c in carries if c["buf"] != c["init"]]  # values built in their carry need no copy
        epilogue_starts, epilogue_body = self.lower_body(m.step, steps[cut + 1 :], "epilogue", layer="0")
        epilogue = dict(seqs["epilogue"], body=epilogue_body, starts=epilogue_starts)
        if self.errors:
            raise SpecError(self.errors)
        tiles_of_kind = self.tiles_of_kind(kinds)
        layer_kind = [[k.name for k in m.kinds].index(name) for name in m.schedule]
        base, bases = 0, []
        for name in m.schedule:
            bases.append(base)
            base += seqs[name]["tiles"]
        bases.append(base)
        weights = [w for w in m.weights]
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
            kinds=kinds,
            layer_kind=repr(layer_kind),
            layer_base=repr(bases),
            slot_tables=[
                dict(
                    name=name,
                    table=repr(list(slots)),
                    users=", ".join(t.name for t in m.tensors if t.stacked and t.slots == slots),
                )
                for slots, name in self.slot_tables.items()
            ],
            weights=[
                dict(
                    name=_part_name(w.name, part),
                    shape=repr(tuple(part.shape)),
                    dtype=part.dtype,
                    local=repr(tuple(local.shape)),
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
            sharded=self.sharded,
            mesh_axes=repr(tuple(a for a, _ in m.mesh)),
            mesh_shape=repr(tuple(n for _, n in m.mesh)),
            logits_split=repr(_logits_axes(m)),
            collective_id=self.plan.collective_id,
            sequences=list(seqs.values()),
            epilogue=epilogue,
            tiles_of_kind=tiles_of_kind,
            hbm_inputs=[_part_name(w.name, part) for w in weights for part in storage(w.type.dtype, w.full_shape)],
            vectors=[w.name for w in weights if len(w.type.shape) == 1 and not w.stacked],
            padded=[
                dict(name=w.name, rows=roles.padded_rows(w))
                for w in weights
                if len(w.type.shape) == 1 and w.stacked and roles.padded_rows(w) != w.stack
            ],
            scratch=[dict(name=a.name, ctor=_ctor(a)) for a in plan.vmem if a.scratch],
            attentions=self.attentions,
            objects=self.objects,
            prologue_starts=prologue_starts,
            runtime=self.runtime_parts(),
            rope_tables=[dict(name=name, d=d, theta=repr(theta)) for (d, theta), name in self.rope_tables.items()],
            prologue=prologue,
            carries=carries,
            logits=self.operand(m.step, m.step.results[0]),
            next_tokens=self.operand(m.step, m.step.results[1]),
            vocab=_vocab(m),
            wrapper=wrapper_context(self.whole, self.plan.kv_tile),
        )
        return _env().get_template("module.py.jinja").render(**context)

    def runtime_parts(self) -> list[str]:
        """The runtime templates this module needs, so a dense model carries no KDA code."""
        ops = {n.op for g in [*self.m.kinds, self.m.step] for n in g.nodes}
        parts = ["core"] + (["comm", "sharded"] if self.sharded else [])
        for part, needs in (
            ("attention", {"attention", "mla_attention"}),
            ("mla", {"mla_attention"}),
            ("kda", {"short_conv", "l2norm", "kda_gate", "delta_rule"}),
            ("residual", {"res_init", "res_mix", "res_snapshot"}),
            ("moe", {"moe_experts"}),
        ):
            if ops & needs:
                parts.append(part)
        return [f"runtime/{p}.py.jinja" for p in parts]

    def tiles_of_kind(self, kinds: list[dict]) -> str:
        if len(kinds) == 1:
            return kinds[0]["const"]
        kind = "layer_kind_ref[jnp.minimum(layer, NUM_LAYERS - 1)]"
        expr = kinds[-1]["const"]
        for i, k in reversed(list(enumerate(kinds[:-1]))):
            expr = f"jnp.where({kind} == {i}, {k['const']}, {expr})"
        return expr

    def state(self, t) -> dict:
        dims = [d.name for d in self.m.dims]
        names = {dims[0]: "batch", **({dims[1]: "seq_len"} if len(dims) > 1 else {})}
        shape = [names.get(d, d) if isinstance(d, str) else d for d in t.full_shape]
        expr = "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
        doc = "(" + ", ".join(f'"{d}"' if isinstance(d, str) else str(d) for d in shape) + ")"
        return dict(name=t.name, shape_expr=expr, shape_doc=doc, dtype=t.type.dtype.numpy)


def _split(t) -> str:
    """PartitionSpec entries of a tensor's stored dims: None (whole) or the mesh axes it splits over."""
    dims = ((),) * t.stacked + tuple(t.sharding)
    return repr(tuple(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in dims))


def _logits_axes(m: Model):
    """The mesh axes the step's logits are split over (by vocabulary), or None."""
    for node in m.step.nodes:
        if node.op == "argmax" and node.attr.get("shard_axes"):
            axes = node.attr["shard_axes"]
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
    from mkdsl.elaborate import graph_value_type

    return graph_value_type(m.step, m.step.results[0]).shape[1]


def _chunk(width: int) -> int:
    """Columns scanned per step of an in-kernel reduction: a lane-aligned divisor of `width`."""
    if width % 128:
        return width
    best = 128
    for c in range(128, min(width, 2048) + 1, 128):
        if width % c == 0:
            best = c
    return best


def _ctor(a: Alloc) -> str:
    shape = ", ".join(str(d) for d in a.shape) + ("," if len(a.shape) == 1 else "")
    if a.memory == "SEM":
        return f"pltpu.SemaphoreType.DMA(({shape}))"
    ctor = "pltpu.VMEM" if a.memory == "VMEM" else "pltpu.SMEM"
    return f"{ctor}(({shape}), jnp.{a.dtype})"


def vmem_limit(plan: Plan) -> int:
    """The compiler's VMEM limit: the planned total plus headroom for Mosaic's own scratch, capped."""
    return int(min(64 << 20, max(plan.vmem_cap, math.ceil(plan.vmem_total / (1 << 20)) * (1 << 20) + (4 << 20))))
