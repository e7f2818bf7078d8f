"""A spec against the model's own implementation: `mkdsl verify SPEC --against transformers`.

The kernel-vs-reference check (mkdsl/verify/kernel.py) proves the compiler; this proves the spec.
From the spec's `checkpoint hf` section (its `config { architecture = ... }` names the
transformers class and the config.json fields, sized by the spec's constants and profile) it
builds the transformers model with random weights — every parameter random, norm gains, biases,
sinks and router biases included, so that an off-by-one form (`w` for `1 + w`) shows — rounded
to bf16 values, saves it as safetensors, loads that file through the spec's own mapping, and
compares:

* per layer, isolated (`LAYER_RTOL`): each layer of the spec's prefill over the prompt, and of
  each decode step after it, is fed the hidden states transformers has entering that layer; its
  output is compared to transformers' output of the same layer, so differences cannot compound
  through the stack. The first layer that differs is named, and inside it the first op: the
  first op (in spec order) whose value matches no intermediate transformers computes, of the
  width of the first transformers module output that no spec value matches.
* the epilogue, fed transformers' last hidden state: logits within `LOGIT_RTOL`.
* greedy tokens: the spec's prefill and decode steps run free (no feeding); transformers, teacher
  forced on the same tokens, must pick the same token at each position unless the spec's token
  scores within `TIE_RTOL` of its best, or the spec's run routed a row by a near tie (ROUTE_TIE)
  at or before that token (near ties, reported and not failed).

An architecture transformers lacks may be one of mkdsl's stand-ins (`STAND_INS`: built from
transformers' modules, saved in the spec's published layout); the spec's residual-stream ops that
the stand-in has no counterpart for are replaced by the plain residual add (`plain_residual`).
A stand-in whose step is no prefill and decode steps (a block drafter's, reading a context) brings
its own `compare`, which runs its steps with this module's pieces and bounds
(mkdsl/verify/draft_step.py).

Bounds (the numeric contract, docs/language.md): the spec rounds every matmul input to bf16
(2^-9 relative at most, half a bf16 ulp) and stores bf16 caches; transformers, run here in f32 on
the same bf16 weights, rounds nothing. One rounded input moves a matmul's output by ~2^-9 of its
scale (random signs: sqrt(n) terms of 2^-9 |x||w| against an output of sqrt(n) |x||w|). A layer
whose ops read n weights or states (a matmul-like chain of at most n rounded inputs) is therefore
within n x 2^-9 of the row's largest update (|out - in|), summed linearly as a worst case:
LAYER_RTOL = 2^-9 per such op; F32_RTOL covers f32 accumulation order where an update is 0.
A routing near tie (an op's `OpDef.near_tie` within ROUTE_TIE) may pick another expert: a row
that fails in such a layer (a prefill row or a decode step's) is run again with the runner-up
(a prefill row alone, from the choosing op on: mkdsl/verify/row_replay.py; a decode row from
the same state), and passes as a reported near tie. A row that still fails may be
ill-conditioned: the premise above (one rounding moves the update by 2^-9 of its scale) fails
where the layer cancels and then normalises (Qwen3-Next's delta-rule read-out with q.k near 0,
before its gated norm). The layer is run once more with its input moved by one rounding's size
(`sensitivity`); a row that this moves by more than the premise passes, reported, within its
usual bound plus that measured move (`_ill_conditioned`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mkdsl.lang.ir import Graph, Model
from mkdsl.lazy import jnp
from mkdsl.ops import OPS
from mkdsl.verify.oracle_trace import HFTrace, hf_trace, mk_op_values, zero_state
from mkdsl.verify.plain_residual import plain_residual_model, replaced_ops

ROUNDING = 2.0**-9  # one bf16-rounded matmul input, relative to the output's scale
F32_RTOL = 2.0**-16  # f32 accumulation-order noise (as mkdsl/verify/kernel.py)
LOGIT_RTOL = 4 * ROUNDING  # the epilogue: a norm and one matmul, room for a few flips
TIE_RTOL = 2.0**-5  # of the largest logit: a greedy choice this close after the whole stack is a near tie
ROUTE_TIE = 2.0**-6  # a routing near tie: 4x the kernel check's 2^-8, as no matmul input is rounded here


class OracleError(Exception):
    """The spec cannot be compared (no mapping, no architecture, transformers missing)."""


@dataclass
class OracleReport:
    spec: str
    architecture: str
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    ties: list[str] = field(default_factory=list)
    worst: dict[str, float] = field(default_factory=dict)  # check -> largest error / bound

    def note(self, what: str, ratio: float) -> None:
        self.worst[what] = max(self.worst.get(what, 0.0), float(ratio))

    @property
    def ok(self) -> bool:
        return not self.failures

    def text(self) -> str:
        rows = [f"{self.spec}: against transformers {self.architecture}"]
        rows += [f"  {line}" for line in self.lines]
        rows += [f"  worst {k}: {v:.3f} of the bound" for k, v in sorted(self.worst.items())]
        rows += [f"  near tie (not failed): {t}" for t in self.ties]
        rows += [f"  FAILED: {f}" for f in self.failures]
        return "\n".join(rows)


def hf_map(model: Model):
    cmap = next((c for c in model.checkpoints if c.format == "hf"), None)
    if cmap is None:
        raise OracleError(f"`{model.name}` has no `checkpoint hf` section: nothing says how transformers stores it")
    if cmap.architecture is None:
        raise OracleError(
            f'`{model.name}`\'s `checkpoint hf` has no `config {{ architecture = "..." }}`: '
            "the transformers class and its config fields are needed"
        )
    return cmap


def import_transformers():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise OracleError(f"{e}: install the oracle extra (pip install -e '.[oracle]')") from None
    return torch, transformers


# Architectures transformers has no class for, built by mkdsl from transformers' modules: the
# module that builds, saves and reloads each (its docstring says what it configures or replaces).
# A stand-in whose step is not a prefill and decode steps (a block drafter's step reading a
# context) also has `compare`, run in place of this module's (`compare`'s arguments).
STAND_INS = {"KimiK3ForCausalLM": "mkdsl.verify.kimi_k3", "KimiK3DSparkForCausalLM": "mkdsl.verify.dspark"}


def stand_in(architecture: str | None):
    """The stand-in module of `architecture`, or None for a transformers class."""
    import importlib

    name = STAND_INS.get(architecture or "")
    return importlib.import_module(name) if name else None


def build_hf_model(model: Model, seed: int):
    """The transformers model of the spec's mapping, every parameter random (bf16 values), f32."""
    torch, transformers = import_transformers()
    cmap = hf_map(model)
    torch.manual_seed(seed)
    if (built := stand_in(cmap.architecture)) is not None:
        hf = built.build(model, cmap.config())
    else:
        cls = getattr(transformers, cmap.architecture, None)
        if cls is None:
            raise OracleError(f"transformers {transformers.__version__} has no class `{cmap.architecture}`")
        config = cls.config_class(**cmap.config())
        config._attn_implementation = "eager"
        hf = cls(config).eval().to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(hf.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:  # gains, biases, sinks, decays: their init moved by a random amount
                p.copy_(p + 0.1 * noise)
            else:  # matrices ~ N(0, 1/fan_in): activations stay O(1) through the stack
                p.copy_(noise / p.shape[-1] ** 0.5)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return hf


def save_bf16(hf, directory: Path) -> None:
    torch, _ = import_transformers()
    hf.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    hf.to(torch.float32)


def reload_hf(hf, directory: Path):
    """`hf`'s class read back from its (rewritten) save, in f32."""
    torch, _ = import_transformers()
    return type(hf).from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def rounded_reads(graph: Graph) -> int:
    """How many of a graph's ops read a declared tensor (a weight or a state): each is a chain
    position where the spec rounds an activation to bf16 against a bf16 operand."""
    return sum(1 for n in graph.nodes if any(r.kind not in ("value", "input") for r in n.inputs))


def verify_against_transformers(
    model: Model, spec: str, *, steps: int = 2, prompt: int = 12, seed: int = 0, progress=None
) -> OracleReport:
    """Build, save, load and compare (the module docstring); `prompt` random tokens, then `steps`
    decode steps."""
    from mkdsl.checkpoint.loader import load_weights
    from mkdsl.verify.hf_save import compared_model, on_the_spec_grids

    built = stand_in(hf_map(model).architecture)
    notes = _stand_in_notes(model, built)
    if built is not None:
        model = plain_residual_model(model)
    run = getattr(built, "compare", None) or compare
    if run is compare:
        _one_carry(model)
    model, unread = compared_model(model)
    hf = build_hf_model(model, seed)
    report = OracleReport(spec, hf_map(model).architecture)
    report.lines += notes
    with tempfile.TemporaryDirectory(prefix="mkdsl-oracle-") as tmp:
        (built.save if built is not None else save_bf16)(hf, Path(tmp))
        moved = on_the_spec_grids(model, Path(tmp))
        if moved:  # transformers computes with the values the spec's quantised weights hold
            hf = (built.reload if built is not None else reload_hf)(hf, Path(tmp))
            report.lines.append(f"{moved} stored tensors moved onto the grids of the spec's quantised weights")
        weights, load = load_weights(model, tmp, progress=False, host=True)
    report.lines.append(load.summary())
    if unread:
        report.lines.append(f"not compared (the decode step does not read them): {', '.join(unread)}")
    ids = np.random.default_rng(seed).integers(0, hf.config.vocab_size, size=prompt).astype(np.int32)
    run(report, model, weights, hf, ids, steps, progress)
    return report


def verify_checkpoint(
    model: Model,
    spec: str,
    directory,
    prompts: list[np.ndarray] | None = None,
    *,
    steps: int = 2,
    random_prompts: int = 3,
    prompt: int = 12,
    progress=None,
) -> OracleReport:
    """`--weights DIR`: a real checkpoint (a Hugging Face directory) read by transformers (the
    mapping's class, in f32) and by the spec's mapping, compared on each prompt (token ids; None:
    `random_prompts` random ones of `prompt` tokens) as above: every
    layer fed transformers' hidden states, the logits, and the spec's greedy tokens teacher forced
    through transformers."""
    from mkdsl.checkpoint.loader import load_weights
    from mkdsl.verify.hf_save import compared_model

    if stand_in(hf_map(model).architecture) is not None:
        raise OracleError(
            f"transformers has no `{hf_map(model).architecture}` to read a checkpoint with (mkdsl builds "
            "it from transformers' modules for random weights only): --weights cannot be compared"
        )
    _one_carry(model)
    model, unread = compared_model(model)
    torch, transformers = import_transformers()
    cls = getattr(transformers, hf_map(model).architecture, None)
    if cls is None:
        raise OracleError(f"transformers {transformers.__version__} has no class `{hf_map(model).architecture}`")
    weights, load = load_weights(model, directory, progress=False, host=True)  # its errors first: they name tensors
    hf = cls.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    report = OracleReport(spec, f"{hf_map(model).architecture} from {directory}")
    report.lines.append(load.summary())
    if unread:
        report.lines.append(f"not compared (the decode step does not read them): {', '.join(unread)}")
    if prompts is None:  # `random_prompts` of `prompt` random tokens each
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, hf.config.vocab_size, size=prompt) for _ in range(random_prompts)]
    for n, ids in enumerate(prompts):
        report.lines.append(f"prompt {n + 1}:")
        compare(report, model, weights, hf, np.asarray(ids, np.int32), steps, progress)
    return report


