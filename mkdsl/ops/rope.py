"""Rotary position embedding: pairings, partial rotary, and frequency scaling (linear, llama3, YaRN).

The inverse frequencies are computed here at compile time in float64 and rounded to float32
once (`inv_freq`); the reference and the kernel both read that table, so they agree on it
exactly. Lane k of a head (k = 0..d-1) rotates when `rotary_offset <= k < rotary_offset +
rotary_dim`; the other lanes pass through unchanged (NoPE is simply not calling `rope`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jnp
from mkdsl.ops.registry import (
    Cost,
    OpDef,
    OpError,
    expect_divides,
    expect_dtype,
    expect_float,
    expect_rank,
    numel,
    register,
)

PAIRINGS = ("half", "interleaved")
SCALINGS = ("none", "linear", "llama3", "yarn")

ROPE_ATTRS = {
    "heads": 1,
    "theta": 10000.0,
    "rotary_dim": None,  # None: the whole head rotates
    "rotary_offset": 0,
    "pairing": "half",
    "scaling": "none",
    "factor": 1.0,
    "original_max_position": 0,
    "low_freq_factor": 1.0,  # llama3
    "high_freq_factor": 4.0,  # llama3
    "beta_fast": 32.0,  # yarn
    "beta_slow": 1.0,  # yarn
    "truncate": True,  # yarn: floor/ceil the correction range (DeepSeek, transformers' default)
    "concentration": 1.0,  # multiplies cos and sin of the rotated lanes (gpt-oss's YaRN)
}


@dataclass(frozen=True)
class RopeLayout:
    """Where a head's rotary lanes are: lanes offset..offset+rotary-1, each paired with the lane
    `shift` away (rotary/2 for rotate-half, 1 for interleaved); `freq[i]` is pair i's inverse
    frequency (float32 values as Python floats)."""

    d: int
    offset: int
    rotary: int
    shift: int
    freq: tuple[float, ...]
    concentration: float


def yarn_range(rotary: int, theta: float, a: dict) -> tuple[float, float]:
    """YaRN's correction range (low, high) over the rotary_dim/2 frequency indices."""

    def corr(rotations: float) -> float:
        return rotary * math.log(a["original_max_position"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(a["beta_fast"]), corr(a["beta_slow"])
    if a["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary - 1)


def inv_freq(rotary: int, a: dict) -> np.ndarray:
    """The rotary_dim/2 inverse frequencies (float64) after the attribute's frequency scaling."""
    theta, factor = float(a["theta"]), float(a["factor"])
    base = theta ** (-np.arange(0, rotary, 2, dtype=np.float64) / rotary)
    kind = a["scaling"]
    if kind == "linear":
        return base / factor
    if kind == "llama3":
        orig, lo, hi = a["original_max_position"], a["low_freq_factor"], a["high_freq_factor"]
        wavelen = 2 * math.pi / base
        if hi == lo:  # no smoothing band (Llama 4: 1 and 1): a step at wavelength orig / lo
            smooth = np.where(wavelen > orig / lo, 0.0, 1.0)
        else:
            smooth = np.clip((orig / wavelen - lo) / (hi - lo), 0.0, 1.0)
        return (1 - smooth) * base / factor + smooth * base
    if kind == "yarn":
        low, high = yarn_range(rotary, theta, a)
        if high == low:
            high += 0.001  # as the published ramp does, to avoid a division by zero
        ramp = np.clip((np.arange(rotary // 2) - low) / (high - low), 0.0, 1.0)
        return base * (1 - ramp) + base / factor * ramp
    return base


def layout(d: int, a: dict) -> RopeLayout:
    rotary = d if a["rotary_dim"] is None else a["rotary_dim"]
    shift = rotary // 2 if a["pairing"] == "half" else 1
    freq = tuple(float(np.float32(f)) for f in inv_freq(rotary, a))
    return RopeLayout(d, a["rotary_offset"], rotary, shift, freq, float(np.float32(a["concentration"])))


def lane_tables(lay: RopeLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per lane of a head: inverse frequency, cos factor, sin factor (sign and concentration
    folded in) and whether the partner lane is `shift` above (else below); float32 [d]."""
    k = np.arange(lay.d) - lay.offset
    rot = (k >= 0) & (k < lay.rotary)
    kk = np.where(rot, k, 0)
    up = (kk % (2 * lay.shift)) < lay.shift
    pair = kk // (2 * lay.shift) * lay.shift + kk % lay.shift
    freq = np.where(rot, np.asarray(lay.freq, np.float32)[pair], 0.0).astype(np.float32)
    cos_f = np.where(rot, lay.concentration, 1.0).astype(np.float32)
    sin_f = np.where(rot, np.where(up, -1.0, 1.0) * lay.concentration, 0.0).astype(np.float32)
    return freq, cos_f, sin_f, up & rot


def rope(x, positions, **a):
    """x·cos + partner(x)·sin per head, in float32, with the tables of `lane_tables`."""
    a = ROPE_ATTRS | a
    x = x.astype(jnp.float32)
    b, n = x.shape
    heads = a["heads"]
    lay = layout(n // heads, a)
    freq, cos_f, sin_f, up = lane_tables(lay)
    angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(freq)[None, :]
    cos = (jnp.cos(angle) * cos_f)[:, None, :]
    sin = (jnp.sin(angle) * sin_f)[:, None, :]
    xh = x.reshape(b, heads, lay.d)
    partner = jnp.where(up, jnp.roll(xh, -lay.shift, axis=-1), jnp.roll(xh, lay.shift, axis=-1))
    return (xh * cos + partner * sin).reshape(b, n)


def _check_attrs(d, a: dict) -> None:
    if a["pairing"] not in PAIRINGS:
        raise OpError(f"pairing must be one of {', '.join(map(repr, PAIRINGS))}, got {a['pairing']!r}", "pairing")
    if a["scaling"] not in SCALINGS:
        raise OpError(f"scaling must be one of {', '.join(map(repr, SCALINGS))}, got {a['scaling']!r}", "scaling")
    rotary, offset = a["rotary_dim"], a["rotary_offset"]
    if rotary is not None and (not isinstance(rotary, int) or isinstance(rotary, bool) or rotary < 2 or rotary % 2):
        raise OpError(f"rotary_dim must be an even integer of at least 2, got {rotary!r}", "rotary_dim")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise OpError(f"rotary_offset must be a non-negative integer, got {offset!r}", "rotary_offset")
    if isinstance(d, int):
        r = d if rotary is None else rotary
        if r % 2:
            raise OpError(f"rope needs an even head dimension, got {d}", "heads")
        if offset + r > d:
            raise OpError(f"rotary lanes {offset}..{offset + r - 1} do not fit the head dimension {d}", "rotary_dim")
    for name in ("theta", "factor", "concentration"):
        if not isinstance(a[name], (int, float)) or isinstance(a[name], bool) or a[name] <= 0:
            raise OpError(f"{name} must be a positive number, got {a[name]!r}", name)
    if a["scaling"] in ("llama3", "yarn"):
        orig = a["original_max_position"]
        if not isinstance(orig, int) or isinstance(orig, bool) or orig < 1:
            raise OpError(f"{a['scaling']} scaling needs original_max_position=N (N >= 1), got {orig!r}", "scaling")
    if a["scaling"] == "yarn":
        _check_yarn(a)
    if a["scaling"] == "llama3" and not a["high_freq_factor"] >= a["low_freq_factor"] > 0:
        raise OpError("llama3 scaling needs high_freq_factor >= low_freq_factor > 0", "high_freq_factor")
    if not isinstance(a["truncate"], bool):
        raise OpError(f"truncate must be true or false, got {a['truncate']!r}", "truncate")


def _check_yarn(a: dict) -> None:
    """YaRN's correction range divides by ln(theta) and takes the log of 1 / beta."""
    if a["theta"] == 1:
        raise OpError("yarn scaling needs theta != 1: its correction range divides by ln(theta)", "theta")
    for name in ("beta_fast", "beta_slow"):
        if not isinstance(a[name], (int, float)) or isinstance(a[name], bool) or a[name] <= 0:
            raise OpError(f"{name} must be a positive number, got {a[name]!r}", name)


def _rope_infer(args, attrs):
    x, pos = args
    expect_rank(x, 2, 0, "the input")
    expect_float(x, 0)
    expect_dtype(pos, ("i32",), 1)
    d = expect_divides(x.type.shape[1], attrs["heads"], "row width per head", "heads")
    _check_attrs(d, attrs)
    return (TensorType(F32, x.type.shape),)


register(
    OpDef(
        "rope",
        ("x", "positions"),
        _rope_infer,
        lambda x, p, **a: (rope(x, p, **a),),
        lambda ins, outs, a: Cost(flops=6 * numel(outs[0])),
        attrs=dict(ROPE_ATTRS),
        doc="Rotary position embedding of each head at each row's position (half or interleaved pairs, "
        "partial rotary, linear/llama3/yarn frequency scaling).",
        shard="heads",
        reach=(("positions", "own"),),  # a state's positions: its lowering copies them to SMEM
    )
)
