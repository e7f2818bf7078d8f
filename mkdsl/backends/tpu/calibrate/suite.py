"""The calibration suite: which microbenchmarks run, at which sizes (tiny in interpret mode), and
how each constant of plan/measured.py is derived from their times on a TPU. Times are medians of
several calls; a constant is always a difference of two runs that differ only in the work it
prices (tiles, repetitions, tokens, bytes), so the call's own cost cancels out."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from mkdsl.backends.tpu.calibrate import local, remote

MIB = 2**20


@dataclass
class Bench:
    name: str
    group: str  # which constants it feeds
    params: dict
    build: object  # () -> (fn, args, expected)
    seconds: float | None = None
    checked: bool = False
    error: str = ""
    extra: dict = field(default_factory=dict)


def _rng(seed: int = 0):
    return np.random.default_rng(seed)


def _matrix(k: int, n: int, dtype: str) -> np.ndarray:
    """A random W [k, n] of `dtype` (fp8: values exact in e4m3, so the check stays exact)."""
    r = _rng(k + n)
    w = r.standard_normal((k, n)).astype(np.float32)
    if dtype == "fp8":
        return (np.round(w * 4) / 4).clip(-8, 8).astype(local.tile_dtype("fp8"))
    return w.astype(local.tile_dtype(dtype))


def _ring(dtype: str, tk: int, tn: int, count: int, depth: int, interp) -> tuple:
    """x @ W with W of `count` [tk, tn] tiles in one column block (K = count * tk)."""
    w = _matrix(count * tk, tn, dtype)
    x = _rng(count).standard_normal((local.ROWS * 2, count * tk)).astype(local.tile_dtype("bf16"))
    return w.nbytes, lambda: local.ring(x, w, tk, tn, depth, interp)


def stream_benches(tiny: bool, interp) -> list[Bench]:
    """The kernel's ring (its `linear` / `qlinear` over its ring tables) at several bank sizes and
    dtypes (each at n and 2n tiles), one long stream, and the kernel's `MoE` with 1..8 tile sets in flight."""
    banks = [("bf16", 128, 128), ("fp8", 128, 128)] if tiny else [
        ("bf16", 512, 1024), ("bf16", 1024, 1024), ("bf16", 1024, 2048), ("fp8", 1024, 2048)]  # fmt: skip
    depth = 4 if tiny else 16
    out = []
    for dtype, tk, tn in banks:
        for count in (2,) if tiny else (32, 64):  # the difference prices the tiles alone
            nbytes, build = _ring(dtype, tk, tn, count, depth, interp)
            out.append(Bench(f"ring {dtype} [{tk}, {tn}] x{count}", "ring",
                             {"dtype": dtype, "tk": tk, "tn": tn, "tiles": count, "bytes": nbytes}, build))  # fmt: skip
    long_n = 4 if tiny else 200
    nbytes, build = _ring("bf16", 128 if tiny else 1024, 128 if tiny else 1024, long_n, depth, interp)
    out.append(Bench(f"long stream x{long_n}", "long", {"bytes": nbytes}, build))
    e, d, f, tn = (4, 256, 256, 128) if tiny else (64, 1024, 768, 256)
    w13 = tuple(_matrix(e * d, f, "bf16").reshape(e, d, f) for _ in range(2))
    w2 = _matrix(e * f, d, "bf16").reshape(e, f, d)
    per_expert = 3 * d * f * 2  # bytes of W1, W3 and W2
    for slots in (1, 2, 4) if tiny else (1, 2, 4, 8):
        for k in (2,) if tiny else (2, 4):  # more distinct experts: the difference prices their bytes
            ids = np.stack([_rng(slots + k + b).choice(e, k, replace=False) for b in range(16)]).astype(np.int32)
            out.append(Bench(f"experts, {slots} slots, top-{k}", "experts",
                             {"slots": slots, "k": k, "bytes": per_expert * len(np.unique(ids))},
                             lambda i=ids, s=slots: local.experts(i, w13, w2, tn, s, interp)))  # fmt: skip
    return out


