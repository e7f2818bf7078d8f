"""Buffer assignment: which VMEM buffer holds each IR value.

Values of one width and dtype share physical buffers once their last use has passed, and the
layer kinds share one pool (only one kind runs at a time). A layer's parameters live in the
carry buffers; a step value that is still needed after the layer stack gets its own buffer.
"""

from __future__ import annotations

from mkdsl.lang.ir import Graph, Model, Ref
from mkdsl.ops import OPS

# Ops whose lowering may write an output into the buffer of an input it has finished reading:


def carry_of(g: Graph, name: str) -> str | None:
    for i, p in enumerate(g.params):
        if p.name == name:
            return f"carry{i}"
    layers = next((n for n in g.nodes if n.op == "layers"), None)
    if layers is not None:
        for i, v in enumerate(layers.outputs):
            if v.name == name:
                return f"carry{i}"
    return None


def _last_uses(g: Graph) -> dict[str, int]:
    last: dict[str, int] = {}
    for i, node in enumerate(g.nodes):
        for r in node.inputs:
            if r.kind == "value":
                last[r.name] = i
    for r in g.results:
        if r.kind == "value":
            last[r.name] = len(g.nodes)  # results are read after the last node
    return last


def _class(v) -> tuple[int, str, int | str]:
    """(width, dtype, rows) of a value's buffer."""
    if len(v.type.shape) == 2:
        return v.type.shape[1], "float32" if v.type.dtype.float else "int32", "rows"
    if v.type.dtype.float:
        return v.type.shape[0], "float32", 1  # a vector computed from [N] weights (exp(a_log)): one row
    return 1, "int32", "rows"  # a per-row scalar (token ids)


def assign_buffers(
    model: Model, fixed: dict[str, str]
) -> tuple[dict[tuple[str, str], str], dict[str, tuple[int, str]]]:
    """((graph, value) -> buffer name, buffer name -> (width, dtype, rows)). `fixed` maps step values
    to buffers the kernel already has (its outputs)."""
    where: dict[tuple[str, str], str] = {("step", v): name for v, name in fixed.items()}
    pool: dict[tuple[int, str, int | str], list[str]] = {}
    shapes: dict[str, tuple[int, str, int | str]] = {}

    def new_buffer(cls) -> str:
        name = f"v{len(shapes)}_{cls[0]}" + ("" if cls[2] == "rows" else "_vec")
        shapes[name] = cls
        pool.setdefault(cls, []).append(name)
        return name

    for g in (*model.kinds, model.step):
        free = {cls: list(names) for cls, names in pool.items()}
        last = _last_uses(g)
        results = {r.name for r in g.results}
        cut = next((i for i, n in enumerate(g.nodes) if n.op == "layers"), None)
        for i, node in enumerate(g.nodes):
            if node.op == "layers":
                free = {}  # the layer kinds use the whole pool
                continue
            for out_i, in_i in OPS[node.op].in_place:  # (output, operand) the op updates in place
                src = node.inputs[in_i]
                v = node.outputs[out_i]
                reads = sum(1 for r in node.inputs if r.name == src.name)
                if src.kind == "value" and last.get(src.name) == i and reads == 1 and src.name not in results:
                    where[(g.name, v.name)] = carry_of(g, src.name) or where[(g.name, src.name)]
            for v in node.outputs:
                if cut is not None and i < cut and last.get(v.name) == cut:
                    layers = g.nodes[cut]
                    slots = [k for k, r in enumerate(layers.inputs) if r.name == v.name]
                    if len(slots) == 1:  # only fed to the layer stack: build it in its carry buffer
                        where[(g.name, v.name)] = f"carry{slots[0]}"
                if carry_of(g, v.name) or (g.name, v.name) in where:
                    continue
                cls = _class(v)
                spans_layers = cut is not None and i < cut < last.get(v.name, i)
                if spans_layers:
                    name = f"{g.name}_{v.name}"
                    shapes[name] = cls
                else:
                    name = free.get(cls, []).pop() if free.get(cls) else new_buffer(cls)
                where[(g.name, v.name)] = name
            held = {where.get((g.name, v.name)) for v in node.outputs}  # in-place outputs keep their input's buffer
            for r in dict.fromkeys(
                r.name for r in node.inputs if r.kind == "value"
            ):  # ordered: output must not depend on hashing
                if last.get(r) == i and (g.name, r) in where and not carry_of(g, r):
                    name = where[(g.name, r)]
                    if name in pool.get(shapes.get(name), []) and name not in held:
                        free.setdefault(shapes[name], []).append(name)
            for v in node.outputs:  # a value nobody reads is free at once
                if v.name not in last and (g.name, v.name) in where:
                    name = where[(g.name, v.name)]
                    if name in pool.get(shapes.get(name), []):
                        free.setdefault(shapes[name], []).append(name)
    return where, shapes


def buffer_of(where: dict[tuple[str, str], str], g: Graph, ref: Ref) -> str:
    return carry_of(g, ref.name) or where[(g.name, ref.name)]
