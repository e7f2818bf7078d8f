"""Oracles for the composable routing ops (group_topk, take) and for moe_experts with
a spec activation block and expert biases, each against float64 numpy.

Tolerances:
* exact: group_topk's ids and values and take's values (selection and copies of f32 numbers);
* moe_experts: as tests/test_ops_moe_mla.py's `moe_oracle`, with swiglu's sensitivity
  (|d/dg silu(g)·u| <= 1.1·|u|, |d/du| = |silu(g)| <= |g|) and one f32 rounding per bias add.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_moe_mla import (
    RHO,
    TINY,
    U,
    as_bf16,
    bf16,
    bf16_rounded,
    bits_f64,
    close,
    exact,
    f32_dot_error,
    nonzero_normal,
    run,
)

from mkdsl.lang.block_attrs import op_block
from mkdsl.lang.diagnostics import SpecError
from mkdsl.lang.dtypes import F32, fp8
from mkdsl.lang.elaborate import elaborate
from mkdsl.lang.ir import BlockAttr, TensorType
from mkdsl.lang.quant import quantize
from mkdsl.lang.syntax import parse

SEEDS = st.integers(0, 2**32 - 1)
ORACLES: dict[str, list[str]] = {}
KNOWN_ATTRS = {"group_topk": {"k", "groups", "topk_groups"}, "take": set()}


def oracle_for(*ops: str):
    def mark(test):
        for op in ops:
            ORACLES.setdefault(op, []).append(test.__name__)
        return test

    return mark


def topk_oracle(row, k):
    """Indices of the k largest, descending, ties to the lower index."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]


def group_topk_oracle(x, k, groups, keep):
    b, n = x.shape
    size = n // groups
    ids = np.zeros((b, k), np.int32)
    for r in range(b):
        score = [sum(sorted(x[r, g * size : (g + 1) * size])[-2:]) for g in range(groups)]
        kept = topk_oracle(score, keep)
        allowed = np.full(n, -np.inf)
        for g in kept:
            allowed[g * size : (g + 1) * size] = x[r, g * size : (g + 1) * size]
        ids[r] = topk_oracle(list(allowed), k)
    return np.take_along_axis(x, ids, axis=1), ids