def _stand_in_notes(model: Model, built) -> list[str]:
    """What the stand-in compares with transformers, and what it cannot (the report's first lines)."""
    if built is None:
        return []
    ops = ", ".join(f"`{o}`" for o in replaced_ops(model))
    kinds = {k: [i for i, s in enumerate(model.schedule) if s == k] for k in dict.fromkeys(model.schedule)}
    layers = "; ".join(f"{k} (layers {', '.join(map(str, ls))})" for k, ls in kinds.items())
    compared = f"compared with transformers, layer by layer, every op{f' but {ops}' if ops else ''}: {layers}"
    return [f"stand-in: {built.BASE}", compared, *(n.format(ops=ops) for n in built.NOTES)]


def _one_carry(model: Model) -> None:
    if len({len(model.kind(k).params) for k in model.schedule}) != 1 or len(model.kind(model.schedule[0]).params) != 1:
        raise OracleError("the oracle compares a layer stack that carries one value (the residual stream)")


def compare(report: OracleReport, model: Model, weights, hf, ids: np.ndarray, steps: int, progress) -> None:
    """The spec's greedy run from `ids` against transformers, teacher forced on its tokens."""
    ties: list[int] = []
    greedy = free_run(model, weights, ids, steps, ties)
    seq = np.concatenate([ids, greedy[:-1]]).astype(np.int32)
    trace = hf_trace(hf, seq)
    check_greedy(report, trace, greedy, len(ids), min(ties, default=None))
    check_isolated(report, model, weights, trace, seq, len(ids), progress)
    report.lines.append(f"{len(ids)} prompt tokens + {steps} decode steps; greedy {greedy.tolist()}")


