"""`load_weights`: a checkpoint's tensors in the spec's layout and dtype, placed on the devices.

Two passes. The plan reads only the checkpoint's header: every tensor each weight needs must
exist with a shape the mapping turns into the spec's, and a type that converts into the spec's
dtype exactly, or a mapping that accepts rounding (`| round`). Every mistake is collected and
reported together before any data is read, so nothing is half-loaded. The load then builds one
spec weight at a time on the host (one stacked array: peak host memory is about the largest
weight plus one stored tensor), places it and frees it; for a sharded kernel it builds one
device's shard at a time instead (`shards.py`), so the host holds one shard, not the weight.

Exact conversions: the same type, f16/bf16 to f32, and GGUF block formats (decoded in f32 as
llama.cpp does) to f32. Anything else into bf16 (f32, f16, Q8_0, Q4_1) rounds to nearest even;
the mapping must say `| round`, and the report counts the rounded tensors by stored type.
A quantised weight comes from a stored `codes * scales` pair (`pairs.PAIRS`): its codes and
scales are moved by the steps and re-packed into the spec's storage, bit for bit; decoded into a
plain dtype, an fp8 pair rounds (`round`, counted as `F8_E4M3*F32`) and an MXFP4 one does not.
A stored tensor that feeds two weights (gpt-oss's fused gate_up) is read once for each.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mkdsl.checkpoint.formats import CheckpointError, Stored, exact, open_checkpoint
from mkdsl.checkpoint.mapping import FORMATS, WeightSource, apply_pair, apply_steps, mapped_grid, mapped_shape
from mkdsl.checkpoint.pairs import BLOCKS, PAIRS, STORAGE, PairKind, pair_kind, target_groups
from mkdsl.checkpoint.steps import Grid
from mkdsl.lang.dtypes import numpy_dtype, storage
from mkdsl.lang.ir import Model, Tensor
from mkdsl.lang.quant import QTensor, from_storage, storage_arrays

MAX_REPORTED = 12  # mistakes listed in one error (the rest are counted)


@dataclass(frozen=True)
class PairPlan:
    """How a stored `codes * scales` pair becomes a weight: its kind, the grid after the steps
    and what each step does to the scales (`mapping.mapped_grid`)."""

    kind: PairKind
    grid: Grid
    moves: tuple


@dataclass(frozen=True)
class QuantisePlan:
    """A plain stored tensor read into a quantised weight (`quantise.py`): exactly, or rounded
    where the source says `round`."""

    rounds: bool


@dataclass(frozen=True)
class Piece:
    """One slice of a spec weight (a layer's, an expert's) and the stored tensors it is made of."""

    index: tuple[int, ...]  # into the spec weight's full shape
    names: tuple[str, ...]  # a pair: the codes', then the scales'
    pair: PairPlan | QuantisePlan | None = None


@dataclass(frozen=True)
class WeightPlan:
    tensor: Tensor
    source: WeightSource
    pieces: tuple[Piece, ...]
    rounded: tuple[str, ...]  # stored types that round into the spec's dtype


@dataclass
class LoadReport:
    format: str
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bytes_read: int = 0  # from the files, by this process
    rounded: Counter = field(default_factory=Counter)  # stored type -> tensors rounded
    target: dict = field(default_factory=dict)  # stored type -> spec dtype it rounded into
    seen: set = field(default_factory=set, repr=False)  # stored tensors read (one may feed two weights)
    check_finite: bool = False  # refuse a stored tensor holding NaN or inf (load_weights(check_finite=True))

    def read(self, names) -> int:
        """Count the stored tensors read for the first time; how many."""
        new = set(names) - self.seen
        self.seen |= new
        self.tensors += len(new)
        return len(new)

    def summary(self) -> str:
        line = f"loaded {self.tensors} tensors ({self.bytes / 2**20:.1f} MiB) in {self.seconds:.1f} s"
        if self.rounded:
            parts = ", ".join(f"{n} {t} -> {self.target[t]}" for t, n in sorted(self.rounded.items()))
            line += f"; rounded to nearest (the mapping says `round`): {parts}"
        return line


def load_weights(
    model, path, *, module=None, mesh=None, progress: bool = True, host: bool = False, check_finite: bool = False
):
    """(weights, report): the checkpoint at `path` (safetensors file, index or directory; GGUF;
    or a reader from `formats.open_checkpoint`)
    as `model`'s weights (a `mkdsl.Spec` or a `Model`), by the spec's mapping for that format.

    `module`: the generated kernel module: each weight is laid out as it says (a quantised `w`
    as `w_codes` and `w_scales`, padded as its `pad_weights` pads) and, for a sharded one, placed
    on `mesh` (default `module.make_mesh()`) by its `weight_shardings`, one device's shard at a
    time. `host=True` returns numpy arrays in the spec's (and the reference's) layout, a
    quantised weight as a `QTensor`. `check_finite=True` refuses (CheckpointError) a stored tensor
    holding a NaN or an infinity, naming it (a NaN weight otherwise loads: its NaN logits are
    never chosen, see `sample_tokens`).
    Raises `CheckpointError` listing every missing or mismatched tensor before reading any data.
    """
    model = getattr(model, "model", model)
    reader = path if hasattr(path, "info") else open_checkpoint(path)  # an open reader is reused
    plans = plan_load(model, reader)
    shardings = None
    if module is not None and hasattr(module, "weight_shardings") and not host:
        shardings = module.weight_shardings(mesh or module.make_mesh())
    report = LoadReport(reader.format, check_finite=check_finite)
    t0 = time.perf_counter()
    total = len({n for wp in plans for p in wp.pieces for n in p.names})
    out = {}
    from tqdm import tqdm

    desc, processes = "loading", _processes()
    if processes > 1:  # each process its own bar, counting what it reads (not known before: total unset)
        import jax

        desc, total = f"loading [process {jax.process_index()}/{processes}]", None
    with tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=not progress, leave=False) as bar:
        for wp in plans:
            if shardings is not None:  # one device's shard at a time
                out.update(_place_sharded(wp, reader, report, bar, module, shardings))
            else:
                out.update(_place(_build(wp, reader, report, bar), wp.tensor.name, module, shardings, host))
    report.seconds = time.perf_counter() - t0
    return out, report


def working_set_bound(plans: list[WeightPlan], reader, module=None, shardings=None) -> int:
    """Host bytes a load holds beyond the shards it keeps: the largest stored tensor (read
    whole, or for a sharded piece its rows) three times at f32 (as read, after the steps, and
    converted), plus two device shards (the one built and the last one kept for the devices
    that share it). Each process of a multi-host run holds its share of the weights plus this."""
    largest = 0
    for wp in plans:
        for p in wp.pieces:
            largest = max(largest, sum(4 * int(np.prod(reader.info(n).shape, dtype=np.int64)) for n in p.names))
    shard = 0
    if module is not None and shardings is not None:
        for name, (shape, dtype) in module.WEIGHTS.items():
            local = shardings[name].shard_shape(tuple(shape))
            shard = max(shard, int(np.prod(local, dtype=np.int64)) * numpy_dtype(dtype).itemsize)
    return 3 * largest + 2 * shard


def _processes() -> int:
    """JAX's process count, if JAX is in use (a loader for host arrays need not start it)."""
    jax = sys.modules.get("jax")
    return jax.process_count() if jax is not None else 1