def exchange_benches(tiny: bool, devices: int, interp) -> list[Bench]:
    """The kernel's collectives: all-gathers over the chip's other core, a core of another chip and
    directly over 2..N cores, at 2 sizes and 2 repetition counts each (the repetitions' difference
    is one exchange); the chip-hierarchical all-reduce over every core; barriers per step."""
    sizes = [(8, 128)] if tiny else [(8, 1024), (8, 8192)]
    forms = [("sibling", "gather", 1), ("cross-chip", "gather", 2)]
    peers = 2
    while peers * 2 <= devices:
        peers *= 2
        forms.append((f"direct {peers - 1} peers", "gather", peers - 1))
    forms.append((f"hierarchical {peers} cores", "hier", peers - 1))
    out = []
    for what, kind, mask in forms:
        for rows, lanes in sizes:
            x = _rng(rows + mask).standard_normal((devices, rows, lanes)).astype(np.float32)
            for reps in (2,) if tiny else (4, 36):  # tiny: checked only, two rounds reuse the slots
                out.append(Bench(f"{what} [{rows}, {lanes}] f32 x{reps}", "exchange",
                                 {"form": what, "mask": mask, "bytes": x[0].nbytes, "reps": reps},
                                 lambda x=x, k=kind, m=mask, r=reps: remote.exchange(devices, k, m, x, r, interp)))  # fmt: skip
    for steps in (1, 2 if tiny else 16):
        out.append(Bench(f"barrier, {steps} steps per call", "dispatch", {"steps": steps},
                         lambda s=steps: remote.barrier_steps(devices, s, interp)))  # fmt: skip
    return out


def compute_benches(tiny: bool, interp) -> list[Bench]:
    """The kernel's attention at several contexts, top-k routing, the vector work of a norm and a gate."""
    tile = 16 if tiny else 256
    out = []
    for ctx in (48,) if tiny else (256, 1024, 4096):  # one row, 2 heads over 1 KV head of 128
        out.append(Bench(f"attention, {ctx} tokens", "decode_attention", {"tokens": ctx},
                         lambda c=ctx: local.attention(c, 2, 1, 128, tile, interp)))  # fmt: skip
    scores = _rng(1).standard_normal((8, 128 if tiny else 1024)).astype(np.float32)
    out.append(Bench("routing top-8", "routing", {"experts": scores.shape[1], "k": 8},
                     lambda: local.routing(scores, 8, interp)))  # fmt: skip
    r = _rng(2)
    x, g = (r.standard_normal((8 if tiny else 16, 256 if tiny else 7168)).astype(np.float32) for _ in range(2))
    w = r.standard_normal((1, x.shape[1])).astype(np.float32)
    for reps in (2,) if tiny else (0, 64):
        out.append(Bench(f"norm + gate x{reps}", "vector", {"reps": reps, "ops": 2, "shape": list(x.shape)},
                         lambda n=reps: local.vector(x, w, g, n, interp)))  # fmt: skip
    return out


def run(bench: Bench, timed: bool, calls: int = 5) -> None:
    """Build, run and check one microbenchmark; on a TPU also its median time per call."""
    try:
        fn, args, expected = bench.build()
        got = np.asarray(fn(*args))
        _check(bench, got, expected)
        if timed:
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                np.asarray(fn(*args))
                times.append(time.perf_counter() - start)
            bench.seconds = statistics.median(times)
    except Exception as e:  # noqa: BLE001 (a benchmark that fails is reported, the others still run)
        bench.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _check(bench: Bench, got: np.ndarray, expected) -> None:
    """The result against numpy: exact for gathers, counts and top-k ids; the ring, the experts and
    attention within the bound their arithmetic allows (local.Within, derived beside each); the
    hierarchical all-reduce's f32 sums of at most 32 blocks within 1e-5 relative; the norm and
    gate within 1e-4 (f32 rsqrt and sigmoid in another op order, values of order 1)."""
    if isinstance(expected, local.Within):  # within the bound its arithmetic allows
        assert not np.isnan(got).any(), "NaN in the result"
        err = np.abs(got - expected.value)
        assert (err <= expected.bound).all(), f"off by {float((err - expected.bound).max()):.3g} past the bound"
    elif bench.group == "exchange" and bench.params["form"].startswith("hier"):  # f32 sums of <= 32 blocks
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))
    elif bench.group in ("routing", "dispatch", "exchange"):  # ids, counts, gathered bits
        np.testing.assert_array_equal(got, expected)
    else:
        tol = 1e-4
        assert not np.isnan(got).any(), "NaN in the result"
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * max(1.0, float(np.abs(expected).max())))
    bench.checked = True