def free_run(model: Model, weights: dict, ids: np.ndarray, steps: int, ties: list[int] | None = None) -> np.ndarray:
    """The spec's greedy tokens: its prefill over the prompt, then `steps` decode steps. `ties`
    collects the greedy tokens (0: the prefill's) whose run made a routing choice within ROUTE_TIE
    of its runner-up (`OpDef.near_tie`): from there the spec's stream may take another expert than
    transformers' and part from it by more than rounding."""
    from mkdsl.run.prefill import build_prefill, reference_weights
    from mkdsl.run.reference import build_reference

    phase = [0]
    state = zero_state(model, len(ids) + steps + 1)
    with watching_route_ties(model, lambda: ties.append(phase[0]) if ties is not None else None):
        # unjitted: at mini sizes XLA's compile of the whole step costs more than running it op by op
        _, token, state = build_prefill(model, jit=False)(weights, state, jnp.asarray(ids[None]))
        out, step = [int(np.asarray(token)[0])], build_reference(model, jit=False)
        ref_w = reference_weights(model, weights)
        for j in range(steps):
            phase[0] = j + 1
            pos = jnp.asarray([len(ids) + j], jnp.int32)
            _, token, state = step(ref_w, state, jnp.asarray([out[-1]], jnp.int32), pos)
            out.append(int(np.asarray(token)[0]))
    return np.asarray(out, np.int32)