def plan_load(model: Model, reader) -> list[WeightPlan]:
    """What each weight reads, checked against the checkpoint's header; CheckpointError if anything
    is missing or does not fit."""
    ckpt = next((c for c in model.checkpoints if c.format == reader.format), None)
    if ckpt is None:
        have = ", ".join(c.format for c in model.checkpoints) or "none"
        raise CheckpointError(
            f"the spec of {model.name} has no `checkpoint {reader.format}` section ({FORMATS[reader.format]}); "
            f"its sections: {have}"
        )
    problems: list[str] = _layer_count_problems(model, reader)
    plans = [_plan_weight(t, choose_source(t, ckpt.source(t.name), reader), reader, problems) for t in model.weights]
    if problems:
        shown = problems[:MAX_REPORTED]
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise CheckpointError(
            f"the checkpoint does not fit {model.name} ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
            + "\n  ".join(shown)
            + more
        )
    return plans


def _layer_count_problems(model: Model, reader) -> list[str]:
    """A checkpoint with more or fewer layers than the spec (its metadata says how many)."""
    found = None
    if reader.format == "gguf":
        found = reader.metadata(f"{reader.metadata('general.architecture', '')}.block_count")
    else:
        config = reader.root / "config.json"
        if config.exists():
            try:
                found = json.loads(config.read_text()).get("num_hidden_layers")
            except ValueError:
                found = None
    if found is None or int(found) == len(model.schedule):
        return []
    return [f"the checkpoint has {int(found)} layers; the spec has {len(model.schedule)}"]


