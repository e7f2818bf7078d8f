"""Shard a checked model over its mesh: the per-device model that every device runs.

Runs between the checker and the planner. Each value gets a placement — whole on every device
(`R`), split along its last dimension over some mesh axes (`S`), or a partial sum over some
axes (`P`) — propagated through each graph by one rule per op. Where an op needs an operand in
another placement the pass inserts the collective that makes it so: `all_reduce` right after a
row-parallel projection, an expert-parallel MoE or a vocabulary-split embedding, `all_gather`
before an op that needs the whole value. Tensor shapes and per-head attributes become
per-device. A one-device mesh returns the model unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mkdsl.lang.diagnostics import Diagnostic, SpecError
from mkdsl.lang.ir import Graph, LayerExpr, Model, Node, Ref, Tensor, TensorType, Value
from mkdsl.ops import OPS, Operand, OpError
from mkdsl.ops.collective import GATHER_SPLITS, SUM_PARTIALS, TAKE_MINE
from mkdsl.spmd.defer_norm import defer_norms
from mkdsl.spmd.overlap import order_independent
from mkdsl.spmd.ready import order_ready_together


@dataclass(frozen=True)
class Place:
    """Where a value lives: `R` whole everywhere, `S` split (last dim) or `P` partial over `axes`."""

    kind: str
    axes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return "whole on every device" if self.kind == "R" else f"{self.kind}({', '.join(self.axes)})"


WHOLE = Place("R")


class Rewrite(Exception):  # noqa: N818 (a rule's answer, not an error)
    """A rule's answer that the node is to be sharded as these simpler nodes (`OpDef.row_split`)."""

    def __init__(self, nodes: list[Node]):
        super().__init__("rewrite")
        self.nodes = nodes


class ShardError(Exception):
    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def devices(model: Model) -> int:
    return math.prod(size for _, size in model.mesh)


def split_note(model: Model, t: Tensor, dim: int) -> str:
    """For dimension `dim` of a per-device tensor that is split: " per device (N in all, split W
    ways over AXES)", so a diagnostic about a device's slice also gives the whole size."""
    axes = t.sharding[dim]
    if not axes or not isinstance(t.type.shape[dim], int):
        return ""
    ways = math.prod(dict(model.mesh)[a] for a in axes)
    return f" per device ({t.type.shape[dim] * ways} in all, split {ways} ways over {', '.join(axes)})"


def is_sharded(model: Model) -> bool:
    return devices(model) > 1 and any(any(axes) for t in model.tensors for axes in t.sharding)


def shard(model: Model) -> Model:
    """The per-device model: local shapes and attributes, collectives inserted, norms deferred
    past the row-parallel projections they feed (mkdsl/spmd/defer_norm.py), then the collectives ready
    together moved next to each other (mkdsl/spmd/ready.py), then the nodes that need none of a group of
    collectives right after it (mkdsl/spmd/overlap.py: they run while it exchanges)."""
    if not is_sharded(model):
        return model
    return order_independent(order_ready_together(defer_norms(_Sharder(model).run())))