@contextlib.contextmanager
def watching_route_ties(model: Model, found, margin: float = ROUTE_TIE, flip: int | None = None):
    """The model's routing ops run by their plain reference, each row probed by its `near_tie`
    reference (which flips only at a choice within `margin` of its runner-up): `found()` is
    called for each near tie, and the `flip`-th of them (0-based, in the order found) takes the
    runner-up. Unjitted use only: the probe reads the scores' values."""
    originals = {n.op: OPS[n.op] for g in model.kinds for n in g.nodes if OPS[n.op].near_tie is not None}
    seen = [0]

    def watched(op):
        def reference(*arrays, **attrs):
            out = op.reference(*arrays, **attrs)
            for row in range(arrays[0].shape[0]):
                flipped: list[bool] = []
                probe = op.near_tie(row, margin, flipped)(*arrays, **attrs)
                if flipped:
                    out = probe if seen[0] == flip else out
                    seen[0] += 1
                    found()
            return out

        return reference

    for name, op in originals.items():
        OPS[name] = dataclasses.replace(op, reference=watched(op), prefill=None)
    try:
        yield
    finally:
        OPS.update(originals)


def check_greedy(report: OracleReport, trace: HFTrace, greedy: np.ndarray, prompt: int, tie: int | None = None) -> None:
    """Each greedy token against transformers' choice; a different one passes as a near tie where
    the logits are that close, or where the spec's run had a routing near tie at or before it (`tie`)."""
    excuse = f"after a routing near tie in the spec's run (greedy token {tie}'s)"
    for j, token in enumerate(greedy):
        after = excuse if tie is not None and tie <= j else ""
        check_choice(report, trace.logits[prompt - 1 + j], int(token), f"greedy token {j}", after)


def check_choice(report: OracleReport, scores: np.ndarray, token: int, what: str, excuse: str = "") -> None:
    """The spec's choice `token` against the argmax of transformers' `scores`: a different one is a
    near tie where its score is within TIE_RTOL of the best, or where `excuse` says why it may part."""
    best = int(scores.argmax())
    if best == token:
        return
    margin = float(scores.max() - scores[token])
    where = f"{what}: spec {token}, transformers {best} (margin {margin:.4g})"
    if margin <= TIE_RTOL * float(np.abs(scores).max()):
        report.ties.append(where)
    elif excuse:
        report.ties.append(f"{where}: {excuse}")
    else:
        report.failures.append(where + ": no near tie")


