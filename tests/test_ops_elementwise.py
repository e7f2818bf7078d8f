"""The elementwise ops of mkdsl/ops/elementwise.py (arithmetic with broadcasting, the scalar forms
of the operators, activations) against numpy float64 oracles written from their equations.

Tolerances, per test:

* exact (bitwise): sub, minimum, maximum (also broadcast), neg, abs, square, relu, clamp,
  repeat and the scalar forms of `+ - *`, min and max: one IEEE operation per element, and an
  f64 result rounded to f32 equals the f32 operation (53 >= 2·24 + 2: double rounding is
  innocuous for + - * / and sqrt);
* div and the scalar divisions: 4·2^-24 relative: XLA may divide by a broadcast or constant
  divisor as a multiplication by its f32 reciprocal (two roundings, <= 3·2^-24; seen: 1 ulp);
* `RTOL` = 1e-5 relative (~170 f32 ulps) for exp, log, sqrt, rsqrt, tanh, softplus and x ** s:
  XLA's f32 versions are within a few ulps, then at most a few roundings;
* gelu, gelu_tanh: `RTOL` plus |x|·2^-20 absolute: 1 + erf(z) (1 + tanh(u)) cancels for
  negative x, where an error of a few ulps of 1 (k·2^-24, k <= 8) is scaled by x/2, i.e. at
  most |x|·2^-22; 2^-20 keeps a 4x margin;
* log: `RTOL` plus 2^-22 absolute: near x = 1 the result is near 0 and XLA's f32 log is a few
  ulps of 1 off there;
* rowsum: (n + 2)·2^-24·sum|x| absolute, the worst case of any f32 summation order of n terms.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mkdsl.ops import OPS, REQUIRED

U = 2.0**-24
RTOL = 1e-5
DIV_RTOL = 4 * U  # a division may be a multiplication by the rounded reciprocal: <= 3U
TINY = 1e-30
SEEDS = st.integers(0, 2**32 - 1)
SCALES = st.sampled_from([1e-3, 1.0, 8.0])
FEW = settings(max_examples=8, deadline=None)

ORACLES: dict[str, list[str]] = {}


def oracle_for(*ops: str):
    def mark(test):
        for op in ops:
            ORACLES.setdefault(op, []).append(test.__name__)
        return test

    return mark


@functools.cache
def _jitted(name: str, attrs: tuple):
    return jax.jit(functools.partial(OPS[name].reference, **dict(attrs)))


def run(name: str, *args, **attrs) -> np.ndarray:
    """The op's reference under jit, defaults filled in as elaboration does; one f32 result."""
    attrs = {k: v for k, v in OPS[name].attrs.items() if v is not REQUIRED} | attrs
    (out,) = _jitted(name, tuple(sorted(attrs.items())))(*args)
    out = np.asarray(out)
    assert out.dtype == np.float32, name
    return out


