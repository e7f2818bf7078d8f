"""The Python API (`import mkdsl`): load a spec, compile it, and run what it describes, the
unfused reference and the generated kernel. See docs/python-api.md.

    spec = mkdsl.load("specs/tiny.mk")                 # parsed, checked, sharded
    files = mkdsl.compile_text(spec)                   # {"kernel.py": ..., "plan.md": ..., "plan.svg": ...}
    weights, state = mkdsl.random_inputs(spec, batch=1, seq_len=256)
    step = mkdsl.build_step(spec, batch=1, seq_len=256)  # TPU interpret mode on a CPU
    ref = mkdsl.reference_step(spec)

Spec mistakes raise `SpecError` (its `render()` gives the CLI's diagnostics); an unknown profile
raises `ProfileError`, a `ValueError`. Nothing here imports jax until it is needed.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from mkdsl.lang.diagnostics import SpecError, did_you_mean
from mkdsl.lang.ir import Model
from mkdsl.lang.syntax import Module, ProfileDecl


class ProfileError(ValueError):
    """A profile the spec does not declare (the CLI reports it as a usage error)."""


def spec_profiles(module: Module) -> list[str]:
    """The profiles a parsed spec declares, in order."""
    return list(dict.fromkeys(it.name for it in module.items if isinstance(it, ProfileDecl)))


def check_profile(module: Module, profile: str | None, path: str) -> None:
    """Raise ProfileError unless `profile` is None or one the spec declares."""
    names = spec_profiles(module)
    if profile is None or profile in names:
        return
    known = f"its profiles: {', '.join(names)}" if names else "it declares no profiles"
    hint = did_you_mean(profile, names)
    raise ProfileError(f"no profile named `{profile}` in {path}; {known}{f' ({hint})' if hint else ''}")


@dataclass(frozen=True)
class Spec:
    """A checked spec: its text, the whole model (the reference's view) and what one device runs."""

    path: str
    profile: str | None
    source: str
    model: Model
    local: Model  # the per-device model (the model itself on a one-device mesh)
    profiles: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def batch_range(self) -> tuple[int, int]:
        return self.model.dims[0].low, self.model.dims[0].high


def load(path: str | Path, profile: str | None = None, weights=None) -> Spec:
    """Read, parse, check and shard a spec (with `profile`'s overrides). `weights` (a checkpoint
    path or an open reader): retype the weights its mapping keeps as stored (`| stored`: GGUF
    Q8_0/Q4_0/Q4_1, mkdsl/checkpoint/stored.py) to the file's formats, as `mkdsl run` does."""
    from mkdsl.lang.elaborate import elaborate
    from mkdsl.lang.syntax import parse
    from mkdsl.spmd.shard import shard

    path = str(path)
    source = Path(path).read_text(encoding="utf-8")
    try:
        module = parse(source)
        check_profile(module, profile, path)
        model = elaborate(module, profile, source)
        if weights is not None:
            source, module, model = for_checkpoint(source, module, model, profile, weights)
        local = shard(model)
    except SpecError as e:
        e.source = source
        e.path = path
        raise
    return Spec(path, profile, source, model, local, tuple(spec_profiles(module)))


def for_checkpoint(source: str, module, model, profile: str | None, weights):
    """(source, module, model) retyped for a checkpoint's stored formats (unchanged if none)."""
    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.stored import retype, stored_formats
    from mkdsl.lang.elaborate import elaborate
    from mkdsl.lang.syntax import parse

    reader = weights if hasattr(weights, "info") else open_checkpoint(weights)
    formats = stored_formats(model, reader)
    if not formats:
        return source, module, model
    source = retype(source, model, formats)
    try:
        module = parse(source)
        return source, module, elaborate(module, profile, source)
    except SpecError as e:  # shown on the retyped text: a `stored` weight its ops cannot take quantised
        kept = ", ".join(f"`{n}` as {f}" for n, f in formats.items())
        hint = (
            f"`| stored` declared {kept} (the checkpoint's formats); say `| round` where a weight must stay as declared"
        )
        out = SpecError([dataclasses.replace(d, hint=d.hint or hint) for d in e.diagnostics], e.more)
        out.source = source
        raise out from None


def compile_text(spec: Spec) -> dict[str, str]:
    """The files `mkdsl compile` writes, by name (kernel.py, plan.md, plan.svg); nothing is written."""
    from mkdsl.compiler import compile_source

    out, _ = compile_source(spec.source, spec.path, spec.profile)
    return dict(out.files)


def compile_to(spec: Spec, out_dir: str | Path | None = None) -> Path:
    """Compile and write the files atomically into `out_dir` (default: generated/<model>[_<profile>]
    in the spec's project, as `mkdsl compile`); returns the directory."""
    from mkdsl.compiler import compile_source, write_atomically

    out, where = compile_source(spec.source, spec.path, spec.profile, Path(out_dir) if out_dir else None)
    write_atomically(out, where)
    return where


def reference_step(spec: Spec, jit: bool = True, *, rows: int = 1, context_layers=()):
    """The unfused JAX step, `step(weights, state, tokens, positions) -> (logits, next_tokens,
    new_state)`, on the whole model; quantised weights are `QTensor`s (as `random_inputs` gives).
    `rows=R` > 1 (or `context_layers`): the verify step (mkdsl/run/rows.py), tokens and positions
    i32 [B, R], logits [B, R, V], next_tokens [B, R], the state in the verify layout
    (`verify_state`), plus `context` f32 [B, R, len(context_layers), H] when layers are named."""
    from mkdsl.run.reference import build_reference
    from mkdsl.run.rows import build_verify_reference

    if rows == 1 and not context_layers:
        return build_reference(spec.model, jit=jit)
    return build_verify_reference(spec.model, rows, context_layers, jit=jit)


def commit(spec: Spec, state: dict, accepted) -> dict:
    """The verify step's new state as if only the first `accepted[b]` (1..R) rows of each
    sequence had been decoded: each recurrent state's row slot selected, caches unchanged."""
    from mkdsl.run.rows import commit as select

    return select(spec.model, state, accepted)


def verify_state(spec: Spec, state: dict, rows: int) -> dict:
    """A plain state (B rows, as the prefill or `random_inputs` gives it) in the verify layout
    for `rows` rows per sequence (each recurrent state with a slot per row)."""
    from mkdsl.run.rows import verify_state as expand

    return expand(spec.model, state, rows)


def plain_state(spec: Spec, state: dict, rows: int) -> dict:
    """A committed verify state back in the plain layout (the inverse of `verify_state`)."""
    from mkdsl.run.rows import plain_state as shrink

    return shrink(spec.model, state, rows)


def random_inputs(spec: Spec, batch: int, seq_len: int, seed: int = 0, *, rows: int = 1) -> tuple[dict, dict]:
    """Well-scaled random (weights, state) for `batch` rows and caches of `seq_len` tokens, as the
    reference takes them; `kernel_weights(weights)` gives the kernel's layout. `rows=R`: the
    state in the verify layout (`verify_state`)."""
    from mkdsl.run.random_params import random_params as draw

    sizes = {spec.model.dims[0].name: batch, **{d.name: seq_len for d in spec.model.dims[1:]}}
    weights, state = draw(spec.model, sizes, seed)
    return (weights, state) if rows == 1 else (weights, verify_state(spec, state, rows))


def kernel_weights(weights: dict) -> dict:
    """Weights as the generated kernel takes them: a quantised `w` becomes `w_codes`, `w_scales`."""
    from mkdsl.run.random_params import kernel_weights as split

    return split(weights)


_loaded = itertools.count()


def load_kernel(spec: Spec) -> ModuleType:
    """The generated kernel module, imported from the compiled text (the same code `mkdsl
    compile` writes to kernel.py): its layouts, constants and `build_decode_step`."""
    text = compile_text(spec)["kernel.py"]
    name = f"mkdsl_kernel_{spec.name}_{next(_loaded)}"
    module = ModuleType(name)
    module.__file__ = f"<mkdsl kernel of {spec.path}>"
    sys.modules[name] = module  # dataclasses in the module look their module up by name
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module


def build_step(
    spec: Spec,
    batch: int,
    seq_len: int,
    *,
    interpret=True,
    mesh=None,
    sampling=None,
    steps_per_call: int = 1,
    module: ModuleType | None = None,
    rows: int = 1,
    context_layers=(),
):
    """The kernel's decode step, `step(weights, state, tokens, positions, seed=0)`, for `batch`
    rows and caches of `seq_len` tokens. `interpret`: True for TPU interpret mode on a CPU (or a
    `pltpu.InterpretParams`), False to compile for the TPU. `mesh`: for sharded specs.
    `sampling`: a `Sampling` (default greedy); `steps_per_call=N`: N steps per device call, the
    N tokens returned as [batch, N]. `module`: the kernel module if already loaded. `rows=R` > 1:
    the verify step (tokens, positions [batch, R]; logits [batch, R, V], next_tokens [batch, R];
    the state in the verify layout, `commit`); `context_layers`: a `context` output [batch, R,
    len, H], the residual stream after each listed layer."""
    module = module or load_kernel(spec)
    if interpret:
        from mkdsl.backends.tpu.interpret import interpret_params, use_fast_interpreter

        interpret = interpret_params() if interpret is True else interpret
        use_fast_interpreter()
    options = {"interpret": interpret or None, "steps_per_call": steps_per_call}
    if rows != 1 or context_layers:
        options.update(verify_rows=rows, context_layers=tuple(context_layers))
    if sampling is not None:
        options["sampling"] = module.Sampling(sampling.temperature, sampling.top_k, sampling.top_p)
    if mesh is not None:
        options["mesh"] = mesh
    return module.build_decode_step(batch, seq_len, **options)


def state_shardings(spec: Spec, mesh) -> dict:
    """NamedShardings of the decode state on `mesh`, as the generated module's `STATE_SPLIT`
    places it (the stack's layer axis whole, each dimension over its declared axes)."""
    from jax.sharding import NamedSharding, PartitionSpec

    def entry(axes: tuple[str, ...]):
        return None if not axes else axes[0] if len(axes) == 1 else axes

    out = {}
    for t in spec.model.states:
        split = [entry(a) for a in t.sharding]
        out[t.name] = NamedSharding(mesh, PartitionSpec(*([None] if t.stacked else []), *split))
    return out


def prefill_step(
    spec: Spec, *, sampling=None, mesh=None, jit: bool = True, donate: bool = True, per_device: bool | None = None
):
    """The XLA prefill, `prefill(weights, state, tokens, lengths=None, start=None, seed=0) ->
    (logits, next_tokens, new_state)` over a prompt `tokens` i32 [batch, T] (mkdsl/run/prefill.py):
    caches and recurrent state as the decode steps would leave them, in the kernel's layout. With
    `mesh` (sharded specs) the new state is placed on it as the kernel's STATE_SPLIT says, and the
    prefill runs per device under shard_map (mkdsl/run/prefill_spmd.py) unless `per_device=False`
    (then whole, where its inputs are)."""
    from mkdsl.run.prefill import build_prefill
    from mkdsl.run.prefill_spmd import build_sharded_prefill
    from mkdsl.spmd.shard import is_sharded

    shardings = state_shardings(spec, mesh) if mesh is not None else None
    options = {"sampling": sampling, "state_shardings": shardings, "jit": jit, "donate": donate}
    if per_device is None:
        per_device = mesh is not None and is_sharded(spec.model)
    if per_device:
        return build_sharded_prefill(spec.model, mesh, **options)
    return build_prefill(spec.model, **options)


def generate(
    spec: Spec,
    weights: dict,
    prompt: list[int],
    *,
    max_tokens: int = 32,
    draft=None,
    draft_rows: int = 4,
    draft_weights: dict | None = None,
    sampling=None,
    seed: int = 0,
    stop: tuple[int, ...] = (),
    target: str = "reference",
    seq_len: int | None = None,
    interpret=True,
    on_tokens=None,
):
    """Generate after `prompt` (token ids), speculatively when `draft` is given, on one sequence:
    the XLA prefill, then the loop of mkdsl/run/speculative.py (drafts, ONE verify step of R rows,
    the accept rule, `commit` at the accepted length). `draft`: None (plain decoding, one row per
    step), "ngram", "mtp" (the spec's `mtp` head, with `weights` or `draft_weights`), a draft
    spec's path (`.mk`, paired with `spec`; `draft_weights` in its layout, default random), or a
    `Drafter` (docs/python-api.md); `draft_rows`: R for a named drafter. A drafter reading target
    hidden states gets the prompt's from the prefill and the accepted rows' from each verify step.
    `weights` as `random_inputs` gives them (the reference's layout); `target`: "reference" (the
    unfused verify step, jitted) or "kernel" (the generated kernel's, `interpret` as in
    `build_step`). Greedy (the default `sampling`) gives plain greedy decoding's tokens exactly;
    sampling keeps its distribution. Returns a `Speculation`: `tokens`, per-step accepted counts
    (`steps`), `mean_accepted`, `calls` (target steps run: one per verify step)."""
    import numpy as np

    from mkdsl.run import speculative
    from mkdsl.run.sampling import Sampling

    if target not in ("reference", "kernel"):
        raise ValueError(f"target must be 'reference' or 'kernel', got {target!r}")
    sampling = sampling or Sampling()
    module = load_kernel(spec) if target == "kernel" else None
    tile = module.KV_TILE if module is not None else 1
    rows = draft_rows if isinstance(draft, str | Path) else getattr(draft, "rows", 1)
    seq_len = seq_len or -(-(len(prompt) + max_tokens + rows) // tile) * tile
    drafter = _drafter(spec, weights, draft, draft_rows, draft_weights, seed, seq_len)
    layers = tuple(drafter.context_layers)
    if module is None:
        state = speculative.zero_state(spec.model, seq_len)
    else:
        state = {n: np.zeros(s.shape, s.dtype) for n, s in module.state_layout(1, seq_len).items()}
    prefill = speculative.reference_fns(spec.model, sampling, layers)[0]
    _, first, state, *context = prefill(weights, state, np.asarray([prompt], np.int32), seed=seed)
    if module is None:
        verifier = speculative.reference_rows_target(spec.model, weights, state, drafter.rows, layers)
    else:
        options = {"interpret": interpret, "sampling": sampling, "module": module}
        step = build_step(spec, 1, seq_len, rows=drafter.rows, context_layers=layers, **options)
        packed = kernel_weights(weights)
        packed = module.pad_weights(packed) if hasattr(module, "pad_weights") else packed
        verifier = speculative.kernel_rows_target(module, step, packed, state, drafter.rows, seed, layers)
    return speculative.speculate(
        verifier,
        drafter,
        list(prompt),
        int(first[0]),
        max_tokens,
        sampling=sampling,
        seed=seed,
        stop=frozenset(stop),
        on_tokens=on_tokens,
        prompt_context=np.asarray(context[0])[0] if context else None,
    )


def _drafter(spec: Spec, weights: dict, draft, rows: int, draft_weights, seed: int, seq_len: int | None):
    """`generate`'s drafter: a `Drafter` as given, or one made by name (none: R = 1)."""
    from mkdsl.run.drafters import NgramDrafter

    if draft is None:
        return NgramDrafter(1)
    if not isinstance(draft, str | Path):
        return draft
    own = draft_weights if draft_weights is not None else (weights if draft == "mtp" else None)
    return make_drafter(draft, spec, own, rows, seed=seed, seq_len=seq_len)


def make_drafter(
    name: str | Path,
    target: Spec | None = None,
    weights: dict | None = None,
    rows: int = 8,
    profile: str | None = None,
    seed: int = 0,
    seq_len: int | None = None,
):
    """A drafter by name for R = `rows`: "ngram"; "mtp" (`target`'s `mtp` head; `weights`: the
    target's, in the spec's layout); or a draft spec's path, loaded with `profile` (default: the
    target's, where the draft spec declares it) and paired with `target` (`DraftSpecError`:
    context layers it lacks, another width or vocabulary), `weights` in its layout (default:
    random, seeded). `seq_len`: the MTP head's cache length (default the spec's longest)."""
    from mkdsl.run.drafters import make_drafter as by_name

    if Path(name).suffix == ".mk":
        wanted = profile if profile is not None else (target.profile if target is not None else None)
        declared = spec_profiles(_parse_file(name))
        name = load(name, wanted if profile is not None or wanted in declared else None)
    return by_name(name if isinstance(name, Spec) else str(name), rows, target, weights, seed=seed, seq_len=seq_len)


def _parse_file(path: str | Path) -> Module:
    from mkdsl.lang.syntax import parse

    source = Path(path).read_text(encoding="utf-8")
    try:
        return parse(source)
    except SpecError as e:
        e.source, e.path = source, str(path)
        raise


def join_cluster(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Join a multi-host run (one process per host, docs/multihost.md) before anything uses JAX:
    `jax.distributed.initialize` from the arguments, else from `JAX_COORDINATOR_ADDRESS`,
    `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` (`coordinator="auto"`: JAX detects the cluster), with
    gloo collectives on the CPU. False (nothing done) when neither describes a cluster. Then
    `load_kernel(spec).make_mesh()` spans every process's devices and `load_weights(...,
    module=, mesh=)` loads only this process's shards."""
    from mkdsl.run import distributed

    cluster = distributed.Cluster.resolve(coordinator, num_processes, process_id)
    if cluster is None:
        return False
    distributed.initialize(cluster)
    return True