def check_isolated(report, model: Model, weights, trace: HFTrace, seq, prompt: int, progress) -> None:
    """Every layer of the prefill (positions < prompt) and of each decode step after it, fed
    transformers' hidden states; then the epilogue, fed its last one."""
    from mkdsl.run.prefill import run_prefill
    from mkdsl.run.reference import build_layered_reference, run_layer
    from mkdsl.run.sampling import Sampling

    dtype = carry_dtype(model)
    outs: dict[int, np.ndarray] = {}
    length = len(model.schedule)

    def feed(index, carries):
        if index > 0:
            outs[index - 1] = np.asarray(carries[0], np.float32)
        source = trace.layer_in[index] if index < length else trace.layer_out[length - 1]
        return [jnp.asarray(source[:prompt], dtype)]

    state = zero_state(model, len(seq) + 1)
    logits, _, state = run_prefill(model, Sampling(), weights, state, jnp.asarray(seq[None, :prompt]), feed=feed)
    rows = slice(0, prompt)
    for i in range(length):
        rerun = _PrefillRerun(model, i, weights, trace, seq, rows)
        compare_layer(report, model, i, outs[i], trace, rows, "prefill", rerun, weights, seq, rerun.moved)
    compare_logits(report, np.asarray(logits, np.float32)[0], trace.logits[prompt - 1], "prefill")
    layered = build_layered_reference(model)
    from mkdsl.run.prefill import reference_weights

    ref_w = reference_weights(model, weights)
    for p in range(prompt, len(seq)):
        tok, pos = jnp.asarray(seq[p : p + 1]), jnp.asarray([p], jnp.int32)
        for i in range(length):
            before, carry = state, [jnp.asarray(trace.layer_in[i][p : p + 1], dtype)]
            carries, state = run_layer(model, i, ref_w, before, tok, pos, carry)
            rerun = functools.partial(_decode_rerun, model, i, ref_w, before, tok, pos, carry)
            got = np.asarray(carries[0], np.float32)
            moved = functools.partial(_decode_moved, model, i, ref_w, before, tok, pos, trace.layer_in[i][p : p + 1])
            where = f"step {p - prompt + 1}"
            compare_layer(report, model, i, got, trace, slice(p, p + 1), where, rerun, moved=moved)
        last = [jnp.asarray(trace.layer_out[length - 1][p : p + 1], dtype)]
        logits, _ = layered.epilogue(ref_w, state, tok, pos, last)
        compare_logits(report, np.asarray(logits, np.float32)[0], trace.logits[p], f"step {p - prompt + 1}")


def _decode_rerun(model, index, weights, state, tok, pos, carry, row: int):
    """A decode step's one row (`row` 0), computed again from the same state."""
    from mkdsl.run.reference import run_layer

    return row, lambda: run_layer(model, index, weights, state, tok, pos, carry)[0][0]


def _decode_moved(model, index, weights, state, tok, pos, carry: np.ndarray) -> np.ndarray:
    """`sensitivity` of a decode step's layer `index`, from the same state."""
    from mkdsl.run.reference import run_layer

    def run(c):
        return run_layer(model, index, weights, state, tok, pos, [jnp.asarray(c, carry_dtype(model))])[0][0]

    return sensitivity(run, carry)


def carry_dtype(model: Model):
    from mkdsl.lang.dtypes import numpy_dtype

    return numpy_dtype(model.kind(model.schedule[0]).params[0].type.dtype.numpy)


def layer_ratio(model: Model, index: int, got: np.ndarray, trace: HFTrace, rows: slice) -> np.ndarray:
    """Per row: |spec - transformers| over the bound (module docstring)."""
    want, entering = trace.layer_out[index][rows], trace.layer_in[index][rows]
    n = rounded_reads(model.kind(model.schedule[index]))
    update = np.abs(want - entering).max(axis=-1)
    bound = n * ROUNDING * update + F32_RTOL * np.abs(want).max(axis=-1) + np.finfo(np.float32).tiny
    return np.abs(got - want).max(axis=-1) / bound