def choose_source(t: Tensor, src: WeightSource, reader) -> WeightSource:
    """The first of a weight's sources (`or` alternatives) whose first piece's tensors the checkpoint
    holds: the layout of this save. None holds them: the first, whose missing tensors are reported."""
    if not src.alternatives:
        return src
    layer = next((i for i, s in enumerate(t.slots) if s >= 0), None) if t.stacked else None
    first = (0,) * len(src.stack)
    for alt in src.sources:
        if all(reader.info(n) is not None for n in alt.names(layer, first[: len(alt.stack)])):
            return alt
    return src


def _plan_weight(t: Tensor, src: WeightSource, reader, problems: list[str]) -> WeightPlan:
    lead = t.type.shape[: len(src.stack)]
    piece_shape = tuple(t.type.shape[len(src.stack) :])
    layers = [(i, s) for i, s in enumerate(t.slots) if s >= 0] if t.stacked else [(None, None)]
    pieces, rounded, fits = [], set(), {}  # fits: stored shapes and types -> plan (None, or a PairPlan)
    for (layer, slot), idx in itertools.product(layers, itertools.product(*(range(n) for n in lead))):
        names = tuple(src.names(layer, idx))
        infos = [reader.info(n) for n in names]
        missing = [n for n, i in zip(names, infos) if i is None]
        if missing:
            where = _where(t, src, layer)
            problems.append(f"missing tensor `{missing[0]}` for {where}: expected {_expected(t, src, piece_shape)}")
            continue
        key = tuple((i.shape, i.dtype) for i in infos)  # pieces alike in these fit alike
        pair = fits.get(key)
        if key not in fits:
            if src.scales is not None:
                pair = _plan_pair(t, src, infos[0], infos[1], piece_shape, rounded, infos[2:])
                problem = pair if isinstance(pair, str) else None
            elif t.type.dtype.gguf:
                pair = _plan_blocks(t, src, infos, piece_shape)
                problem = pair if isinstance(pair, str) else None
            else:
                problem = _check_piece(t, src, infos, piece_shape, rounded)
                pair = QuantisePlan(src.rounds) if t.type.dtype.quantised else None
            if problem:  # not cached: the message names this piece's tensors
                problems.append(f"{problem} for {_where(t, src, layer)}")
            else:
                fits[key] = pair
        pieces.append(Piece(((slot,) if layer is not None else ()) + idx, names, pair))
    return WeightPlan(t, src, tuple(pieces), tuple(sorted(rounded)))


def _where(t: Tensor, src: WeightSource, layer: int | None) -> str:
    return f"`{t.name}`" + (f" (layer {layer})" if layer is not None else "") + f", spec line {src.span.line}"


def _expected(t: Tensor, src: WeightSource, piece_shape: tuple) -> str:
    if src.scales is None:
        return _shape(piece_shape)
    kinds = [f"{c} * {s}" for (c, s), ks in PAIRS.items() if any(t.type.dtype.fmt in k.formats for k in ks)]
    kinds = kinds or [f"{c} * {s}" for c, s in PAIRS]
    return f"{' or '.join(kinds)} holding {_shape(piece_shape)} values after the steps"


