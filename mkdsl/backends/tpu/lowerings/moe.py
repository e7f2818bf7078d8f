"""`route` and `moe_experts`, lowered together onto one `MoE` runtime object (part `moe`).

`route` picks the experts and starts their first tile DMAs at once (`prefetch`), so they load
while the rest of the layer runs; `moe_experts` streams the chosen experts' MXFP4, int4, fp8 or bf16 tiles
through its own tile sets, applying the spec's activation block (composed from its ops'
`kernel_expr`s into one lambda). Ids from another op (`topk`, `group_topk`) are staged to SMEM
by `moe_experts` itself. Both ops' lowering-time checks live here."""

from __future__ import annotations

import math

from mkdsl.backends.tpu.lowering import (
    EmitContext,
    Lowering,
    PlanContext,
    Site,
    Traffic,
    register_lowering,
)
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import BlockAttr, Graph, Model, Node
from mkdsl.ops import OPS
from mkdsl.ops.moe import expected_experts

EXPERT_TILE = 256  # expert columns per tile set (1.5 MB per set at K3 size: big DMAs, 5.7 MiB for 4 sets)
EXPERT_SLOTS = 4  # tile sets in flight (the DMA engine round-robins: 4 beat 3, 5, 6 and 8 on TPU7x)
MOE = ("runtime/decode.py.jinja", "runtime/moe.py.jinja")
WEIGHTS = ("w1", "w3", "w2")
BIASES = ("b1", "b3", "b2")
FORMATS = ("mxfp4", "bf16", "fp8_block", "int4", "group")  # expert weight formats the runtime decodes
PIECES = {
    "mxfp4": ("w1c", "w1s", "w3c", "w3s", "w2c", "w2s"),
    "fp8_block": ("w1c", "w1s", "w3c", "w3s", "w2c", "w2s"),
    "int4": ("w1c", "w1s", "w3c", "w3s", "w2c", "w2s"),
    "group": ("w1c", "w1s", "w3c", "w3s", "w2c", "w2s"),
    "bf16": ("w1", "w3", "w2"),
}
FP8_BLOCK = 128  # the block side of block-scaled fp8 experts (DeepSeek-V3's)


def expert_format(model: Model, node: Node) -> str | None:
    """The one format of the three expert weights (None if they differ): mxfp4, bf16,
    fp8_block (fp8 with 128 x 128 block scales), int4, or group (int8 or fp8 with group scales);
    the last two with one group size for all three (`expert_group`). Others: their dtype."""
    names = set()
    for w in WEIGHTS:
        dt = model.tensor(node.arg(w).name).type.dtype
        names.add("fp8_block" if dt.block == FP8_BLOCK and dt.name.startswith("fp8") else str(dt))
    name = names.pop() if len(names) == 1 else None
    if name is not None and name.startswith("int4("):
        return "int4" if "scale=" not in name else name  # f32-scaled int4 experts are not decoded here
    return "group" if name is not None and name.endswith(")") and "(group=" in name else name


def expert_group(model: Model, node: Node) -> int:
    """K rows per scale row of a group-scaled expert format (mxfp4: 32; int4, int8, fp8: the group)."""
    dt = model.tensor(node.arg("w1").name).type.dtype
    return 32 if dt.name == "mxfp4" else dt.group


def biases(node: Node) -> dict[str, str]:
    """The bias operands the node has: b1/b3/b2 -> tensor name."""
    return {b: node.inputs[6 + i].name for i, b in enumerate(BIASES) if 6 + i < len(node.inputs)}