def compare_layer(
    report,
    model,
    index,
    got,
    trace,
    rows: slice,
    where: str,
    rerun=None,
    weights=None,
    seq=None,
    moved=None,
    explain=None,
) -> None:
    """Each row of layer `index`'s output against transformers'. A failing row in a layer that
    routes is first run again with its near tie taken the other way (`rerun(row)`, see
    `_runner_up`), in the prefill and in the decode steps alike; one that still fails is checked
    for ill-conditioning (`moved()`: `sensitivity`); a prefill row that still fails is blamed on
    an op (`explain()` names it where the rows are not a prefill's)."""
    ratio = layer_ratio(model, index, got, trace, rows)
    report.note("layer", ratio.max())
    kind = model.schedule[index]
    routes = any(OPS[n.op].near_tie for n in model.kind(kind).nodes)
    for bad in np.flatnonzero(~(ratio <= 1)):
        what = f"{where} layer {index} ({kind}): row {rows.start + bad} off by {ratio[bad]:.2f}x the bound"
        if rerun is not None and routes:
            tie, fits = _runner_up(model, index, trace, rows, int(bad), rerun)
            if tie:
                how = "the runner-up fits" if fits else "another of the near-tied choices"
                report.ties.append(f"{what}: a routing near tie ({how})")
                continue
        amplified = _ill_conditioned(model, index, got, trace, rows, int(bad), moved)
        if amplified:
            report.ties.append(f"{what}: ill-conditioned ({amplified})")
            continue
        if not any(" layer " in f for f in report.failures):
            if explain is not None:
                what += "; " + explain()
            elif weights is not None:
                what += "; " + blame(model, index, weights, trace, seq, rows)
        report.failures.append(what)
        return  # the first failing row of a layer names it


def _ill_conditioned(model, index, got, trace, rows: slice, row: int, moved) -> str:
    """Why row `row` may exceed the bound though the spec is right, or "". The bound assumes one
    bf16 rounding moves the layer's output by at most 2^-9 of the row's update; `moved()` measures
    what moving the layer's input by one bf16 rounding's size really moves each row by
    (`sensitivity`): the rounding of the normed input that every projection reads, with all its
    consequences through the layer. Where that is more (a cancellation the layer then
    normalises: the delta rule's read-out with q.k near 0 before its gated norm, README), the
    row's bound is its usual one plus that one measured move."""
    if moved is None:
        return ""
    at = rows.start + row
    want, entering = trace.layer_out[index][at], trace.layer_in[index][at]
    premise = ROUNDING * float(np.abs(want - entering).max())
    shift = float(moved()[row])
    if not shift > premise:
        return ""
    n = rounded_reads(model.kind(model.schedule[index]))
    err = float(np.abs(got[row] - want).max())
    bound = shift + n * premise + F32_RTOL * float(np.abs(want).max())
    if not err <= bound:
        return ""
    return (
        f"one bf16 rounding of its input moves this row {shift / premise:.1f}x the bound's 2^-9 of its "
        f"update; the error is {err / bound:.2f} of the bound plus that move"
    )


def sensitivity(run, carry: np.ndarray, seed: int = 0) -> np.ndarray:
    """Per row, how far a layer's update (output minus input, the bound's scale) moves, largest
    entry, when its input carry is moved by one bf16 rounding's size: every entry times 1 ± 2^-9
    (random signs). `run(carry)` is the layer's output over the rows of `carry`."""
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=carry.shape).astype(np.float32)
    moved = carry * (1 + ROUNDING * signs)
    base = np.asarray(run(carry), np.float32) - carry
    return np.abs(np.asarray(run(moved), np.float32) - moved - base).max(axis=-1)