def _check_piece(t: Tensor, src: WeightSource, infos: list[Stored], want: tuple, rounded: set) -> str | None:
    first = infos[0]
    if any(i.shape[1:] != first.shape[1:] or not i.shape for i in infos):
        return f"tensors {', '.join(f'`{i.name}` {_shape(i.shape)}' for i in infos)} cannot be concatenated"
    shape = (sum(i.shape[0] for i in infos), *first.shape[1:]) if len(infos) > 1 else first.shape
    got, why = mapped_shape(shape, src.steps)
    if got is None:
        return f"tensor `{first.name}` is {first.dtype} {_shape(shape)}: {why}; expected {_shape(want)} after the steps"
    if got != want:
        return f"tensor `{first.name}` is {first.dtype} {_shape(shape)}{_after(src, got)}; expected {_shape(want)}"
    target = t.type.dtype
    if target.quantised:  # quantised at load: exact codes are checked as it reads (quantise.py)
        bad = next((i for i in infos if i.dtype not in ("BF16", "F16", "F32")), None)
        return (
            None if bad is None else f"tensor `{bad.name}` is {bad.dtype}; {target} is quantised from BF16, F16 or F32"
        )
    for i in infos:
        if exact(i.dtype, target.numpy):
            continue
        if not src.rounds:
            return (
                f"tensor `{i.name}` is {i.dtype}, which {target} cannot hold exactly "
                f"(expected {_exact_types(target.numpy)}; add `| round` to the mapping to accept rounding)"
            )
        rounded.add(i.dtype)
    return None


def _after(src: WeightSource, got: tuple) -> str:
    steps = " | ".join(str(s) for s in src.steps if s.name != "round")
    return f" (after `{steps}`: {_shape(got)})" if steps else ""


def _plan_pair(t: Tensor, src: WeightSource, codes: Stored, scales: Stored, want: tuple, rounded: set, glob=()):
    """How a `codes * scales` pair (NVFP4: and its global scale) becomes the weight (a PairPlan),
    or what is wrong with it."""
    pair = f"`{codes.name}` {codes.dtype} {_shape(codes.shape)} * `{scales.name}` {scales.dtype} {_shape(scales.shape)}"
    target = t.type.dtype
    kind, grid = pair_kind(codes, scales, target.block)
    if kind is None or (target.quantised and target.fmt not in kind.formats) or (kind.glob and not target.quantised):
        return f"tensors {pair} are not a pair that holds {target} (expected {_expected(t, src, want)})"
    if glob and (glob[0].dtype != "F32" or int(np.prod(glob[0].shape)) != 1):
        g = glob[0]
        return f"tensor `{g.name}` {g.dtype} {_shape(g.shape)} is not a global scale (one F32 value)"
    if isinstance(grid, str):
        return f"tensors {pair}: {grid}; expected {_expected(t, src, want)}"
    out, moves = mapped_grid(grid, src.steps)
    if out is None:
        return f"tensors {pair} ({kind.name}, values {_shape(grid.shape)}): {moves}; expected {_shape(want)} after the steps"
    if out.shape != want:
        return f"tensors {pair} hold values {_shape(grid.shape)}{_after(src, out.shape)}; expected {_shape(want)}"
    if target.quantised and out.groups != target_groups(target, len(want)):
        need = target_groups(target, len(want))
        return (
            f"tensors {pair}: after the steps a scale covers {_shape(out.groups)} values; {target} has {_shape(need)}"
        )
    if not target.quantised and target.numpy not in kind.exact:
        if not src.rounds:
            return (
                f"tensors {pair} ({kind.name}) decode to products {target} cannot hold exactly "
                "(add `| round` to the mapping to accept rounding)"
            )
        rounded.add(f"{codes.dtype}*{scales.dtype}")
    return PairPlan(kind, out, tuple(moves))


def _plan_blocks(t: Tensor, src: WeightSource, infos: list[Stored], want: tuple):
    """How one stored GGUF block tensor becomes a weight kept in its format (a PairPlan whose
    codes and block words the steps move), or what is wrong with it."""
    target = t.type.dtype
    if len(infos) != 1:
        return f"a {target} weight is one stored block tensor, not a concatenation of {len(infos)}"
    i = infos[0]
    kind = BLOCKS.get(i.dtype)
    if kind is None or target.fmt not in kind.formats:
        keeps = [s for s, k in BLOCKS.items() if target.fmt in k.formats]
        return f"tensor `{i.name}` is {i.dtype} {_shape(i.shape)}; the spec's {target} holds {' or '.join(keeps)} as stored"
    grid = kind.grid(i.shape, (), 0)
    if isinstance(grid, str):
        return f"tensor `{i.name}` is {i.dtype}: not {grid}"
    out, moves = mapped_grid(grid, src.steps)
    if out is None:
        return f"tensor `{i.name}` ({kind.name}, values {_shape(grid.shape)}): {moves}; expected {_shape(want)}"
    if out.shape != want or out.groups != target_groups(target, len(want)):
        return (
            f"tensor `{i.name}` is {i.dtype} {_shape(i.shape)}{_after(src, out.shape)}; expected {_shape(want)} "
            f"with its blocks along the input dimension"
        )
    return PairPlan(kind, out, tuple(moves))