def draw(seed: int, shape, scale: float = 1.0, positive: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(f32 array, its float64 value)."""
    x = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
    if positive:
        x = np.abs(x) + np.float32(1e-3)
    return x, x.astype(np.float64)


def exact(got, want, what: str) -> None:
    want = np.asarray(want, np.float64).astype(np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.array_equal(got, want), f"{what}: worst difference {np.abs(got - want).max():.3g}"


def close(got, want, atol, rtol: float, what: str) -> None:
    err = np.abs(np.asarray(got, np.float64) - want)
    bound = atol + rtol * np.abs(want)
    assert not np.isnan(got).any(), f"{what}: NaN"
    assert (err <= bound).all(), f"{what}: worst error / bound {(err / np.maximum(bound, TINY)).max():.3g}"


SHAPES = st.sampled_from([((3, 64), (3, 64)), ((3, 64), (64,)), ((64,), (3, 64)), ((3, 64), (3, 1)), ((3, 1), (3, 64))])


@oracle_for("add", "sub", "mul", "div", "minimum", "maximum")
@FEW
@given(seed=SEEDS, shapes=SHAPES, scale=SCALES)
def test_broadcasting_arithmetic(seed, shapes, scale):
    """Equal shapes, a per-column [N] and a per-row [B, 1] operand, on either side."""
    (a, av), (b, bv) = draw(seed, shapes[0], scale), draw(seed + 1, shapes[1])
    out = (3, 64)
    av, bv = np.broadcast_to(av, out), np.broadcast_to(bv, out)  # the oracle's own broadcast
    exact(run("add", a, b), av + bv, "add")
    exact(run("sub", a, b), av - bv, "sub")
    exact(run("mul", a, b), av * bv, "mul")
    close(run("div", a, b), av / bv, TINY, DIV_RTOL, "div")
    exact(run("minimum", a, b), np.where(av < bv, av, bv), "minimum")
    exact(run("maximum", a, b), np.where(av > bv, av, bv), "maximum")


SCALAR_FORMS = {
    "add_scalar": lambda x, s: x + s,
    "sub_scalar": lambda x, s: x - s,
    "rsub_scalar": lambda x, s: s - x,
    "mul_scalar": lambda x, s: x * s,
    "div_scalar": lambda x, s: x / s,
    "rdiv_scalar": lambda x, s: s / x,
    "minimum_scalar": lambda x, s: np.where(x < s, x, s),
    "maximum_scalar": lambda x, s: np.where(x > s, x, s),
}


@oracle_for(*SCALAR_FORMS, "pow_scalar")
@FEW
@given(seed=SEEDS, scale=SCALES, s=st.sampled_from([2.5, -0.75, 3.0, 1e-3]))
def test_scalar_forms(seed, scale, s):
    """`x + s`, `s - x`, `x * s`, ...: the constant is an exactly representable f32 here."""
    x, xv = draw(seed, (3, 64), scale)
    for name, fn in SCALAR_FORMS.items():
        want = fn(xv, np.float64(np.float32(s)))
        if "div" in name:
            close(run(name, x, s=s), want, TINY, DIV_RTOL, name)
        else:
            exact(run(name, x, s=s), want, name)
    p, pv = draw(seed, (3, 64), scale, positive=True)
    close(run("pow_scalar", p, s=s), pv**s, TINY, RTOL, "pow_scalar")
    exact(run("pow_scalar", x, s=2), xv * xv, "pow_scalar 2")


@oracle_for("neg", "abs", "square", "relu", "clamp")
@FEW
@given(seed=SEEDS, scale=SCALES, lo=st.sampled_from([None, -0.5]), hi=st.sampled_from([None, 0.25, 7.0]))
def test_exact_unary(seed, scale, lo, hi):
    x, xv = draw(seed, (3, 64), scale)
    exact(run("neg", x), -xv, "neg")
    exact(run("abs", x), np.abs(xv), "abs")
    exact(run("square", x), xv * xv, "square")
    exact(run("relu", x), np.where(xv > 0, xv, 0.0), "relu")
    if lo is None and hi is None:
        return
    want = xv if lo is None else np.where(xv < lo, lo, xv)
    want = want if hi is None else np.where(want > hi, hi, want)
    exact(run("clamp", x, lo=lo, hi=hi), want, f"clamp lo={lo} hi={hi}")


def erf64(x):
    return np.vectorize(math.erf)(x)


@oracle_for("exp", "log", "sqrt", "rsqrt", "tanh", "softplus", "gelu", "gelu_tanh")
@FEW
@given(seed=SEEDS, scale=SCALES)
def test_transcendental(seed, scale):
    x, xv = draw(seed, (3, 64), scale)
    p, pv = draw(seed, (3, 64), scale, positive=True)
    close(run("exp", x), np.exp(xv), TINY, RTOL, "exp")
    close(run("log", p), np.log(pv), 2.0**-22, RTOL, "log")
    close(run("sqrt", p), np.sqrt(pv), TINY, RTOL, "sqrt")
    close(run("rsqrt", p), 1.0 / np.sqrt(pv), TINY, RTOL, "rsqrt")
    close(run("tanh", x), np.tanh(xv), TINY, RTOL, "tanh")
    close(run("softplus", x), np.log1p(np.exp(xv)), TINY, RTOL, "softplus")
    cancel = np.abs(xv) * 2.0**-20
    close(run("gelu", x), xv / 2 * (1 + erf64(xv / math.sqrt(2))), cancel, RTOL, "gelu")
    inner = math.sqrt(2 / math.pi) * (xv + 0.044715 * xv**3)
    close(run("gelu_tanh", x), xv / 2 * (1 + np.tanh(inner)), cancel, RTOL, "gelu_tanh")


def test_softplus_does_not_overflow():
    x = np.array([[-200.0, -30.0, 0.0, 30.0, 200.0]], np.float32)
    want = np.array([[math.exp(-200.0), math.log1p(math.exp(-30.0)), math.log(2.0), 30.0, 200.0]])
    close(run("softplus", x), want, 1e-37, RTOL, "softplus at large |x|")


@oracle_for("floor", "to_f32")
@FEW
@given(seed=SEEDS, scale=SCALES, floor_scale=st.sampled_from([1, 4, 8192]))
def test_position_scalars(seed, scale, floor_scale):
    """floor is exact; to_f32 is exact for integers below 2^24. With both, Llama 4's query
    temperature 1 + 0.1·log(floor((p + 1) / F) + 1) is within log's and the few f32 roundings'
    error (a few ulps of values <= ~2) of log1p in float64."""
    x, xv = draw(seed, (3, 64), scale)
    exact(run("floor", x), np.floor(xv), "floor")
    positions = np.random.default_rng(seed).integers(0, 1 << 20, 5).astype(np.int32)
    positions[0] = 0
    p = run("to_f32", positions)
    exact(p, positions.astype(np.float64)[:, None], "to_f32")
    t = run(
        "add_scalar",
        run(
            "mul_scalar",
            run(
                "log",
                run("add_scalar", run("floor", run("div_scalar", run("add_scalar", p, s=1.0), s=floor_scale)), s=1.0),
            ),
            s=0.1,
        ),
        s=1.0,
    )
    want = 1 + 0.1 * np.log1p(np.floor((positions.astype(np.float64) + 1) / floor_scale))[:, None]
    close(t, want, 0.0, 8 * U, f"temperature, floor_scale {floor_scale}")


@oracle_for("repeat")
@FEW
@given(seed=SEEDS, heads=st.sampled_from([1, 2, 5]), each=st.sampled_from([1, 3, 128]))
def test_repeat(seed, heads, each):
    s, sv = draw(seed, (4, heads))
    want = np.empty((4, heads * each))
    for h in range(heads):
        for j in range(each):
            want[:, h * each + j] = sv[:, h]
    exact(run("repeat", s, each=each), want, "repeat")
    exact(run("repeat", s[0], each=each), want[0], "repeat of a per-head weight [heads]")


@oracle_for("rowsum")
@FEW
@given(seed=SEEDS, n=st.sampled_from([1, 7, 256]), scale=SCALES)
def test_rowsum(seed, n, scale):
    x, xv = draw(seed, (3, n), scale)
    out = run("rowsum", x)
    assert out.shape == (3, 1)
    bound = (n + 2) * U * np.abs(xv).sum(axis=1, keepdims=True)
    close(out, xv.sum(axis=1, keepdims=True), bound, 0.0, "rowsum")


KNOWN_ATTRS = {  # the attributes the oracles above pass by name
    "add": set(),
    "sub": set(),
    "mul": set(),
    "div": set(),
    "minimum": set(),
    "maximum": set(),
    "neg": set(),
    "abs": set(),
    "square": set(),
    "relu": set(),
    "clamp": {"lo", "hi"},
    "exp": set(),
    "log": set(),
    "floor": set(),
    "to_f32": set(),
    "sqrt": set(),
    "rsqrt": set(),
    "tanh": set(),
    "softplus": set(),
    "gelu": set(),
    "gelu_tanh": set(),
    "repeat": {"each"},
    "rowsum": set(),
}
