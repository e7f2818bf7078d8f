"""A generated kernel against the unfused reference, one decode step and one layer at a time.

The kernel runs (in TPU interpret mode on a CPU, or on a TPU) as a debug build that also returns
the values it carries from layer to layer (`build_decode_step(..., layer_trace=True)`). Each layer
of the reference is then fed the *kernel's* carries entering that layer, and the state the kernel
started the step from, so every comparison covers one layer's arithmetic: rounding differences
cannot compound through the stack, and the bounds below hold on any IEEE machine whatever
accumulation order its XLA backend picks.

Numeric contract on both sides: every matmul input rounded to bf16, f32 accumulation, f32
elementwise math. From the same input they agree to f32 rounding (~1e-6 relative) until an f32
difference flips the bf16 rounding of one matmul input: that input moves by one bf16 ulp
(2^-8 relative) and each output of the matmul by ~2^-8 |x_i| |w_ij| (w ~ N(0, 1/fan_in)), a
relative change of ~2^-8 / sqrt(fan_in) of the output's scale per flip. A layer holds up to ~20
bf16-input matmuls in a chain (Kimi K3's KDA + MoE layer), so a flip early in the layer reaches
its output scaled by at most a few units. Hence the bounds, each relative to a scale the layer
itself produces (never to an output that can cancel):

* carries: per row, max |kernel - ref| <= CARRY_RTOL x (the row's largest |update| = |ref out -
  carry in| over all carries) + F32_RTOL x (the row's largest |ref out|). CARRY_RTOL = 2^-6: 4
  bf16 ulps of the update's largest entry, room for a few flips each amplified a few times.
* state written by a layer: per entry, |kernel - ref| <= 1 ulp of the state's storage type at |ref|
  + STATE_RTOL x (largest |ref| of its unit). STATE_RTOL = 2^-6 likewise. The unit is the last axis
  (a cache's vector), or the trailing axes the writing op declares (`OpDef.state_unit`): a recurrent
  state's [dk, dv] matrix per head, since S += k uᵀ and a flip in a k or v projection moves every
  entry by ~2^-8 / sqrt(fan_in) of the head's largest |k| |u|, whatever the entry's own row holds
  (Kimi K3 mini: decayed key channels hold rows 0.03% of their head's largest entry; the kernel's
  errors there were 2.13x a per-row bound and 2-4% of the per-head one).
* logits (the epilogue fed the kernel's final carries): per row, max |kernel - ref| <= LOGIT_RTOL
  x (the row's largest |ref logit|) + F32_RTOL x the same. LOGIT_RTOL = 2^-7: the epilogue is one
  norm and one matmul, so only the flips of the head's input count.
* F32_RTOL = 2^-16: a floor of f32 accumulation-order noise (~sqrt(n) ulps of 2^-24 for n <= 10^5
  terms is < 2^-15 at worst; 2^-16 covers the typical case and is far below every bound above),
  needed where an update is exactly zero (a carry a layer passes through unchanged).
* Observed (AMD EPYC, tests/test_kernel_interpret.py's 10 Hypothesis models and Llama mini, Kimi
  K3 mini sharded at batch 1 and 4): worst carries 19% of the bound (Kimi, batch 4; 14% in the
  Hypothesis models), states 12%, logits < 1%: a margin of 5x. A bug of 5% in one sublayer (tests/test_verify.py) exceeds the bound 2-3x.
* greedy tokens: the kernel's token is the first argmax of its own logits (exact), and equals the
  reference's unless the two are a near tie: the reference scores the kernel's token within
  2 x the logit bound of its maximum.

Discrete choices. A top-k routing (`route`) whose k-th choice and runner-up differ by less than
ROUTE_TIE may go either way under the rounding differences above; a row that fails a bound in a
layer with such a near tie is compared again with the reference taking the runner-up there
(ROUTE_TIE = 2^-8: router scores from the same input differ by ~2^-8 / sqrt(fan_in) per flip, far
below it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import numpy as np

from mkdsl.lang.ir import Model
from mkdsl.lang.quant import QTensor
from mkdsl.lazy import jax, jnp
from mkdsl.ops import OPS
from mkdsl.run.reference import LayeredReference, build_layered_reference, run_layer

CARRY_RTOL = 2.0**-6
STATE_RTOL = 2.0**-6
LOGIT_RTOL = 2.0**-7
F32_RTOL = 2.0**-16
ROUTE_TIE = 2.0**-8


def interpret_params():
    """TPU interpret mode with the race detector on, NaN-filled fresh memory, OOB reads raising."""
    from mkdsl.backends.tpu.interpret import interpret_params as params

    return params(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise")


def races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    return bool(ipc.races is not None and ipc.races.races_found)


# ---------------------------------------------------------------------------- results


@dataclasses.dataclass
class StepCheck:
    """What one checked step found: worst error / bound per item, failures, routings taken."""

    worst: dict[str, float] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    runner_ups: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (layer, row)

    def note(self, item: str, ratio: float) -> None:
        self.worst[item] = max(self.worst.get(item, 0.0), float(ratio))

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclasses.dataclass
class KernelOutput:
    logits: np.ndarray
    next_tokens: np.ndarray
    state: dict[str, np.ndarray]
    trace: dict[str, np.ndarray]  # carry name -> [layers + 1, batch, width]
    device: dict = dataclasses.field(default_factory=dict)  # next tokens and state as jax arrays, per device


def storage_ulp(x: np.ndarray, dtype) -> np.ndarray:
    """The spacing of `dtype` numbers at |x| (bf16: 8 significant bits, f32: 24)."""
    bits = 8 if np.dtype(dtype).itemsize == 2 else 24
    e = np.floor(np.log2(np.maximum(np.abs(x), np.finfo(np.float32).tiny)))
    return np.exp2(e - (bits - 1))


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


# ---------------------------------------------------------------------------- the checker


class LayerChecker:
    """Checks kernel outputs of one model layer by layer against its reference."""

    def __init__(self, model: Model, reference: LayeredReference | None = None, rows: int = 1):
        from mkdsl.run.rows import build_layered_verify, run_verify_layer

        self.model, self.rows = model, rows  # rows: verify rows per sequence (tokens [B, R])
        self.ref = reference or (build_layered_reference(model) if rows == 1 else build_layered_verify(model))
        self.run_layer = run_layer if rows == 1 else run_verify_layer
        self.carry_names = [v.name for v in model.kinds[0].params]
        # the step's token a function of its logits alone (an argmax): then the kernel's token is the
        # first argmax of its own logits; a drafter's (`markov_argmax`) also reads tokens and weights
        step, (logits, token) = model.step, model.step.results[:2]
        made = next((n for n in step.nodes if any(v.name == token.name for v in n.outputs)), None)
        self.own_argmax = made is not None and tuple(r.name for r in made.inputs) == (logits.name,)
        self.units = state_units(model)

    def check(self, weights: dict, state: dict, tokens, positions, out: KernelOutput) -> StepCheck:
        """Compare one kernel step (`out`) with the reference fed the same state and carries."""
        result = StepCheck()
        ref_w = {k: v if isinstance(v, QTensor) else jnp.asarray(v) for k, v in weights.items()}
        ref_s = {k: jnp.asarray(v) for k, v in state.items()}
        args = (ref_w, ref_s, jnp.asarray(tokens), jnp.asarray(positions))
        if self.rows > 1:  # compared row by row: kernel row b * R + r
            flat = out.logits.reshape(-1, out.logits.shape[-1])
            out = dataclasses.replace(out, logits=flat, next_tokens=out.next_tokens.reshape(-1))
        for name, t in out.trace.items():
            if not np.isfinite(t).all():
                result.failures.append(f"non-finite values in the `{name}` the kernel carries between layers")
        if result.failures:
            return result
        first = [_f32(c) for c in self.ref.prologue(*args)]
        carries_in = self._kernel_carries(out, 0)
        self._check_carries(result, "prologue", first, carries_in, [np.zeros_like(c) for c in first])
        for index in range(len(self.model.schedule)):
            self._check_layer(result, index, args, out)
        logits, next_tokens = self.ref.epilogue(*args, self._kernel_carries(out, len(self.model.schedule)))
        self._check_logits(result, np.asarray(logits), np.asarray(next_tokens), out)
        return result

    def _kernel_carries(self, out: KernelOutput, entry: int) -> list[np.ndarray]:
        return [out.trace[name][entry] for name in self.carry_names]

    def _check_layer(self, result: StepCheck, index: int, args, out: KernelOutput) -> None:
        where = f"layer {index} ({self.model.schedule[index]})"
        carries_in = self._kernel_carries(out, index)
        carries_out, ref_state = self.ref.layer(index, *args, [jnp.asarray(c) for c in carries_in])
        want = self._kernel_carries(out, index + 1)
        bad = self._row_errors(index, [_f32(c) for c in carries_out], want, carries_in, ref_state, out)
        for b in np.flatnonzero(bad.max(axis=0) > 1):
            alt = self._runner_up(index, args, carries_in, b)
            if alt is not None:
                alt_bad = self._row_errors(index, alt[0], want, carries_in, alt[1], out)
                if alt_bad[:, b].max() <= 1:
                    result.runner_ups.append((index, int(b)))
                    bad[:, b] = alt_bad[:, b]
        items = ["carries", *self._states_of(index)]
        for item, ratios in zip(items, bad, strict=True):
            result.note(item if item == "carries" else f"state {item}", ratios.max())
            for b in np.flatnonzero(ratios > 1):
                result.failures.append(f"{where}: row {b}: {item} off by {ratios[b]:.2f}x the bound")

    def _states_of(self, index: int) -> list[str]:
        return [t.name for t in self.model.states if t.stacked and t.slots[index] >= 0]

    def _row_errors(self, index, ref_carries, want, carries_in, ref_state, out) -> np.ndarray:
        """[1 + states, batch]: each row's worst error / bound in the carries and each state written."""
        rows = [self._carry_ratio(ref_carries, want, carries_in)]
        for name in self._states_of(index):
            t = self.model.tensor(name)
            unit = self.units.get(name, 1)
            ratio = state_ratio(
                _f32(ref_state[name][t.slots[index]]),
                _f32(out.state[name][t.slots[index]]),
                out.state[name].dtype,
                unit,
            )
            if self.model.dims[0].name not in t.type.shape:  # no row axis (a drafter's slot cache): every row's
                rows.append(np.full(len(rows[0]), ratio.max()))
            else:
                rows.append(np.repeat(ratio, len(rows[0]) // len(ratio)))  # a cache's sequence: all its verify rows
        return np.stack(rows)

    @staticmethod
    def _carry_ratio(ref: list, got: list, carries_in: list) -> np.ndarray:
        update = np.max([np.abs(r - i).max(axis=-1) for r, i in zip(ref, carries_in)], axis=0)
        scale = np.max([np.abs(r).max(axis=-1) for r in ref], axis=0)
        err = np.max([np.abs(g - r).max(axis=-1) for g, r in zip(got, ref)], axis=0)
        return err / (CARRY_RTOL * update + F32_RTOL * scale + np.finfo(np.float32).tiny)

    def _check_carries(self, result: StepCheck, where: str, ref, got, carries_in) -> None:
        ratios = self._carry_ratio(ref, got, carries_in)
        result.note("carries", ratios.max())
        for b in np.flatnonzero(~(ratios <= 1)):
            result.failures.append(f"{where}: row {b}: carries off by {ratios[b]:.2f}x the bound")

    def _runner_up(self, index: int, args, carries_in, row: int):
        """The layer with `row` taking the runner-up at its nearest tie (each op's `OpDef.near_tie`), if one is < ROUTE_TIE."""
        graph = self.model.kind(self.model.schedule[index])
        if not any(OPS[n.op].near_tie for n in graph.nodes):
            return None
        flipped: list[bool] = []
        originals = {n.op: OPS[n.op] for n in graph.nodes if OPS[n.op].near_tie is not None}
        for name, op in originals.items():
            OPS[name] = dataclasses.replace(op, reference=op.near_tie(row, ROUTE_TIE, flipped))
        try:
            carries, state = self.run_layer(self.model, index, *args, [jnp.asarray(c) for c in carries_in])
        finally:
            OPS.update(originals)
        return ([_f32(c) for c in carries], state) if flipped else None

    def _check_logits(self, result: StepCheck, ref_logits, ref_next, out: KernelOutput) -> None:
        logits = out.logits
        if logits.shape != ref_logits.shape or not np.isfinite(logits).all():
            result.failures.append(f"logits: shape {logits.shape} or non-finite values")
            return
        scale = np.abs(ref_logits).max(axis=-1)
        bound = (LOGIT_RTOL + F32_RTOL) * scale
        ratios = np.abs(logits - ref_logits).max(axis=-1) / bound
        result.note("logits", ratios.max())
        for b in np.flatnonzero(~(ratios <= 1)):
            result.failures.append(f"epilogue: row {b}: logits off by {ratios[b]:.2f}x the bound")
        if self.own_argmax and not np.array_equal(out.next_tokens, logits.argmax(axis=-1)):
            result.failures.append("next tokens are not the first argmax of the kernel's own logits")
        for b in np.flatnonzero(out.next_tokens != ref_next):
            got, best = ref_logits[b, out.next_tokens[b]], ref_logits[b].max()
            if got < best - 2 * bound[b]:
                result.failures.append(
                    f"row {b}: kernel token {out.next_tokens[b]} but the reference's {ref_next[b]} is no near tie"
                )


def state_units(model: Model) -> dict[str, int]:
    """Each state's error unit (the module docstring): the trailing axes its writer declares."""
    units: dict[str, int] = {}
    for graph in [*model.kinds, model.step]:
        for node in graph.nodes:
            unit = OPS[node.op].state_unit if node.op in OPS else 1  # `layers`: the stack, no op
            for name in node.writes:
                units[name] = max(units.get(name, 1), unit)
    return units


def state_ratio(ref: np.ndarray, got: np.ndarray, dtype, unit: int = 1) -> np.ndarray:
    """Each row's worst error / bound in one layer slot of a state tensor ([batch, ..., unit]):
    the scale is the largest |ref| over the `unit` trailing axes (the module docstring); an
    integer state (a drafter's slot positions) must be exact (ratio 0 or inf)."""
    scale = np.abs(ref).max(axis=tuple(range(-unit, 0)), keepdims=True)
    bound = storage_ulp(ref, dtype) + STATE_RTOL * scale + np.finfo(np.float32).tiny
    ratio = np.abs(got - ref) / bound
    if np.issubdtype(np.dtype(dtype), np.integer):
        ratio = np.where(got == ref, 0.0, np.inf)
    ratio = np.where(np.isfinite(got), ratio, np.inf)
    return ratio.reshape(ratio.shape[0], -1).max(axis=1)


def run_kernel(
    step: Callable, weights: dict, state: dict, tokens, positions, sharded: bool, pad: Callable = dict
) -> KernelOutput:
    """One step of a `layer_trace=True` build, on host copies (the kernel donates its state).
    `pad`: the module's `pad_weights` where it stores some matrices padded."""
    from mkdsl.backends.tpu.interpret import use_fast_interpreter
    from mkdsl.run.random_params import kernel_weights

    use_fast_interpreter()  # the step may have been built with params not from `interpret_params()`
    kw = {k: jnp.asarray(v) for k, v in pad(kernel_weights(weights)).items()}
    ks = {k: jnp.asarray(v) for k, v in state.items()}
    logits, next_tokens, new_state, trace = step(kw, ks, jnp.asarray(tokens), jnp.asarray(positions))
    logits = np.asarray(jax.block_until_ready(logits))
    return KernelOutput(
        logits,
        np.asarray(next_tokens),
        {k: np.asarray(v) for k, v in new_state.items()},
        {k: np.asarray(v) for k, v in trace.items()},
        {"next tokens": next_tokens, **new_state},
    )


# ---------------------------------------------------------------------------- `mkdsl verify`


@dataclasses.dataclass
class BatchResult:
    batch: int
    steps: int
    worst: dict[str, float]
    failures: list[str]
    seconds: float
    rows: int = 1  # verify rows per sequence
    note: str = ""  # where the rows start, when chosen to cross a window


@dataclasses.dataclass
class CompileResult:
    topology: str
    batch: int
    compiler_vmem: float | None  # bytes, None when not measured
    planner_vmem: int
    seconds: float
    error: str | None = None
    internal: bool = False  # libtpu rejected the kernel (mosaic_errors.KernelCompileError): exit 3


def import_generated(text: str, directory, name: str) -> ModuleType:
    """Write a generated module's text into `directory` and import it under `name`."""
    import importlib.util
    from pathlib import Path

    path = Path(directory) / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"{name}_{id(path)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_seq_len(module) -> int:
    """A cache of two KV tiles (a step can cross a tile boundary), or one if the spec allows no more."""
    tile, high = module.KV_TILE, module.SEQ_RANGE[1]
    return max(tile, min(2 * tile, high // tile * tile))


def smallest_window(model) -> tuple[int, int] | None:
    """(tokens, spec line) of the smallest attention window or chunk of any layer kind (an op's
    `window` or `chunk`: both drop the earlier tokens at a boundary the steps should cross)."""
    found = [
        (n.attr[key], n.span.line)
        for g in model.kinds
        for n in g.nodes
        for key in ("window", "chunk")
        if isinstance(n.attr.get(key), int) and n.attr[key] > 0
    ]
    return min(found) if found else None


def start_positions(model, batch: int, steps: int, seq_len: int) -> tuple[np.ndarray, str]:
    """Each row's first position, and a note when chosen for the spec's smallest window: row b at
    3b, or, where a window fits the cache, at W - 1 + 3b, so that the steps cross the window (row
    0's second step is the first that drops a token) instead of staying inside it."""
    rows = np.arange(batch) * 3
    window = smallest_window(model)
    if window is not None and 1 < steps and window[0] - 1 + rows[-1] + steps <= seq_len:
        w, line = window
        note = (
            f"rows start at position {w - 1} + 3b: the steps cross the smallest window or chunk ({w} tokens, "
            f"spec line {line})"
        )
        return (w - 1 + rows).astype(np.int32), note
    return (rows % (seq_len - steps)).astype(np.int32), ""


def check_batch(
    model, module, checker, batch: int, steps: int, seed: int, progress=None, interpret=None, load=None, rows: int = 1
) -> BatchResult:
    """`steps` decode steps of the kernel in TPU interpret mode, each checked layer by layer.
    `interpret`: other `InterpretParams` than `interpret_params()` (e.g. without the race detector).
    `load`: what the random weights pass through first (a test's checkpoint round trip).
    `rows=R` > 1: verify steps of R rows per sequence (the checker built with the same `rows`),
    random drafts, each step committed at a random accepted length (`verify_accept`)."""
    import time

    from mkdsl.run.random_params import random_params
    from mkdsl.run.rows import verify_state

    seq_len = check_seq_len(module)
    weights, state = random_params(model, {"B": batch, "S": seq_len}, seed)
    state = {k: np.asarray(v) for k, v in verify_state(model, state, rows).items()} if rows > 1 else state
    weights = load(weights) if load is not None else weights
    from mkdsl.lang.elaborate import graph_value_type

    vocab = graph_value_type(model.step, model.step.results[0]).shape[1]  # the logits' width
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, batch * rows).astype(np.int32).reshape(batch, rows)
    start, note = start_positions(model, batch, steps * rows + rows - 1, seq_len)
    positions = start[:, None] + np.arange(rows, dtype=np.int32)
    tokens, positions = (tokens[:, 0], positions[:, 0]) if rows == 1 else (tokens, positions)
    options = {"verify_rows": rows} if rows > 1 else {}
    step = module.build_decode_step(
        batch, seq_len, interpret=interpret or interpret_params(), layer_trace=True, **options
    )
    result = BatchResult(batch, steps, {}, [], 0.0, rows, note)
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    t0 = time.perf_counter()
    for i in range(steps):
        pad = getattr(module, "pad_weights", dict)
        out = run_kernel(step, weights, state, tokens, positions, hasattr(module, "MESH_SHAPE"), pad)
        if races_found():
            result.failures.append(f"step {i}: the interpreter's race detector reported a race")
        check = checker.check(weights, state, tokens, positions, out)
        for item, ratio in check.worst.items():
            result.worst[item] = max(result.worst.get(item, 0.0), ratio)
        result.failures += [f"step {i}: {f}" for f in check.failures]
        if rows == 1:
            state, tokens, positions = out.state, out.next_tokens.astype(np.int32), positions + 1
        else:
            state, tokens, positions = verify_accept(module, out, positions, rng, vocab)
        if progress is not None:
            progress.update(1)
        if result.failures:
            break
    result.seconds = time.perf_counter() - t0
    return result


def verify_accept(module, out: KernelOutput, positions, rng, vocab: int):
    """After a checked verify step: a random accepted length per sequence (1..R), the state
    committed there (the module's `commit`), and the next step's rows: the target's token after
    the last accepted row, then random drafts."""
    batch, rows = positions.shape
    accepted = rng.integers(1, rows + 1, batch).astype(np.int32)
    state = {k: np.asarray(v) for k, v in module.commit(out.state, accepted).items()}
    tokens = rng.integers(0, vocab, (batch, rows)).astype(np.int32)
    tokens[:, 0] = out.next_tokens.reshape(batch, rows)[np.arange(batch), accepted - 1]
    return state, tokens, positions + accepted[:, None]


def compile_check(module, plan_vmem: int, batch: int, fresh: Callable[[], ModuleType], rows: int = 1) -> CompileResult:
    """The kernel compiled by libtpu for its TPU7x topology (`rows` verify rows per sequence), and
    the compiler's VMEM beside the plan's."""
    from mkdsl.backends.tpu import libtpu as tpu_compile
    from mkdsl.backends.tpu.mosaic_errors import KernelCompileError

    topology = tpu_compile.topology_for(module)
    seq_len = check_seq_len(module)
    try:
        devices = tpu_compile.tpu7x_devices(topology)
        _, seconds = tpu_compile.compile_module(module, devices, batch, seq_len, rows)
        limit = min(tpu_compile.TINY_LIMIT, plan_vmem // 4 // 4096 * 4096)  # well below what the kernel needs
        used, _ = tpu_compile.compiler_vmem(
            fresh(), lambda m: tpu_compile.compile_module(m, devices, batch, seq_len, rows), limit
        )
    except KernelCompileError as e:  # a kernel libtpu rejects: mkdsl's internal compiler error
        return CompileResult(topology, batch, None, plan_vmem, 0.0, str(e), internal=True)
    except Exception as e:  # the compiler's verdict, reported as the check's result
        return CompileResult(topology, batch, None, plan_vmem, 0.0, f"{type(e).__name__}: {str(e)[:2000]}")
    return CompileResult(topology, batch, used, plan_vmem, seconds)


def summary_table(batches: list[BatchResult], compiled: CompileResult | None) -> str:
    """The plain-text summary `mkdsl verify` prints."""
    lines = ["check                      result  worst error / bound"]
    for b in batches:
        worst = ", ".join(f"{k} {v:.1%}" for k, v in sorted(b.worst.items()))
        verdict = "FAIL" if b.failures else "ok"
        rows = f" x {b.rows} verify rows" if b.rows > 1 else ""
        lines.append(f"interpret batch {b.batch}{rows}, {b.steps} steps  {verdict:<6}  {worst} ({b.seconds:.0f} s)")
        lines += [f"    {b.note}"] if b.note else []
        lines += [f"    {f}" for f in b.failures[:10]]
    if compiled is not None:
        if compiled.error:
            lines.append(f"libtpu {compiled.topology} batch {compiled.batch}  FAIL    {compiled.error.splitlines()[0]}")
        else:
            used = compiled.compiler_vmem / 2**20
            plan = compiled.planner_vmem / 2**20
            lines.append(
                f"libtpu {compiled.topology} batch {compiled.batch}  ok      compiler VMEM {used:.2f} MiB per core, "
                f"planner {plan:.2f} MiB ({compiled.seconds:.0f} s)"
            )
    return "\n".join(lines)