def _exact_types(target: str) -> str:
    from mkdsl.checkpoint.formats import EXACT

    names = [s for s, ok in EXACT.items() if target in ok]
    return " or ".join(names) + (" or a GGUF block format" if target == "float32" else "")


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _empty(t: Tensor):
    """The weight's host array(s) to fill: a QTensor for a quantised dtype."""
    dtype = t.type.dtype
    parts = [np.empty(p.shape, numpy_dtype(p.dtype)) for p in storage(dtype, tuple(t.full_shape))]
    return from_storage(dtype, parts) if dtype.quantised else parts[0]


def _build(wp: WeightPlan, reader, report: LoadReport, bar):
    """One spec weight on the host, piece by piece."""
    out = _empty(wp.tensor)
    for p in wp.pieces:
        parts = _piece(wp, p, reader, report, bar)
        if isinstance(out, QTensor):
            out.codes[p.index], out.scales[p.index] = parts[:2]
            if out.glob is not None:
                out.glob[p.index] = parts[2]
            for a, part in zip(out.extra, parts[2:], strict=False):
                a[p.index] = part
        else:
            out[p.index] = parts[0]
    report.bytes += sum(a.nbytes for a in ((*out[:2], *out.extra) if isinstance(out, QTensor) else (out,)))
    return out


def _piece(wp: WeightPlan, p: Piece, reader, report: LoadReport, bar, cut: tuple | None = None) -> tuple:
    """One piece in the spec's dtype: (array,), or a quantised weight's (codes, scales); with
    `cut` (slices of the piece's axes, a single-part piece) only that block, read by offset
    where the stored tensor's rows are the block's rows (see `_rows_read`)."""
    t = wp.tensor
    sliced = _rows_read(wp, p, reader, report, cut) if cut is not None else None
    if sliced is not None:
        x, cut = sliced, None
        if report.check_finite:
            _check_finite(p.names, [x])
    else:
        blocks = isinstance(p.pair, PairPlan) and p.pair.kind in BLOCKS.values()  # a QuantisePlan has no kind
        parts = [_read(reader, n, blocks) for n in p.names]
        report.bytes_read += sum(a.nbytes for a in parts)
        if report.check_finite:
            _check_finite(p.names, parts)
        if p.pair is not None:
            bar.update(report.read(p.names))
            return _pair_piece(p, parts, wp, report)
        x = parts[0] if len(parts) == 1 else np.concatenate([a.astype(np.float32) for a in parts])
    bar.update(report.read(p.names))
    for n in p.names:
        stored = reader.info(n).dtype
        if stored in wp.rounded:
            report.rounded[stored] += 1
            report.target[stored] = str(t.type.dtype)
    if sliced is None:
        x = apply_steps(x, wp.source.steps)
    x = x.astype(numpy_dtype(t.type.dtype.numpy))
    return (x if cut is None else x[cut],)


def _rows_read(wp: WeightPlan, p: Piece, reader, report: LoadReport, cut: tuple) -> np.ndarray | None:
    """The block `cut` of a 2-D piece stored as one plain tensor mapped as is or transposed: the
    stored rows it needs read by offset (`reader.read_rows`), then the steps; None otherwise."""
    steps = tuple(s for s in wp.source.steps if s.name != "round")
    if p.pair is not None or len(p.names) != 1 or len(cut) != 2 or not hasattr(reader, "read_rows"):
        return None
    if [s.name for s in steps] not in ([], ["transpose"]):
        return None
    rows, cols = (cut[0], cut[1]) if not steps else (cut[1], cut[0])
    try:
        x = reader.read_rows(p.names[0], rows.start or 0, rows.stop)
    except Exception as e:  # a damaged file
        raise CheckpointError(f"tensor `{p.names[0]}` cannot be read: {e}") from None
    if x is None:
        return None
    report.bytes_read += x.nbytes
    x = x[:, cols]
    return x.T if steps else x