def _runner_up(model, index, trace, rows: slice, row: int, rerun) -> tuple[bool, bool]:
    """(whether local row `row` of `rows` has a routing near tie in the layer, whether the layer's
    output then fits there). `rerun(row) -> (i, run)`: `run()` computes the layer again over some
    rows (under the near-tie references, which flip row `i` of what it computes) and returns
    that row's output."""
    kind = model.kind(model.schedule[index])
    originals = {n.op: OPS[n.op] for n in kind.nodes if OPS[n.op].near_tie is not None}
    flipped: list[bool] = []
    local, run = rerun(row)
    for name, op in originals.items():
        OPS[name] = dataclasses.replace(op, reference=op.near_tie(local, ROUTE_TIE, flipped), prefill=None)
    try:
        out = np.asarray(run(), np.float32).reshape(1, -1)
    finally:
        OPS.update(originals)
    at = slice(rows.start + row, rows.start + row + 1)
    return bool(flipped), bool(flipped) and layer_ratio(model, index, out, trace, at)[0] <= 1


class _PrefillRerun:
    """A prefill row of layer `index` computed again at its near tie: the layer is recorded once
    (on the first tied row) and each tied row replayed alone from the choosing op on
    (mkdsl/verify/row_replay.py); where that op's successors are not row-wise, the whole layer
    runs again."""

    def __init__(self, model, index, weights, trace, seq, rows: slice):
        self.args, self.recorded, self.shift = (model, index, weights, trace, seq, rows), None, None

    def moved(self) -> np.ndarray:
        """`sensitivity` of the layer's prefill over its rows (one layer run, kept)."""
        if self.shift is None:
            model, index, _, trace, _, rows = self.args
            self.shift = sensitivity(self._whole_layer, trace.layer_in[index][rows])
        return self.shift

    def __call__(self, row: int):
        from mkdsl.verify.row_replay import record_layer, replay, replayable

        model, index, weights, trace, seq, rows = self.args
        if replayable(model, index) is None:
            return row, lambda: self._whole_layer()[row]
        if self.recorded is None:
            carry = trace.layer_in[index][rows]
            self.recorded = record_layer(model, index, weights, carry, seq[rows], carry_dtype(model))
        rec = self.recorded
        return 0, lambda: replay(rec, row)

    def _whole_layer(self, carry=None):
        from mkdsl.run.prefill import run_prefill_layer

        model, index, weights, trace, seq, rows = self.args
        state = zero_state(model, rows.stop + 1)
        carries = [jnp.asarray(trace.layer_in[index][rows] if carry is None else carry, carry_dtype(model))]
        return run_prefill_layer(model, index, weights, state, jnp.asarray(seq[None, rows]), carries)[0][0]


def compare_logits(report: OracleReport, got: np.ndarray, want: np.ndarray, where: str) -> None:
    bound = (LOGIT_RTOL + F32_RTOL) * np.abs(want).max()
    ratio = float(np.abs(got - want).max() / bound)
    report.note("logits", ratio)
    if not ratio <= 1:
        report.failures.append(f"{where} epilogue: logits off by {ratio:.2f}x the bound")


def blame(model: Model, index: int, weights, trace: HFTrace, seq, rows: slice) -> str:
    """The first op of layer `index` that differs (the module docstring), fed transformers' input."""
    if rows.start != 0:
        return "the prefill's layers agreed: the decode step's form of an op differs"
    values = mk_op_values(model, index, weights, trace.layer_in[index][rows], seq[rows], carry_dtype(model))
    return first_differing(values, [(n, v[rows]) for n, v in trace.modules[index]])


def first_differing(values, hf_values) -> str:
    """The first op whose value (`values`: (node, [T, X]) in spec order) matches no transformers
    module output (`hf_values`: (name, [T, X]) in call order), of the width of the first module
    output that no spec value matches (the module docstring)."""
    tol = 2.0**-4

    def close(a, b):
        return a.shape == b.shape and np.abs(a - b).max() <= tol * np.abs(b).max() + 1e-6

    width = {v.shape[-1] for _, v in values}
    first = next(
        ((n, v) for n, v in hf_values if v.shape[-1] in width and not any(close(x, v) for _, x in values)), None
    )
    if first is None:
        return "every transformers module output of the layer has a matching spec value (an op outside them differs)"
    hf_name, hf_value = first
    for node, v in values:
        if v.shape == hf_value.shape and not any(close(v, x) for _, x in hf_values):
            return (
                f"first op that differs: `{node.op}` at spec line {node.span.line}"
                f"{f' (block {node.block})' if node.block else ''}; transformers' `{hf_name}` has no match"
            )
    return f"transformers' `{hf_name}` has no match among the spec's values"