def _pair(benches: list[Bench], group: str, key: str, match=lambda b: True) -> list[tuple[float, float]]:
    """(x, seconds) of the timed benchmarks of a group, x = params[key], sorted by x."""
    pts = [(float(b.params[key]), b.seconds) for b in benches if b.group == group and match(b) and b.seconds]
    return sorted(pts)


def _slope(pts: list[tuple[float, float]]) -> float | None:
    """Seconds per unit of x between the first and the last point (None: fewer than two)."""
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def _rate(benches, group: str, match) -> float | None:
    s = _slope(_pair(benches, group, "bytes", match))
    return 1 / s if s and s > 0 else None


def _link(benches, form: str) -> tuple[float, float] | None:
    """(latency us, bytes/s) of one exchange form: per exchange = the difference of its two
    repetition counts, at two sizes."""
    per = []
    for size in sorted({b.params["bytes"] for b in benches if b.params.get("form") == form}):
        pts = _pair(benches, "exchange", "reps", lambda b, s=size: b.params["form"] == form and b.params["bytes"] == s)
        one = _slope(pts)
        if one is not None:
            per.append((size, one))
    s = _slope(per)
    if not s or s <= 0:
        return None
    return (per[0][1] - per[0][0] * s) * 1e6, 1 / s


def _bank(b: Bench) -> tuple:
    return b.params["dtype"], b.params["tk"], b.params["tn"]


def derive(benches: list[Bench], devices: int) -> dict[str, float]:
    """The constants of plan/measured.py the timed suite determines (the others stay borrowed)."""
    c: dict[str, float] = {}
    for name, value in (
        ("RING_STREAM_BYTES_PER_S", _rate(benches, "ring", lambda b: _bank(b) == ("bf16", 1024, 1024))),
        ("INT8_BANK_BYTES_PER_S", _rate(benches, "ring", lambda b: b.params["dtype"] == "fp8")),
        ("EXPERT_STREAM_BYTES_PER_S", _rate(benches, "experts", lambda b: b.params["slots"] == 4)),
    ):
        if value:
            c[name] = value
    long = next((b for b in benches if b.group == "long" and b.seconds), None)
    if long:
        c["LONG_STREAM_BYTES_PER_S"] = long.params["bytes"] / long.seconds
    links = (
        ("sibling", "SIBLING_COPY_US", "SIBLING_COPY_BYTES_PER_S"),
        ("cross-chip", "CROSS_CHIP_COPY_US", "CROSS_CHIP_COPY_BYTES_PER_S"),
    )
    for form, lat, bw in links:
        fit = _link(benches, form)
        if fit:
            c[lat], c[bw] = fit
    direct = [b.params["form"] for b in benches if b.params.get("form", "").startswith("direct")]
    if direct:
        widest = max(direct, key=lambda f: int(f.split()[1]))
        fit = _link(benches, widest)
        if fit:  # the fit's bytes are all a core sends: its block times its peers
            peers = int(widest.split()[1])
            c["DIRECT_PHASE_US"], c["DIRECT_BYTES_PER_S"] = fit[0], fit[1] * peers
            c["DIRECT_FIT_CORES"] = peers + 1
    steps = _slope(_pair(benches, "dispatch", "steps"))
    if steps:
        c["DISPATCH_US"], c["DISPATCH_MEASURED_CORES"] = steps * 1e6, devices
    per_token = _slope(_pair(benches, "decode_attention", "tokens"))
    if per_token:
        c["ATTENTION_250_TOKENS_US"] = per_token * 250 * 1e6
        c["ATTENTION_MEASURED_TOKENS"] = max(b.params["tokens"] for b in benches if b.group == "decode_attention")
    per_rep = _slope(_pair(benches, "vector", "reps"))
    if per_rep:
        c["VECTOR_OP_US"] = per_rep / 2 * 1e6  # a norm and a gate per repetition
    zero = next((b for b in benches if b.group == "vector" and b.params["reps"] == 0 and b.seconds), None)
    route = next((b for b in benches if b.group == "routing" and b.seconds), None)
    if zero and route:  # the call with no work as the baseline
        c["TOPK_ROUTING_US"] = max(0.0, route.seconds - zero.seconds) * 1e6
    return c