def _check_finite(names, parts) -> None:
    """CheckpointError naming the first stored tensor with a NaN or an infinity (float data only:
    a quantised pair's codes are integers, its scales are checked)."""
    for name, a in zip(names, parts, strict=True):
        if "float" in a.dtype.name:  # float16/32, bfloat16, float8_*
            bad = int(np.size(a) - np.count_nonzero(np.isfinite(a.astype(np.float32))))
            if bad:
                raise CheckpointError(f"tensor `{name}` holds {bad} non-finite values (NaN or infinity)")


def _read(reader, name: str, blocks: bool = False) -> np.ndarray:
    """One stored tensor's data (`blocks`: a GGUF block tensor's bytes, as stored); a file that
    the header promised more than it holds (truncated, damaged) is a CheckpointError, and what
    was built so far is dropped with the call."""
    try:
        return reader.read_blocks(name) if blocks else reader.read(name)
    except Exception as e:  # safetensors, gguf and numpy each raise their own error types
        raise CheckpointError(f"tensor `{name}` cannot be read: {e}") from None


def _pair_piece(p: Piece, parts: list[np.ndarray], wp: WeightPlan, report: LoadReport) -> tuple:
    """A stored pair's piece: re-packed into the spec's storage, or decoded into its plain dtype
    (a global scale, NVFP4's, is one more storage part, `[1, 1]`; a GGUF block tensor is one
    stored tensor holding both codes and scales)."""
    dtype = wp.tensor.type.dtype
    if isinstance(p.pair, QuantisePlan):
        return _quantised_piece(p, parts, wp, report)
    kind = p.pair.kind
    if len(parts) == 1:
        codes, scales = kind.unpack(parts[0])
    else:
        codes, scales = kind.unpack(parts[0]), parts[1]
        if kind.scales_like_codes:
            scales = scales.reshape(parts[0].shape)
    elements, scales = apply_pair(codes, scales, wp.source.steps, p.pair.moves)
    if dtype.quantised:
        glob = tuple(np.asarray(g, np.float32).reshape(1, 1) for g in parts[2:])
        return (*STORAGE[dtype.name](elements, scales), *glob)
    key = next((n for n in wp.rounded if "*" in n), None)
    if key is not None:
        report.rounded[key] += 1
        report.target[key] = str(dtype)
    return (kind.decode(elements, scales, p.pair.grid).astype(numpy_dtype(dtype.numpy)),)


def _quantised_piece(p: Piece, parts: list[np.ndarray], wp: WeightPlan, report: LoadReport) -> tuple:
    """A plain stored piece (one tensor, or a concatenation) quantised into the spec's storage."""
    from mkdsl.checkpoint.quantise import quantise

    x = parts[0] if len(parts) == 1 else np.concatenate(parts)
    x = apply_steps(x.astype(np.float32), wp.source.steps)
    try:
        out, rounded = quantise(wp.tensor.type.dtype, x, p.pair.rounds, p.names[0])
    except ValueError as e:
        raise CheckpointError(f"{e} (for `{wp.tensor.name}`, spec line {wp.source.span.line})") from None
    if rounded:
        stored = "->".join(dict.fromkeys(str(a.dtype) for a in parts))
        key = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(stored, stored)
        report.rounded[key] += 1
        report.target[key] = str(wp.tensor.type.dtype)
    return out


def _place_sharded(wp: WeightPlan, reader, report: LoadReport, bar, module, shardings) -> dict:
    from mkdsl.checkpoint.shards import place_sharded

    lead = len(wp.pieces[0].index) if wp.pieces else 0
    pieces = {p.index: p for p in wp.pieces}
    out = place_sharded(
        wp.tensor, pieces, lead, lambda p, cut=None: _piece(wp, p, reader, report, bar, cut), module, shardings
    )
    report.bytes += sum(a.nbytes for a in out.values())
    return out


def _place(x, name: str, module, shardings, host: bool) -> dict:
    """On the device(s), in the module's layout (`pad_weights`: matrices padded to whole tiles;
    a quantised `w` as `w_codes` and `w_scales`)."""
    if host:
        return {name: x}
    import jax

    parts = storage_arrays(name, x) if isinstance(x, QTensor) else {name: x}
    pad = getattr(module, "pad_weights", None)
    if pad is not None:
        parts = pad(parts)
    return {
        n: jax.device_put(a, shardings[n]) if shardings is not None else jax.device_put(a) for n, a in parts.items()
    }
