"""Mixture of experts: bias-corrected top-k routing and the weighted sum of the chosen experts.

Expert weights are declared as one 3-D tensor per matrix, experts leading: w1/w3 [E, D, F],
w2 [E, F, D] (mxfp4, bf16, fp8, int4 or int8). A quantised one reaches the reference as a `QTensor` whose codes
and scales carry the same leading expert axis.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from mkdsl.lang.dtypes import F32, I32
from mkdsl.lang.ir import TensorType
from mkdsl.lang.quant import QTensor
from mkdsl.lazy import jnp
from mkdsl.ops.linear import weight_f32
from mkdsl.ops.prefill import device_index
from mkdsl.ops.registry import (
    REQUIRED,
    Cost,
    OpDef,
    OpError,
    expect_dtype,
    expect_float,
    expect_rank,
    nbytes,
    register,
)
from mkdsl.ops.select import topk


def apply_block(block, *arrays):
    from mkdsl.lang.block_attrs import apply_block as apply  # block_attrs imports the registry

    return apply(block, *arrays)


def _declared_weight(w, i: int, what: str) -> None:
    if w.kind != "tensor" or w.is_state:
        raise OpError(f"{what} must be a declared weight, not `{w.name}`", i)


def _route_infer(args, attrs):
    scores, bias = args
    expect_rank(scores, 2, 0, "the router scores")
    expect_float(scores, 0)
    _declared_weight(bias, 1, "the routing bias")
    expect_rank(bias, 1, 1, "the routing bias")
    expect_dtype(bias, ("f32", "bf16"), 1)
    e = scores.type.shape[1]
    if bias.type.shape[0] != e:
        raise OpError(
            f"routing bias `{bias.name}` has {bias.type.shape[0]} entries but `{scores.name}` scores {e} experts", 1
        )
    k = attrs["k"]
    if not isinstance(k, int) or k < 1 or (isinstance(e, int) and k > e):
        raise OpError(f"k must be an integer in 1..{e}, got {k}", "k")
    b = scores.type.shape[0]
    return TensorType(F32, (b, k)), TensorType(I32, (b, k))


def route(scores, bias, k):
    """ids: the top k of scores + bias per row (descending, ties to the lower index); weights:
    the chosen *unbiased* scores renormalised to sum to one. The bias only steers selection."""
    s = scores.astype(jnp.float32)
    _, ids = topk(s + bias.astype(jnp.float32), k)
    chosen = jnp.take_along_axis(s, ids, axis=-1)
    return chosen / jnp.sum(chosen, axis=-1, keepdims=True), ids


def _route_runner_up(row: int, margin: float, flipped: list):
    """A `route` reference that gives `row`'s last choice to the runner-up, once, where the two are
    closer than `margin` (a near tie that rounding may tip: mkdsl/verify/kernel.py); it appends to
    `flipped` when it did."""

    def routed(scores, bias, k):
        weights, ids = route(scores, bias, k)
        s = scores.astype(jnp.float32)
        key = np.asarray(s + bias.astype(jnp.float32))
        taken = np.zeros(key.shape, bool)
        np.put_along_axis(taken, np.asarray(ids), True, axis=-1)
        runner = np.argmax(np.where(taken, -np.inf, key), axis=-1)
        gap = key[row, np.asarray(ids)[row, -1]] - key[row, runner[row]]
        if flipped or gap >= margin:
            return weights, ids
        flipped.append(True)
        ids = ids.at[row, -1].set(int(runner[row]))
        chosen = jnp.take_along_axis(s, ids, axis=-1)
        return chosen / jnp.sum(chosen, axis=-1, keepdims=True), ids

    return routed


def _route_cost(ins, outs, attrs):
    scores, bias = ins
    b, e = scores.shape
    return Cost(weight_bytes=nbytes(bias), flops=b * e * (attrs["k"] + 1))


register(
    OpDef(
        "route",
        ("scores", "bias"),
        _route_infer,
        route,
        _route_cost,
        attrs={"k": REQUIRED},
        outputs=2,
        doc="(weights, ids): top-k experts by scores + bias; weights are the unbiased scores, renormalised.",
        shard="whole",
        latency="routing",
        near_tie=_route_runner_up,
    )
)


def _experts(w, ids):
    """The [in, out] matrices of experts `ids` (any shape) of a stacked expert weight, as f32."""
    if isinstance(w, QTensor):
        w = QTensor(jnp.take(w.codes, ids, axis=0), jnp.take(w.scales, ids, axis=0), w.fmt, w.group)
    else:
        w = jnp.take(w, ids, axis=0)
    return weight_f32(w)


def _bias(b, ids):
    return 0.0 if b is None else jnp.take(b.astype(jnp.float32), ids, axis=0)


def moe_experts(z, weights, ids, w1, w3, w2, b1=None, b3=None, b2=None, *, act, weigh="output", keep=None):
    """r_b = Σ_i weights[b, i] · (bf16(act(bf16(z_b)·W1_e + b1_e, bf16(z_b)·W3_e + b3_e))·W2_e + b2_e),
    e = ids[b, i]; f32 accumulation, expert weights decoded exactly, biases optional.

    `weigh="input"` (Llama 4) scales the expert's input instead and sums the outputs unweighted:
    r_b = Σ_i expert_e(weights[b, i] · z_b), the weight multiplying the products bf16(z_b)·W
    (equal in exact arithmetic). `keep` ([B, k] bool, SPMD prefill) drops the choices it marks false."""
    b, k = ids.shape
    flat = ids.reshape(-1)  # row b·k + i is (row b, choice i)
    x = jnp.repeat(z.astype(jnp.bfloat16).astype(jnp.float32), k, axis=0)
    s = weights.astype(jnp.float32).reshape(-1, 1) if weigh == "input" else 1.0
    g = s * jnp.einsum("nd,ndf->nf", x, _experts(w1, flat), precision="highest") + _bias(b1, flat)
    u = s * jnp.einsum("nd,ndf->nf", x, _experts(w3, flat), precision="highest") + _bias(b3, flat)
    h = apply_block(act, g, u).astype(jnp.bfloat16).astype(jnp.float32)
    y = jnp.einsum("nf,nfd->nd", h, _experts(w2, flat), precision="highest") + _bias(b2, flat)
    sums = weights.astype(jnp.float32) if weigh == "output" else jnp.ones((b, k), jnp.float32)
    if keep is not None:
        sums = jnp.where(keep, sums, 0.0)
    return jnp.einsum("bk,bkd->bd", sums, y.reshape(b, k, -1), precision="highest")


EXPERT_DTYPES = ("mxfp4", "bf16", "fp8_e4m3", "fp8_e5m2", "int4", "int8")  # the reference decodes any (QTensor)


def _check_biases(args, e, d, f) -> None:
    for i, want in ((6, (e, f)), (7, (e, f)), (8, (e, d))):
        if i < len(args):
            _declared_weight(args[i], i, f"bias {i - 5}")
            expect_dtype(args[i], ("f32", "bf16"), i)
            if args[i].type.shape != want:
                raise OpError(f"bias `{args[i].name}` is {args[i].type}, expected [{', '.join(map(str, want))}]", i)


def _experts_infer(args, attrs):
    z, weights, ids, w1, w3, w2 = args[:6]
    expect_rank(z, 2, 0, "the expert input")
    expect_float(z, 0)
    expect_rank(weights, 2, 1, "the routing weights")
    expect_float(weights, 1)
    expect_rank(ids, 2, 2, "the expert ids")
    expect_dtype(ids, ("i32",), 2)
    b, d = z.type.shape
    for i, a in ((1, weights), (2, ids)):
        if a.type.shape[0] != b:
            raise OpError(f"`{a.name}` has {a.type.shape[0]} rows, `{z.name}` has {b}", i)
    if ids.type.shape != weights.type.shape:
        raise OpError(f"expert ids `{ids.name}` are {ids.type} but the weights `{weights.name}` are {weights.type}", 2)
    for i, w in ((3, w1), (4, w3), (5, w2)):
        _declared_weight(w, i, f"operand {i + 1}")
        expect_rank(w, 3, i, "an expert weight [experts, in, out]")
        expect_dtype(w, EXPERT_DTYPES, i)
    e, d1, f = w1.type.shape
    if d1 != d:
        raise OpError(
            f"`{z.name}` has {d} columns but w1 `{w1.name}` takes {d1} inputs "
            f"(expert weights are stored [experts, in, out])",
            3,
        )
    if w3.type.shape != w1.type.shape:
        raise OpError(f"w3 `{w3.name}` is {w3.type} but w1 `{w1.name}` is {w1.type}", 4)
    if w2.type.shape != (e, f, d):
        raise OpError(f"w2 `{w2.name}` is {w2.type}, expected [{e}, {f}, {d}]", 5)
    _check_biases(args, e, d, f)
    weigh = attrs.get("weigh", "output")  # shape rules may be asked without the defaults filled in
    if weigh not in ("output", "input"):
        raise OpError(f'weigh must be "output" or "input" (where the routing weight applies), got {weigh!r}', "weigh")
    return (TensorType(F32, (b, d)),)


def _act_params(args) -> tuple[TensorType, TensorType]:
    """The activation block's parameters: one chosen expert's gate and up results, f32 [B, F]."""
    z, w1 = args[0], args[3]
    expect_rank(w1, 3, 3, "an expert weight [experts, in, out]")
    t = TensorType(F32, (z.type.shape[0], w1.type.shape[2]))
    return t, t


def expected_experts(rows: int, k: int, held: int, total: int) -> Fraction:
    """Distinct experts of the `held` a device holds (of `total`) that `rows` rows choosing `k`
    distinct experts each use, in expectation when each row's choice is uniform over the k-subsets
    (an expert is unused by a row with probability 1 - k / total): held x (1 - (1 - k/total)^rows).
    One row: exactly its share, k x held / total; more rows overlap (Kimi K3 at 8 rows: 120.3 of
    896, not 128)."""
    k = min(k, total)
    return held * (1 - Fraction(total - k, total) ** rows)


def _experts_cost(ins, outs, attrs):
    """The experts a step uses are data-dependent; the bytes are the expected distinct experts'
    (`expected_experts`, rounded up to whole bytes), each distinct expert's w1, w3, w2 (and bias
    rows) read once for all rows that chose it. Expert parallel (`experts_total`, set by
    mkdsl.spmd.shard): this device holds e of them."""
    z, weights, ids, w1, w3, w2 = ins[:6]
    b, k = ids.shape
    e, d, f = w1.shape
    total = attrs.get("experts_total", e)
    per_expert = sum(nbytes(TensorType(w.dtype, w.shape[1:])) for w in (w1, w3, w2, *ins[6:]))
    moved = math.ceil(expected_experts(b, k, e, total) * per_expert)
    return Cost(weight_bytes=moved, flops=2 * b * k * e // total * 3 * d * f)


def _experts_spmd(rows, arrays, attrs):
    """Experts split over `expert_axes`: this device's experts only, the others' weights zeroed."""
    if not attrs.get("expert_axes"):
        return None
    z, wts, ids, w1, w3, w2, *biases = arrays
    e = w1.codes.shape[0] if hasattr(w1, "codes") else w1.shape[0]
    lo = device_index(attrs["expert_axes"]) * e
    held = (ids >= lo) & (ids < lo + e)
    args = (z, jnp.where(held, wts, 0.0), jnp.clip(ids - lo, 0, e - 1), w1, w3, w2, *biases)
    return (moe_experts(*args, act=attrs["act"], weigh=attrs["weigh"], keep=held),)


register(
    OpDef(
        "moe_experts",
        ("z", "weights", "ids", "w1", "w3", "w2", "b1", "b3", "b2"),
        _experts_infer,
        lambda *a, act, weigh="output": (moe_experts(*a, act=act, weigh=weigh),),
        _experts_cost,
        attrs={"act": REQUIRED, "weigh": "output"},
        doc="Σ_i weights[:, i]·expert_ids[:, i](z): gated MLP experts w1/w3 [E, D, F], w2 [E, F, D], "
        "`act` a block of elementwise ops on (gate, up), optional biases b1/b3 [E, F], b2 [E, D]; f32 out. "
        '`weigh="input"`: Σ_i expert(weights[:, i]·z), the weight on the input, outputs summed unweighted.',
        shard="experts",
        reach=(("w1", "own"), ("w3", "own"), ("w2", "own")),
        traffic_group="experts",
        data_dependent=True,
        loop_unit="expert_tiles",
        block_attrs=(("act", _act_params),),
        optional=3,
        spmd_prefill=_experts_spmd,
    )
)