class _Sharder:
    def __init__(self, model: Model):
        self.m = model
        self.mesh = dict(model.mesh)
        self.order = [name for name, _ in model.mesh]
        self.errors: list[Diagnostic] = []
        self.tensors = {t.name: self.local_tensor(t) for t in model.tensors}

    def ways(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh[a] for a in axes)

    def sorted_axes(self, axes) -> tuple[str, ...]:
        return tuple(a for a in self.order if a in set(axes))

    def local_tensor(self, t: Tensor) -> Tensor:
        shape = tuple(
            d // self.ways(axes) if axes and isinstance(d, int) else d
            for d, axes in zip(t.type.shape, t.sharding, strict=True)
        )
        return dataclasses.replace(t, type=TensorType(t.type.dtype, shape))

    def run(self) -> Model:
        kinds = tuple(self.graph(k, carried=True) for k in self.m.kinds)
        step = self.graph(self.m.step, carried=False)
        if self.errors:
            raise SpecError(self.errors)
        return dataclasses.replace(self.m, tensors=tuple(self.tensors.values()), kinds=kinds, step=step)

    # ------------------------------------------------------------------ one graph

    def graph(self, g: Graph, carried: bool) -> Graph:
        place: dict[str, Place] = {v.name: WHOLE for v in g.params}
        types: dict[str, TensorType] = {v.name: v.type for v in g.params}
        converted: dict[tuple[str, Place], str] = {}
        out: list[Node] = []
        for node in g.nodes:
            try:
                out.extend(self.node(g, node, place, types, converted))
            except ShardError as e:
                self.errors.append(Diagnostic(node.span, f"{node.op}: {e}", e.hint))
                for v in node.outputs:  # carry on as if whole, to report independent errors too
                    place[v.name], types[v.name] = WHOLE, v.type
        results = list(g.results)
        for i, r in enumerate(g.results):
            if r.kind != "value" or place.get(r.name, WHOLE).kind == "R":
                continue
            if not carried and i == 0 and place[r.name].kind == "S":
                continue  # the logits may stay split over the vocabulary: the caller sees one array
            pre: list[Node] = []
            results[i] = self.convert(g, 0, place[r.name], WHOLE, types, converted, pre, ref=r)
            out.extend(pre)
        return dataclasses.replace(g, nodes=tuple(out), results=tuple(results))

    def operand_place(self, ref: Ref, place) -> Place:
        if ref.kind == "value":
            return place[ref.name]
        if ref.kind == "tensor":
            axes = self.tensors[ref.name].sharding[-1]
            return Place("S", axes) if axes else WHOLE
        return WHOLE

    def node(self, g: Graph, node: Node, place, types, converted) -> list[Node]:
        if node.op not in OPS:  # the layer stack: carried values are whole on every device: gather or sum them first
            pre: list[Node] = []
            inputs = [
                self.convert(node, i, place[r.name], WHOLE, types, converted, pre)
                if r.kind == "value" and place[r.name].kind != "R"
                else r
                for i, r in enumerate(node.inputs)
            ]
            node = dataclasses.replace(node, inputs=tuple(inputs))
            for v in node.outputs:
                place[v.name], types[v.name] = WHOLE, v.type
            return [*pre, node]
        places = [self.operand_place(r, place) for r in node.inputs]
        self.types = types  # the per-device types so far, for rules that look at operand shapes
        rule = RULES.get(OPS[node.op].shard)  # the op's rule family (OpDef.shard)
        if rule is None:
            raise ShardError("no sharding rule for this op yet")
        try:
            need, outs, attrs = rule(self, node, places)
        except Rewrite as r:
            return [m for n in r.nodes for m in self.node(g, n, place, types, converted)]
        pre: list[Node] = []
        inputs = list(node.inputs)
        for i, want in need.items():
            if places[i] != want:
                inputs[i] = self.convert(node, i, places[i], want, types, converted, pre)
        attr = dict(node.attrs) | attrs
        operands = [self.operand(r, types) for r in inputs]
        try:
            out_types = OPS[node.op].infer(
                operands, {k: v.first if isinstance(v, LayerExpr) else v for k, v in attr.items()}
            )
        except OpError as e:
            raise ShardError(f"per device: {e}{self.whole_note(g, node, operands)}", e.hint) from None
        outputs = []
        for v, t, p in zip(node.outputs, out_types, outs, strict=True):
            outputs.append(Value(v.name, t, v.span))
            place[v.name], types[v.name] = p, t
        new = dataclasses.replace(node, inputs=tuple(inputs), attrs=tuple(attr.items()), outputs=tuple(outputs))
        return [*pre, new]

    def whole_note(self, g: Graph, node: Node, operands: list[Operand]) -> str:
        """The operands whose per-device type differs from the whole one, with both types."""
        from mkdsl.lang.elaborate import graph_value_type

        parts = []
        for ref, local in zip(node.inputs, operands, strict=True):
            whole = self.m.tensor(ref.name).type if ref.kind == "tensor" else local.type
            if ref.kind == "value":
                whole = graph_value_type(g, ref)
            if whole != local.type:
                parts.append(f"`{ref.name}` is {local.type} per device, {whole} whole")
        return f" ({'; '.join(parts)})" if parts else ""

    def operand(self, ref: Ref, types) -> Operand:
        if ref.kind == "tensor":
            t = self.tensors[ref.name]
            return Operand(t.type, "tensor", ref.name, t.kind == "state")
        if ref.kind == "input":
            return Operand(next(v.type for v in self.m.inputs if v.name == ref.name), "input", ref.name)
        return Operand(types[ref.name], "value", ref.name)

    def convert(self, at, i: int, have: Place, want: Place, types, converted, pre: list[Node], ref=None) -> Ref:
        """A ref to operand i of `at` in placement `want`, inserting the collective that makes it."""
        ref = ref or at.inputs[i]
        if ref.kind != "value":
            raise ShardError(
                f"operand {i + 1} (`{ref.name}`) is {have} but this op needs it {want}",
                "split the tensors that meet in this op alike, or leave them whole",
            )
        key = (ref.name, want)
        if key in converted:
            return Ref("value", converted[key])
        name, t = ref.name, types[ref.name]
        if have.kind == "P":  # partial sums: add them up first
            name, t = self.emit(pre, at, SUM_PARTIALS, name, t, f"{ref.name}__sum", t, axes=have.axes)
            converted[(ref.name, WHOLE)] = name
            have = WHOLE
        if have == want:
            pass
        elif have.kind == "S" and want.kind == "R":
            ways = self.ways(have.axes)
            whole = TensorType(t.dtype, (*t.shape[:-1], t.shape[-1] * ways))
            name, t = self.emit(pre, at, GATHER_SPLITS, name, t, f"{ref.name}__whole", whole, axes=have.axes, ways=ways)
        elif have.kind == "R" and want.kind == "S":
            ways = self.ways(want.axes)
            if not isinstance(t.shape[-1], int) or t.shape[-1] % ways:
                raise ShardError(f"`{ref.name}` has {t.shape[-1]} columns, which do not split {ways} ways")
            part = TensorType(t.dtype, (*t.shape[:-1], t.shape[-1] // ways))
            mine = f"{ref.name}__mine"
            if mine in types:  # sliced over other axes too (every convert records what it emitted)
                mine = f"{mine}_{'_'.join(want.axes)}"
            name, t = self.emit(pre, at, TAKE_MINE, name, t, mine, part, axes=want.axes, ways=ways)
        else:
            raise ShardError(
                f"operand {i + 1} (`{ref.name}`) is {have} but this op needs it {want}",
                "split the tensors that meet in this op alike, or leave them whole",
            )
        converted[key] = name
        for n in pre:
            for v in n.outputs:
                types[v.name] = v.type
        return Ref("value", name)

    def emit(self, pre: list[Node], at, op: str, src: str, t, name: str, out_t, **attrs):
        span = at.span
        pre.append(
            Node(
                op,
                (Ref("value", src),),
                tuple(attrs.items()),
                (Value(name, out_t, span),),
                (),
                span,
                getattr(at, "block", ""),
            )
        )
        return name, out_t

    def tensor_axes(self, ref: Ref) -> tuple[tuple[str, ...], ...]:
        return self.tensors[ref.name].sharding if ref.kind == "tensor" else ()


# ---------------------------------------------------------------------- rules
# rule(sharder, node, operand places) -> (needed places by operand index, output places, attr updates)


def _rule_whole(s: _Sharder, node: Node, places):
    for r in node.inputs:
        if r.kind == "tensor" and any(s.tensors[r.name].sharding):
            raise ShardError(f"`{r.name}` is split over the mesh, but this op needs it whole", "leave it unsplit")
    return {i: WHOLE for i in range(len(places))}, [WHOLE] * OPS[node.op].outputs, {}


def _common_split(places, partial_ok: bool) -> Place:
    """The placement shared by all operands (partial sums only where they may be added as they
    are), else WHOLE: everything is gathered or summed first."""
    kinds = set(places)
    if len(kinds) == 1:
        (p,) = kinds
        if p.kind == "S" or (p.kind == "P" and partial_ok):
            return p
    return WHOLE


def _rule_elementwise(s: _Sharder, node: Node, places, partial_ok: bool = False):
    target = _common_split(places, partial_ok=partial_ok)
    for i, r in enumerate(node.inputs):
        if r.kind == "tensor" and places[i] != target:
            raise ShardError(f"`{r.name}` is {places[i]} but the other operands are {target}")
    return {i: target for i in range(len(places))}, [target], {}


def _rule_broadcast(s: _Sharder, node: Node, places, partial_ok: bool = False):
    """Broadcasting arithmetic: the full-width operands split alike (a split `[N]` weight sets the
    split, a whole value is cut to it); a per-row `[B, 1]` operand whole (it has one column)."""
    width = node.outputs[0].type.shape[-1]
    shapes = [s.operand(r, s.types).type.shape for r in node.inputs]
    rows = {i for i, sh in enumerate(shapes) if len(sh) == 2 and sh[-1] == 1 and width != 1}
    cols = [i for i in range(len(places)) if i not in rows]
    split = [places[i] for i in cols if node.inputs[i].kind == "tensor" and places[i].kind == "S"]
    target = split[0] if split else _common_split([places[i] for i in cols], partial_ok and not rows)
    for i in cols:
        if node.inputs[i].kind == "tensor" and places[i] != target:
            raise ShardError(f"`{node.inputs[i].name}` is {places[i]} but the other operands are {target}")
    return {i: target for i in cols} | {i: WHOLE for i in rows}, [target], {}


def _rule_row_sum(s: _Sharder, node: Node, places):
    """A row sum of a split value is a partial sum over the same axes; partial stays partial."""
    x = places[0]
    out = Place("P", x.axes) if x.kind in ("S", "P") else WHOLE
    return {0: x}, [out], {}


def _per_head(s: _Sharder, node: Node, x: Place, heads_attr: str = "heads"):
    """Local head count when x is split over whole heads; None when x must be gathered."""
    heads = node.attr.get(heads_attr, 1)
    if x.kind != "S" or not isinstance(heads, int) or heads % s.ways(x.axes):
        return None
    return heads // s.ways(x.axes)


def _rule_norm(s: _Sharder, node: Node, places):
    x = places[0]
    split_rows = OPS[node.op].row_split
    if x.kind == "S" and split_rows and places[1:2] in ([x], []) and (nodes := split_rows(node)):
        raise Rewrite(nodes)  # a whole-row norm of a row split like its weight (or weightless)
    local = _per_head(s, node, x)
    if local is None or node.attr.get("heads", 1) == 1:
        return _rule_whole(s, node, places)
    need = {0: x} | {i: WHOLE for i in range(1, len(places))}
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if w is not None and w.kind == "tensor" and _full_width(s, w.name, places[1]) == node.outputs[0].type.shape[1]:
        if places[1] != x:  # a weight per channel of the row (Mamba2's grouped norm): split like x
            raise ShardError(f"`{w.name}` (one weight per channel) must be split like `{node.inputs[0].name}`")
        need[1] = x
    return need, [x], {"heads": local}


def _full_width(s: _Sharder, name: str, place) -> int:
    """A declared vector's whole length (the sharder holds each device's part)."""
    return s.tensors[name].type.shape[0] * (s.ways(place.axes) if place.kind == "S" else 1)


def _rule_same_split(s: _Sharder, node: Node, places, heads: bool):
    """Channel-wise ops (short_conv, kda_gate, recurrent, rope): every operand split the same way."""
    target = places[0]
    if target.kind != "S":
        return _rule_whole(s, node, places)
    need = {}
    for i, r in enumerate(node.inputs):
        if r.kind == "input":
            need[i] = places[i]
            continue
        if r.kind == "tensor" and not s.tensors[r.name].type.dtype.float:  # positions or ids: whole
            need[i] = WHOLE
            continue
        if r.kind == "tensor":
            t = s.tensors[r.name]
            split = next((axes for axes in t.sharding if axes), ())
            if split != target.axes:
                raise ShardError(
                    f"`{r.name}` must be split over {', '.join(target.axes)} like `{node.inputs[0].name}`, "
                    f"but it is {'split over ' + ', '.join(split) if split else 'whole'}"
                )
            need[i] = places[i]
        else:
            need[i] = target
    attrs = {}
    if heads:
        local = _per_head(s, node, target)
        if local is None:
            raise ShardError(f"{node.attr.get('heads')} heads do not split {s.ways(target.axes)} ways")
        attrs["heads"] = local
    return need, [target] * OPS[node.op].outputs, attrs


def _rule_linear(s: _Sharder, node: Node, places):
    k_axes, n_axes = s.tensor_axes(node.arg("weight"))
    if node.attr.get("transposed"):  # the weight is stored [N, K] (a tied output head)
        k_axes, n_axes = n_axes, k_axes
    w = node.arg("weight").name
    if not k_axes:
        return {0: WHOLE}, [Place("S", n_axes) if n_axes else WHOLE], {}
    if n_axes:
        raise ShardError(f"`{w}` is split along both dimensions; split its rows or its columns")
    return {0: Place("S", k_axes)}, [Place("P", k_axes)], {}  # row-parallel: partial sums


def _rule_embedding(s: _Sharder, node: Node, places):
    v_axes, h_axes = s.tensor_axes(node.arg("table"))
    if h_axes:
        raise ShardError(f"`{node.arg('table').name}` may be split by vocabulary rows only")
    if not v_axes:
        return {0: WHOLE}, [WHOLE], {}
    return {0: WHOLE}, [Place("P", v_axes)], {"shard_axes": v_axes}


def _rule_argmax(s: _Sharder, node: Node, places):
    x = places[0]
    if x.kind == "S":
        return {0: x}, [WHOLE], {"shard_axes": x.axes}
    return {0: WHOLE}, [WHOLE], {}


def _rule_compact(s: _Sharder, node: Node, places):
    x = places[0]
    return {0: x}, [x], {}


def _rule_replicated_kv(s: _Sharder, node: Node, places):
    """KV heads a mesh axis does not divide: the caches, k and v stay whole on every device, and
    each device reads the one KV head its (fewer) query heads share (`kv_axes` for the lowering)."""
    q = places[0]
    kv, ways = node.attr.get("kv_heads", 1), s.ways(q.axes)
    local = _per_head(s, node, q)
    if local is None:
        raise ShardError(f"{node.attr.get('heads')} heads do not split {ways} ways")
    if (node.attr["heads"] // kv) % local:
        raise ShardError(f"{kv} KV heads do not split {ways} ways, and a device's {local} query heads span several")
    for i in (1, 2, 3, 4):
        r = node.inputs[i]
        if r.kind == "tensor" and any(s.tensor_axes(r)):
            raise ShardError(f"{kv} KV heads do not split {ways} ways: leave `{r.name}` whole (replicated)")
    need = {0: q, 1: WHOLE, 2: WHOLE, 3: places[3], 4: places[4], 5: places[5]}
    if len(places) > 6:  # sinks: one per query head, split like q
        if s.tensor_axes(node.inputs[6])[0] != q.axes:
            raise ShardError(f"`{node.inputs[6].name}` must be split over {', '.join(q.axes)} like the query heads")
        need[6] = places[6]
    return need, [q], {"heads": local, "kv_axes": q.axes}


def _rule_attention(s: _Sharder, node: Node, places):
    q = places[0]
    if q.kind == "S" and node.attr.get("kv_heads", 1) % s.ways(q.axes):
        return _rule_replicated_kv(s, node, places)
    need, outs, attrs = _rule_same_split(s, node, places, heads=True)
    if places[0].kind == "S":
        kv = node.attr.get("kv_heads", 1)
        ways = s.ways(places[0].axes)
        if kv % ways:
            raise ShardError(f"{kv} KV heads do not split {ways} ways")
        attrs["kv_heads"] = kv // ways
    return need, outs, attrs


def _rule_block_heads(s: _Sharder, node: Node, places):
    """`block_attention`: query and KV heads split alike (as many KV heads as devices at least: a
    spec repeats them), the slot caches split by KV head; positions and slot positions whole."""
    q = places[0]
    if q.kind != "S":
        return _rule_whole(s, node, places)
    ways = s.ways(q.axes)
    if node.attr.get("kv_heads", 1) % ways or _per_head(s, node, q) is None:
        raise ShardError(
            f"{node.attr.get('heads')} query and {node.attr.get('kv_heads')} KV heads do not both split {ways} ways",
            "store each KV head repeated (the same model) so that every device holds one",
        )
    need, _, _ = _rule_same_split(s, node, places, heads=True)
    attrs = {"heads": node.attr["heads"] // ways, "kv_heads": node.attr["kv_heads"] // ways}
    return need, [q], attrs


def _rule_markov(s: _Sharder, node: Node, places):
    """`markov_argmax`: logits split by vocabulary with `w2`'s rows; `w1` whole for the lookup of the
    previous token; the devices combine each row's best before the next row (`shard_axes`)."""
    x = places[0]
    v_axes, _ = s.tensor_axes(node.inputs[3])
    if any(s.tensor_axes(node.inputs[2])):
        raise ShardError(f"`{node.inputs[2].name}` is read by the previous token: leave it whole")
    if x.kind != "S" or not v_axes:
        return _rule_whole(s, node, places)
    if v_axes != x.axes:
        raise ShardError(
            f"`{node.inputs[3].name}` must be split by vocabulary rows like the logits ({', '.join(x.axes)})"
        )
    return {0: x, 1: WHOLE, 2: WHOLE, 3: places[3]}, [WHOLE], {"shard_axes": x.axes}


def _rule_key_heads(s: _Sharder, node: Node, places):
    """`recurrent`: value heads split with their key heads (q, k by key head, v by value head).
    The split comes from the first split one of q, k and v. Key heads fewer than the devices (or
    not splitting like the value heads) are replicated: q and k whole on every device, whose value
    heads must then all read one key head (`key_axes` for the lowering and the reference)."""
    split = next((p for p in places[:3] if p.kind == "S"), None)
    if split is None:
        return _rule_whole(s, node, places)
    ways = s.ways(split.axes)
    heads = node.attr.get("heads", 1)
    kh = node.attr.get("key_heads") or heads
    if kh % ways:
        return _rule_replicated_keys(s, node, places, kh)
    need, outs, attrs = _rule_same_split(s, node, [split, *places[1:]], heads=True)
    if node.attr.get("key_heads") is not None:
        attrs["key_heads"] = kh // ways
    return need, outs, attrs


def _rule_replicated_keys(s: _Sharder, node: Node, places, kh: int):
    """Key heads that do not split: q, k whole, v, the state, g and beta split by value heads."""
    v = places[2]
    if v.kind != "S":
        raise ShardError(
            f"{kh} key heads do not split {s.ways(places[0].axes)} ways",
            "split the v projection (and the state) by whole value heads; q and k then stay whole",
        )
    ways, heads = s.ways(v.axes), node.attr.get("heads", 1)
    local = _per_head(s, node, v)
    if local is None:
        raise ShardError(f"{heads} heads do not split {ways} ways")
    if (heads // kh) % local:
        raise ShardError(f"{kh} key heads do not split {ways} ways, and a device's {local} value heads span several")
    for i in (0, 1):
        r = node.inputs[i]
        if r.kind == "tensor" and any(s.tensor_axes(r)):
            raise ShardError(f"{kh} key heads do not split {ways} ways: leave `{r.name}` whole (replicated)")
    need, outs, attrs = _rule_same_split(s, node, [v, v, *places[2:]], heads=True)
    need[0] = need[1] = WHOLE
    return need, outs, attrs | {"key_heads": kh, "key_axes": v.axes}


def _rule_mla(s: _Sharder, node: Node, places):
    q = places[0]
    w_axes = s.tensor_axes(node.arg("w_kvb"))
    cache_axes = s.tensor_axes(node.arg("cache"))
    if any(cache_axes):
        raise ShardError("the latent cache is shared by all heads: leave it whole on every device")
    if q.kind != "S":
        if any(w_axes):
            raise ShardError(f"`{node.arg('w_kvb').name}` is split but the queries are whole")
        return _rule_whole(s, node, places)
    if w_axes[0] or w_axes[1] != q.axes:
        raise ShardError(f"`{node.arg('w_kvb').name}` must be split by columns (heads) over {', '.join(q.axes)}")
    local = _per_head(s, node, q)
    if local is None:
        raise ShardError(f"{node.attr['heads']} heads do not split {s.ways(q.axes)} ways")
    need = {0: q, 1: WHOLE, 2: WHOLE, 3: places[3], 4: places[4], 5: places[5]}
    return need, [q], {"heads": local}


def _rule_moe(s: _Sharder, node: Node, places):
    w1, w3, w2 = (s.tensor_axes(node.arg(w)) for w in ("w1", "w3", "w2"))
    e_axes, in_axes, f_axes = w1
    if w3 != w1 or w2 != (e_axes, f_axes, in_axes) or in_axes:
        raise ShardError(
            "split the experts' weights alike: w1 and w3 as [E @experts, D, F @columns], w2 as [E @experts, F @columns, D]"
        )
    need = {i: WHOLE for i in range(3)}
    if not e_axes and not f_axes:
        return need, [WHOLE], {}
    total = s.m.tensor(node.arg("w1").name).type.shape[0]
    return need, [Place("P", s.sorted_axes(e_axes + f_axes))], {"expert_axes": e_axes, "experts_total": total}


# Rule families, named by `OpDef.shard`: the pass asks the op which one applies.
RULES = {
    "elementwise": _rule_elementwise,
    "sum": lambda s, n, p: _rule_elementwise(s, n, p, partial_ok=True),  # may add partial sums as they are
    "broadcast": _rule_broadcast,
    "broadcast_sum": lambda s, n, p: _rule_broadcast(s, n, p, partial_ok=True),  # add, sub: partials as they are
    "row_sum": _rule_row_sum,
    "whole": _rule_whole,
    "norm": _rule_norm,
    "channels": lambda s, n, p: _rule_same_split(s, n, p, heads=False),
    "heads": lambda s, n, p: _rule_same_split(s, n, p, heads=True),
    "kv_heads": _rule_attention,
    "key_heads": _rule_key_heads,
    "block_heads": _rule_block_heads,
    "markov": _rule_markov,
    "latent_attention": _rule_mla,
    "matmul": _rule_linear,
    "vocab_rows": _rule_embedding,
    "pick": _rule_argmax,
    "any": _rule_compact,
    "experts": _rule_moe,
}