def act_lambda(block: BlockAttr) -> str:
    """The activation block as one kernel lambda over f32 (g, u): each op's `kernel_expr`, its
    result bound to a local name (walrus), the last one returned."""
    g = block.graph
    names = {p.name: f"a{i}" for i, p in enumerate(g.params)}
    steps = []
    for j, n in enumerate(g.nodes):
        op = OPS[n.op]
        operands = {o: names[r.name] for o, r in zip(op.operands, n.inputs, strict=True)}
        consts = {k: repr(float(v)) if isinstance(v, float) else repr(v) for k, v in n.attrs}  # constants only
        expr = op.kernel_expr.format(**operands, **consts)
        names[n.outputs[0].name] = f"t{j}"
        steps.append(f"(t{j} := {expr})")
    result = names[g.results[0].name]
    params = ", ".join(names[p.name] for p in g.params)
    return f"lambda {params}: ({', '.join(steps)}, {result})[-1]" if steps else f"lambda {params}: {result}"


def padded_widths(d: int, f: int) -> tuple[int, int]:
    """(latent, expert) widths as the kernel stores the experts: the expert width `f` in whole
    128-lane tiles, the latent width `d` in whole decode chunks (`latent_chunk`), so every tile
    DMA and decode chunk is tile-aligned. The extra rows and columns are zeros."""
    fp = -(-f // 128) * 128
    chunk = latent_chunk(fp)
    return (256 if d <= 256 else 512 if d <= 512 else -(-d // chunk) * chunk), fp


def latent_chunk(fp: int) -> int:
    """Latent rows decoded at a time: 512 beside 256-column tiles, 1024 beside 128-column ones
    (the same decoded bf16 chunk; an MXFP4 chunk's scale rows then start on a whole [32, 128]
    uint8 tile, which libtpu needs to prove for a narrow tile's loads)."""
    return 512 if fp % 256 == 0 else 1024


def expert_dims(model: Model, node: Node) -> tuple[int, int, int, int, int]:
    """(experts, latent width, expert width, padded latent, padded expert width) per device."""
    e, d, f = model.tensor(node.arg("w1").name).type.shape
    return (e, d, f, *padded_widths(d, f))


def moe_tiling(model: Model, node: Node) -> tuple[int | None, int, list[str]]:
    """(columns per expert tile, tile sets in flight, what prevents lowering) of a moe_experts node."""
    _, _, _, _, fp = expert_dims(model, node)
    h = model.hint("expert_slots")
    slots = EXPERT_SLOTS if h is None else h.value
    tn = next(t for t in (EXPERT_TILE, 256, 128) if fp % t == 0)
    problems = []
    fmt = expert_format(model, node)
    if fmt not in FORMATS:
        problems.append(
            "the three expert weights must all be mxfp4, bf16, fp8 with block=128 scales, "
            "or int4, int8 or fp8 with one group=G"
        )
    elif fmt == "int4":
        problems += _int4_problems(model, node, tn)
    elif fmt == "group":
        problems += _group_problems(model, node, tn)
    if slots < 2:
        problems.append(f"expert_slots must be at least 2, got {slots}")
    return (None if problems else tn), slots, problems


def _int4_problems(model: Model, node: Node, tn: int) -> list[str]:
    """An int4 group must tile an expert tile's rows and a decode chunk's, and a chunk's scale
    rows must start on a whole bf16 [16, 128] tile unless one chunk covers the latent width."""
    _, _, _, dp, fp = expert_dims(model, node)
    g, kc = expert_group(model, node), min(dp, latent_chunk(fp))
    if tn % g or kc % g:
        return [f"an int4 expert group must divide {tn} and {kc} (the expert tile's and decode chunk's rows), got {g}"]
    if kc < dp and (kc // g) % 16:
        return [
            f"int4 experts of latent width {dp} are decoded {kc} rows at a time: the group must divide {kc // 16}, got {g}"
        ]
    return []


def _group_problems(model: Model, node: Node, tn: int) -> list[str]:
    """An int8/fp8 group: whole 32-row slabs of 8-bit codes, and slabs that tile (or are tiled
    by) the expert tile's rows and a decode chunk's, over the padded widths."""
    _, _, _, dp, fp = expert_dims(model, node)
    g, kc = expert_group(model, node), min(dp, latent_chunk(fp))
    fits = dp % g == 0 and fp % g == 0 and all(max(r, g) % min(r, g) == 0 for r in (kc, tn))
    if g % 32 or not fits:
        return [
            f"an int8/fp8 expert group must be a multiple of 32 that divides {dp} and {fp} (the padded widths) "
            f"and divides or is a multiple of {kc} and {tn} (a decode chunk's and an expert tile's rows), got {g}"
        ]
    return []


def _router(g: Graph, experts: Node) -> Node | None:
    ids = experts.arg("ids")
    return next((n for n in g.nodes if n.op == "route" and n.outputs[1].name == ids.name), None)


def _experts_of(g: Graph, route: Node) -> list[tuple[int, Node]]:
    ids = route.outputs[1].name
    return [(i, n) for i, n in enumerate(g.nodes) if n.op == "moe_experts" and n.arg("ids").name == ids]


def _check_experts(model: Model, at: Site) -> list[Diagnostic]:
    _, _, problems = moe_tiling(model, at.node)
    return [Diagnostic(at.node.span, "moe_experts cannot be lowered: " + "; ".join(problems))] if problems else []


def _pads(model: Model, at: Site) -> dict[str, dict[int, int]]:
    """The expert arrays stored at the padded widths (`padded_widths`), zeros beyond the valid ones."""
    node = at.node
    _, d, f, dp, fp = expert_dims(model, node)
    widths = {"w1": (dp, fp), "w3": (dp, fp), "w2": (fp, dp), "b1": (fp,), "b3": (fp,), "b2": (dp,)}
    valid = {"w1": (d, f), "w3": (d, f), "w2": (f, d), "b1": (f,), "b3": (f,), "b2": (d,)}
    names = {w: node.arg(w).name for w in WEIGHTS} | biases(node)
    out = {}
    for key, name in names.items():
        axes = {i - len(valid[key]): p for i, (p, v) in enumerate(zip(widths[key], valid[key], strict=True)) if p != v}
        if axes:
            out[name] = axes
    return out


def _check_route(model: Model, at: Site) -> list[Diagnostic]:
    ids = at.node.outputs[1].name
    g = at.graph
    users = _experts_of(g, at.node)
    if len(users) != 1 or any(r.name == ids for n in g.nodes if n.op != "moe_experts" for r in n.inputs):
        return [
            Diagnostic(
                at.node.span,
                "the kernel lowers `route` together with the one "
                "`moe_experts` that uses its ids; here they are used elsewhere too",
            )
        ]
    return []


def _scratch(s: PlanContext, at: Site) -> dict:
    node = at.node
    experts, d_valid, _, d, f = expert_dims(s.model, node)  # the tiles hold the padded widths
    k = s.type_of(at.graph, node.arg("ids")).shape[1]  # ids are [B, k]
    tn, slots, _ = moe_tiling(s.model, node)
    if tn is None:
        return {}
    tiles = (slots,)
    fmt = expert_format(s.model, node)
    if fmt == "bf16":
        parts = {
            "w1": ((*tiles, d, tn), "bfloat16", f"expert W1 tiles ({slots} tile sets)", "VMEM"),
            "w3": ((*tiles, d, tn), "bfloat16", "expert W3 tiles", "VMEM"),
            "w2": ((*tiles, tn, d), "bfloat16", "expert W2 tiles", "VMEM"),
        }
    elif fmt == "group":
        code, g = s.model.tensor(node.arg("w1").name).type.dtype.numpy, expert_group(s.model, node)
        parts = {
            "w1c": ((*tiles, d, tn), code, f"expert W1 codes ({slots} tile sets)", "VMEM"),
            "w1s": ((*tiles, d // g, tn), "float32", "expert W1 scales", "VMEM"),
            "w3c": ((*tiles, d, tn), code, "expert W3 codes", "VMEM"),
            "w3s": ((*tiles, d // g, tn), "float32", "expert W3 scales", "VMEM"),
            "w2c": ((*tiles, tn, d), code, "expert W2 codes", "VMEM"),
            "w2s": ((*tiles, max(tn // g, 1), d), "float32", "expert W2 scales", "VMEM"),
        }
    elif fmt == "fp8_block":
        code = s.model.tensor(node.arg("w1").name).type.dtype.numpy
        b = FP8_BLOCK
        parts = {
            "w1c": ((*tiles, d, tn), code, f"expert W1 codes ({slots} tile sets)", "VMEM"),
            # an expert's whole scale blocks: a column tile's [d/b, tn/b] slice of them is a strided
            # DMA Mosaic refuses ("leading tiles have different trailing dimensions")
            "w1s": ((*tiles, d // b, f // b), "float32", "expert W1 block scales (whole expert)", "SMEM"),
            "w3c": ((*tiles, d, tn), code, "expert W3 codes", "VMEM"),
            "w3s": ((*tiles, d // b, f // b), "float32", "expert W3 block scales (whole expert)", "SMEM"),
            "w2c": ((*tiles, tn, d), code, "expert W2 codes", "VMEM"),
            "w2s": ((*tiles, f // b, d // b), "float32", "expert W2 block scales (whole expert)", "SMEM"),
        }
    else:  # packed nibbles: mxfp4 (uint8 E8M0 scales per 32 rows) or int4 (bf16 scales per group)
        g, sd = expert_group(s.model, node), "uint8" if fmt == "mxfp4" else "bfloat16"
        parts = {
            "w1c": ((*tiles, d // 8, tn), "uint32", f"expert W1 codes ({slots} tile sets)", "VMEM"),
            "w1s": ((*tiles, d // g, tn), sd, "expert W1 scales", "VMEM"),
            "w3c": ((*tiles, d // 8, tn), "uint32", "expert W3 codes", "VMEM"),
            "w3s": ((*tiles, d // g, tn), sd, "expert W3 scales", "VMEM"),
            "w2c": ((*tiles, tn // 8, d), "uint32", "expert W2 codes", "VMEM"),
            "w2s": ((*tiles, tn // g, d), sd, "expert W2 scales", "VMEM"),
        }
    if d_valid < d:
        parts["acc"] = (("rows", d), "float32", "expert sum at the padded latent width", "VMEM")
    return parts | {
        "sem": ((len(PIECES[fmt]), slots), "dma", "expert tile semaphores", "SEM"),
        "zb": (("rows", d), "bfloat16", "latent input (bf16)", "VMEM"),
        "ids_stage": (("rows", 128), "int32", "routed ids, lane-dense for the copy to SMEM", "VMEM"),
        "ids_smem": (("rows", 128), "int32", "routed ids", "SMEM"),
        "id_sem": ((1,), "dma", "ids copy semaphore", "SEM"),
        "list": (("batch * " + str(k),), "int32", "distinct experts of this step", "SMEM"),
        "count": ((1,), "int32", "distinct expert count", "SMEM"),
        "pos": ((experts,), "int32", "distinct-set positions", "SMEM"),
    }


def _traffic(s: PlanContext, at: Site) -> Traffic:
    """The expected distinct experts chosen (as the op's cost counts them, rounded up), in tile
    sets of one DMA per piece."""
    node = at.node
    e, d, f, dp, fp = expert_dims(s.model, node)
    total_e = node.attr.get("experts_total", e)
    k = s.type_of(at.graph, node.arg("ids")).shape[1]  # ids are [B, k]
    experts = math.ceil(expected_experts(s.batch, k, e, total_e))
    tn, _, _ = moe_tiling(s.model, node)
    pieces = len(PIECES.get(expert_format(s.model, node), PIECES["mxfp4"]))
    moved = s.cost(at).weight_bytes * dp * fp // (d * f)  # the padded tiles move whole
    return Traffic(moved, pieces * experts * (fp // (tn or 128)) + 1)


def _moe_object(em: EmitContext, g: Graph, idx: int, node: Node) -> str:
    """The MoE object of a moe_experts node, built once at kernel entry."""
    sc = em.scratch_of(Site(g, idx, node))
    obj = f"{sc.prefix}_{g.name}_{idx}"
    built = em.shared.setdefault("moe_objects", set())
    if obj in built:
        return obj
    built.add(obj)
    w1, w3, w2 = (node.arg(w).name for w in WEIGHTS)
    e, d_valid, f_valid, d, f = expert_dims(em.m, node)
    k = em.value_width(g, node.arg("ids"))
    tn, slots, _ = moe_tiling(em.m, node)  # as the planner sized the tile sets
    fmt = expert_format(em.m, node)
    if fmt == "bf16":
        names = {key: w for key, w in zip(WEIGHTS, (w1, w3, w2), strict=True)}  # unquantised: one array each
    else:
        names = {
            f"{key}{part[0]}": f"{w}_{part}"
            for key, w in zip(WEIGHTS, (w1, w3, w2), strict=True)
            for part in ("codes", "scales")
        }
    names |= {key: f"f_{b}" for key, b in biases(node).items()}
    router = _router(g, node)
    expert_axes = node.attr.get("expert_axes", ())
    extra = ""
    if expert_axes:
        e_route = em.value_width(g, router.arg("scores")) if router is not None else node.attr["experts_total"]
        extra = f", E_route={e_route}, lo={em.group_index(expert_axes)} * {e}"
    f_axes = em.m.tensor(w1).sharding[2]
    if "b2" in names and f_axes:
        extra += f", b2_here={em.group_index(f_axes)} == 0"
    fmt_arg = "" if fmt == "mxfp4" else f", fmt={fmt!r}"
    if fmt in ("int4", "group"):
        fmt_arg += f", group={expert_group(em.m, node)}"
    if (d_valid, f_valid) != (d, f):
        extra += f", Dv={d_valid}, Fv={f_valid}"
    if min(d, latent_chunk(f)) != min(d, 512):
        extra += f", kc={latent_chunk(f)}"
    if node.attr.get("weigh") == "input":
        extra += ", on_input=True"
    em.objects.append(
        f"{obj} = MoE(r, rows=rows, batch=batch, E={e}, k={k}, D={d}, F={f}, tn={tn}, slots={slots}, "
        f"names={names!r}, prefix={sc.prefix + '_'!r}, act={act_lambda(node.attr['act'])}{fmt_arg}{extra})"
    )
    return obj


def _route_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    idx, experts = _experts_of(at.graph, at.node)[0]
    return dict(
        obj=_moe_object(em, at.graph, idx, experts),
        scores=ins[0],
        bias=em.fetched(at.node.arg("bias").name, pre),
        slot=_slots(em, experts),
    )


def _slots(em: EmitContext, node: Node) -> str:
    """The layer slice the experts' tiles are read at: one expression, or (w1's, w3's, w2's)
    where the three are stacked over different layers; None for an unstacked weight."""
    tensors = [em.m.tensor(node.arg(w).name) for w in WEIGHTS]
    slots = [em.slot_expr(t.name, em.layer_var) if t.stacked else "None" for t in tensors]
    return slots[0] if len(set(slots)) == 1 else f"({', '.join(slots)})"


def _experts_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    for b in biases(at.node).values():
        em.fetched(b, pre)  # waits for the layer's bias fetch
    routed = _router(at.graph, at.node) is not None
    return dict(
        obj=_moe_object(em, at.graph, at.index, at.node),
        slot=_slots(em, at.node),
        z=ins[0],
        weights=ins[1],
        ids=None if routed else ins[2],
    )


T = "lowerings/moe.jinja"
register_lowering(Lowering("route", T, "route", _route_record, check=_check_route, runtime=MOE))
register_lowering(
    Lowering(
        "moe_experts",
        T,
        "moe_experts",
        _experts_record,
        check=_check_experts,
        scratch=_scratch,
        scratch_base="experts",
        synchronous=True,
        traffic=_traffic,
        runtime=MOE,
        pads=_pads,
    )
)