@oracle_for("group_topk")
@settings(max_examples=15, deadline=None)
@given(seed=SEEDS, b=st.sampled_from([1, 4]), groups=st.sampled_from([1, 4, 8]), ties=st.booleans())
def test_group_topk(seed, b, groups, ties):
    """DeepSeek-V3's selection: group score = sum of the group's top 2, keep the best groups, then
    top k among their experts. `ties` draws few distinct values, so both tie rules are exercised."""
    rng = np.random.default_rng(seed)
    n = 32
    keep = int(rng.integers(1, groups + 1))
    k = int(rng.integers(1, keep * (n // groups) + 1))
    x = (rng.integers(0, 4, (b, n)) * 0.25 if ties else rng.standard_normal((b, n))).astype(np.float32)
    values, ids = run("group_topk", x, k=k, groups=groups, topk_groups=keep)
    want_v, want_ids = group_topk_oracle(x.astype(np.float64), k, groups, keep)
    exact(ids, want_ids, "group_topk ids")
    exact(values, want_v, "group_topk values")


@oracle_for("take")
@settings(max_examples=10, deadline=None)
@given(seed=SEEDS, b=st.sampled_from([1, 3]), k=st.sampled_from([1, 4]))
def test_take(seed, b, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, 16)).astype(np.float32)
    ids = rng.integers(0, 16, (b, k)).astype(np.int32)
    (out,) = run("take", x, ids)
    exact(out, np.take_along_axis(x.astype(np.float64), ids, axis=1), "take")


def silu(x):
    return x / (1.0 + np.exp(-x))


def biased_oracle(z, weights, ids, mats, biases):
    """moe_experts with act = swiglu and biases b1/b3 [E, F], b2 [E, D]: (want, atol)."""
    w1, w3, w2 = mats
    b1, b3, b2 = biases
    b, k = ids.shape
    d, f = w1.shape[1:]
    want, atol = np.zeros((b, d)), np.zeros((b, d))
    for row in range(b):
        zb = bf16(z[row])
        for i in range(k):
            e = ids[row, i]
            g, u = zb @ w1[e] + b1[e], zb @ w3[e] + b3[e]
            eg = f32_dot_error(zb, w1[e]) + U * (np.abs(g) + np.abs(b1[e]))  # + the bias add
            eu = f32_dot_error(zb, w3[e]) + U * (np.abs(u) + np.abs(b3[e]))
            h = silu(g) * u
            sens = 1.1 * eg * np.abs(u) + (np.abs(g) + eg) * eu
            h_b, gap = bf16_rounded(h, sens + RHO * (np.abs(h) + sens) + TINY)
            y = h_b @ w2[e] + b2[e]
            wi = weights[row, i]
            want[row] += wi * y
            dot = gap @ np.abs(w2[e]) + (f + k + 5) * U * ((np.abs(h_b) + gap) @ np.abs(w2[e]) + np.abs(b2[e]))
            atol[row] += abs(wi) * dot
    return want, atol + TINY


@settings(max_examples=8, deadline=None)
@given(seed=SEEDS, b=st.sampled_from([1, 3]), k=st.sampled_from([1, 2]), bias_dt=st.sampled_from(["f32", "bf16"]))
def test_moe_experts_swiglu_block_and_biases(seed, b, k, bias_dt):
    """act = a spec block (swiglu) and the three expert biases, bf16 experts."""
    rng = np.random.default_rng(seed)
    experts, d, f = 4, 32, 64
    z = nonzero_normal(rng, (b, d))
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(b)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (b, k)).astype(np.float32)
    mats = [as_bf16(bf16(nonzero_normal(rng, s, s[1] ** -0.5))) for s in ((4, d, f), (4, d, f), (4, f, d))]
    biases = [nonzero_normal(rng, s, 0.5) for s in ((4, f), (4, f), (4, d))]
    if bias_dt == "bf16":
        biases = [as_bf16(bf16(x)) for x in biases]
    t = TensorType(F32, (b, f))
    act = BlockAttr(op_block("swiglu", (t, t)))
    (out,) = run("moe_experts", z, weights, ids, *mats, *biases, act=act)
    want, atol = biased_oracle(
        z.astype(np.float64),
        weights.astype(np.float64),
        ids,
        [bits_f64(m) for m in mats],
        [bits_f64(x) for x in biases],
    )
    close(out, want, atol, f"moe_experts swiglu + biases ({bias_dt})")


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("return g * sigmoid(g * 1.702) * (u + 1.0)", "return linear(g, sg)", "`linear` is not an elementwise op"),
        ("return g * sigmoid(g * 1.702) * (u + 1.0)", "return g * rowsum(u)", "`rowsum` is not an elementwise op"),
        ("return g * sigmoid(g * 1.702) * (u + 1.0)", "return g * s_gate", "`s_gate` is not a parameter of the block"),
        ("block oss_act(g, u)", "block oss_act(g)", "takes 2 parameters, but block `oss_act` has 1"),
        ("act=oss_act", "act=EPS", "must name a block of elementwise ops with 2 parameters"),
        ("act=oss_act", "act=softmax", "must name a block of elementwise ops with 2 parameters"),
        (", act=oss_act", "", "needs the attribute `act=...`"),
        (
            "weight b1:       bf16[E, F @tp]",
            "weight b1:       bf16[E, EP]",
            "bias `b1` is bf16[32, 128], expected [32, 256]",
        ),
    ],
    ids=["matmul", "row-sum", "weight", "arity", "constant", "non-elementwise-op", "missing", "bias-shape"],
)
def test_act_block_and_bias_diagnostics(old, new, message):
    from test_moe_kernel import SPEC

    assert old in SPEC
    with pytest.raises(SpecError) as err:
        elaborate(parse(SPEC.replace(old, new)), None, SPEC)
    assert message in str(err.value), str(err.value)


@settings(max_examples=6, deadline=None)
@given(seed=SEEDS, b=st.sampled_from([1, 3]), k=st.sampled_from([1, 2]))
def test_moe_experts_fp8_block_experts(seed, b, k):
    """fp8 e4m3 experts with one f32 scale per [128, 128] square (DeepSeek-V3's format), decoded
    exactly (code x scale, one f32 rounding), against the oracle on the decoded values."""
    rng = np.random.default_rng(seed)
    experts, d, f = 3, 256, 256
    z = nonzero_normal(rng, (b, d))
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(b)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (b, k)).astype(np.float32)
    mats, decoded = [], []
    for shape in ((experts, d, f), (experts, d, f), (experts, f, d)):
        w = quantize(fp8("fp8_e4m3", block=128), nonzero_normal(rng, shape, shape[1] ** -0.5))
        mats.append(w)
        scale = np.repeat(np.repeat(np.asarray(w.scales, np.float64), 128, axis=-2), 128, axis=-1)
        decoded.append((np.asarray(w.codes).astype(np.float64) * scale).astype(np.float32).astype(np.float64))
    t = TensorType(F32, (b, f))
    (out,) = run("moe_experts", z, weights, ids, *mats, act=BlockAttr(op_block("swiglu", (t, t))))
    zeros = [np.zeros((experts, f)), np.zeros((experts, f)), np.zeros((experts, d))]
    want, atol = biased_oracle(z.astype(np.float64), weights.astype(np.float64), ids, decoded, zeros)
    close(out, want, atol, "moe_experts fp8 block-scaled")
