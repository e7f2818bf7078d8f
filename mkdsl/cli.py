"""The `mkdsl` command: check, plan and compile specs, and run them on a checkpoint.

Exit status: 0 success, 1 errors in the spec (or stale output with --check), 2 usage errors
(bad arguments, unreadable files), 3 an internal compiler error (a bug in mkdsl). `run` exits 1
when the checkpoint does not fit the spec.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import stat
import sys
import time
import traceback
from pathlib import Path

from mkdsl.backends.tpu.mosaic_errors import KernelCompileError
from mkdsl.checkpoint.formats import CheckpointError
from mkdsl.lang.diagnostics import SpecError
from mkdsl.version import __version__


class UsageError(Exception):
    pass


class CompilerFailure(Exception):
    """libtpu refused a generated kernel: an internal compiler error (exit 3), with its message."""


MAX_SPEC_BYTES = 2**20  # a spec is text a person writes (kimi_k3.mk is 10 KB): more is a mistake, slow to parse


def _read(path: str) -> str:
    try:
        data, pipe = _read_bounded(path)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    if pipe and not data:
        raise UsageError(f"cannot read {path}: a named pipe with no writer, not a regular file")
    if len(data) > MAX_SPEC_BYTES:
        raise UsageError(f"cannot read {path}: more than {MAX_SPEC_BYTES // 2**20} MiB, too large for a spec")
    try:
        return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()  # universal newlines, as open()
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {path}: not UTF-8 text") from None


def _read_bounded(path: str) -> tuple[bytes, bool]:
    """At most MAX_SPEC_BYTES + 1 bytes (the path may be /dev/zero or a huge file), and whether it
    is a pipe. Opened without blocking, so a named pipe nobody writes to reads as empty instead of
    waiting forever; a pipe with a writer (`<(cat spec.mk)`) is read as it comes."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as f:
        os.set_blocking(fd, True)
        return f.read(MAX_SPEC_BYTES + 1), stat.S_ISFIFO(os.fstat(fd).st_mode)


def _parse(args, source: str):
    """The spec's AST, once its profile is known to exist (an unknown one is a usage error)."""
    from mkdsl.api import ProfileError, check_profile
    from mkdsl.lang.syntax import parse

    try:
        module = parse(source)
        check_profile(module, args.profile, args.spec)
        return module
    except SpecError as e:
        e.source = source
        raise
    except ProfileError as e:
        raise UsageError(str(e)) from None


def _load(args):
    from mkdsl.lang.elaborate import elaborate

    source = _read(args.spec)
    module = _parse(args, source)
    try:
        model = elaborate(module, args.profile, source)
    except SpecError as e:
        e.source = source
        raise
    for w in model.warnings:  # printed, never fatal
        print(w.render(args.spec, source), file=sys.stderr)
    return model, source, module


def _out_shown(args, out_dir) -> str:
    """The output directory as the user named it: absolute if they gave an absolute `-o` (or,
    without one, an absolute spec path), else relative to the working directory."""
    return str(out_dir) if os.path.isabs(args.output or args.spec) else os.path.relpath(out_dir)


def regenerate_command(args, shown: str) -> str:
    """The command that rewrites the output directory `shown` from the spec."""
    profile = f" --profile {args.profile}" if args.profile else ""
    return f"mkdsl compile {args.spec}{profile} -o {shown}"


def cmd_check(args) -> int:
    from mkdsl.plan import make_plan
    from mkdsl.spmd.shard import devices, shard

    t0 = time.perf_counter()
    from mkdsl.api import spec_profiles

    model, source, module = _load(args)
    try:
        local = shard(model)  # shardings must also agree where tensors meet in an op
        make_plan(local, batch=model.dims[0].high)  # what `compile` checks: lowerability, hints, VMEM budget
    except SpecError as e:
        e.source = source
        raise
    if args.dump:
        from mkdsl.lang.ir_text import dump_ir

        sys.stdout.write(dump_ir(model if args.dump == "ir" else local))
        return 0
    n_layers = len(model.schedule)
    kinds = ", ".join(f"{k.name} x{model.schedule.count(k.name)}" for k in model.kinds)
    profiles = ", ".join(spec_profiles(module)) or "none"
    print(
        f"{args.spec}: ok: model {model.name}"
        f"{f' (profile {model.profile})' if model.profile else ''}, {n_layers} layers ({kinds}), "
        f"{len(model.weights)} weights, {len(model.states)} state tensors"
        f"{f', {devices(model)} devices' if devices(model) > 1 else ''}; profiles: {profiles}"
        f" [{time.perf_counter() - t0:.2f} s]"
    )
    return 0


def cmd_compile(args) -> int:
    from pathlib import Path

    from mkdsl.compiler import compile_source, stale_files, write_atomically
    from mkdsl.output import OutputError

    t0 = time.perf_counter()
    if args.output is not None and not args.output.strip():
        raise UsageError("-o/--output needs a directory name, got an empty one")
    source = _read(args.spec)
    _parse(args, source)
    try:
        out, out_dir = compile_source(
            source, args.spec, args.profile, None if args.output is None else Path(args.output)
        )
    except SpecError as e:
        e.source = source
        raise
    for w in out.model.warnings:  # printed, never fatal
        print(w.render(args.spec, source), file=sys.stderr)
    shown = _out_shown(args, out_dir)
    if args.check:
        stale = stale_files(out, out_dir)
        if stale:
            print("\n".join(stale), file=sys.stderr)
            print(f"{shown} is stale: run `{regenerate_command(args, shown)}` and commit the result", file=sys.stderr)
            return 1
        print(f"{shown}: up to date [{time.perf_counter() - t0:.2f} s]")
        return 0
    try:
        write_atomically(out, out_dir)
    except OutputError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write {shown}: {e.strerror or e}") from None
    sizes = ", ".join(f"{name} ({len(text.encode()) / 1024:.0f} KiB)" for name, text in out.files.items())
    t = out.plan.timing
    print(f"wrote {shown}/: {sizes} [{time.perf_counter() - t0:.2f} s]")
    print(
        f"  modeled step at batch {out.plan.batch}: {t.modeled_us:.1f} us (conservative; optimistic {t.optimistic_us:.1f} us), HBM floor {t.floor_us:.1f} us "
        f"({t.modeled_us / t.floor_us:.3f} x); VMEM {out.plan.vmem_total / 2**20:.1f} of {out.plan.vmem_cap / 2**20:.0f} MiB"
    )
    return 0


def cmd_plan(args) -> int:
    with _calibration(args.calibration):
        return _plan(args)


def _plan_inputs(args):
    """`plan`'s spec (retyped for `--weights`' stored formats) checked against its arguments
    before any planning: (model, source text, the batch dimension)."""
    _check_plan_draft(args)
    model, source, module_ast = _load(args)
    if args.weights is not None:  # the formats a `| stored` mapping keeps from this file
        from mkdsl.api import for_checkpoint

        if not os.path.exists(args.weights):
            raise UsageError(f"--weights {args.weights}: no such file or directory")
        try:
            source, module_ast, model = for_checkpoint(source, module_ast, model, args.profile, args.weights)
        except SpecError as e:
            e.source = source
            raise
        _say_stored(args.weights, model)
    rows = model.dims[0]
    if not rows.low <= args.batch <= rows.high:
        raise UsageError(
            f"--batch {args.batch} is outside `{rows.name}` in {rows.low} .. {rows.high} (spec {args.spec})"
        )
    if args.draft == "mtp" and model.mtp is None:
        raise UsageError(f"--draft mtp: {model.name} ({args.spec}) declares no `mtp` head")
    if args.context is not None and args.context < 0:
        raise UsageError(f"--context must be at least 0, got {args.context}")
    if args.context is not None and len(model.dims) > 1 and args.context > model.dims[1].high:
        cache = model.dims[1]
        raise UsageError(
            f"--context {args.context} is beyond `{cache.name}` in {cache.low} .. {cache.high} (spec {args.spec})"
        )
    return model, source, rows


def _plan(args) -> int:
    import json

    from mkdsl.plan import make_plan
    from mkdsl.plan.breakdown import breakdown
    from mkdsl.report.markdown import render_plan
    from mkdsl.report.timing import plan_data, render_summary

    model, source, rows = _plan_inputs(args)
    try:
        from mkdsl.spmd.shard import shard

        options = _cost_options(args)
        model_whole, model = model, shard(model)  # the per-device model: plans and figures are per device (core)
        wide = make_plan(model, batch=rows.high, context=args.context, **options)
        depth = wide.ring_depth  # the kernel's ring is sized for the largest batch
        plan = make_plan(model, batch=args.batch, context=args.context, ring_depth=depth, **options)
    except SpecError as e:
        e.source = source
        raise
    if args.placement:
        from mkdsl.plan import placement

        table = placement.choose(model_whole, args.batch, args.context, **options)
        print(placement.render(model_whole, table, args.batch))
        return 0
    if args.levers:
        from mkdsl.plan import levers

        rows = levers.levers(model_whole, args.batch, args.context, **options)
        print(levers.render(model_whole, rows, args.batch))
        return 0
    if args.save_costs and not args.static:
        raise UsageError("--save-costs needs --static (it saves what the libtpu schedule says)")
    if args.static:
        if not args.clock_ghz > 0:
            raise UsageError(f"--clock-ghz must be positive, got {args.clock_ghz}")
        _need_libtpu("--static")
        return _plan_static(args, source)
    if args.draft is not None:
        figure = _plan_speculative(args, model, depth, options, model_whole)
        print(render_summary(model, plan, args.spec, breakdown(model, plan)))
        from mkdsl.report.markdown import PUBLIC

        public = [f"  public, measured (not mkdsl): {line}" for line in PUBLIC.get(model.name, ())]
        print("\n".join(["", *figure.lines(), *public]))
        return 0
    if args.full:
        from mkdsl.plan.speculative import verify_plan

        verify = verify_plan(model, args.context, depth, **options)
        print(render_plan(model, plan, args.spec, wide=wide, verify=verify))
    elif args.json:
        print(json.dumps(plan_data(model, plan, args.spec, breakdown(model, plan)), indent=1))
    else:
        print(render_summary(model, plan, args.spec, breakdown(model, plan)))
    return 0


def _plan_speculative(args, model, depth: int, options: dict, whole):
    """`plan --draft`: the verify step planned at B x R rows, the drafter's time, the accept step
    (`model` per device, `whole` the spec's model, whose `mtp` head `--draft mtp` plans)."""
    from mkdsl.plan import make_plan
    from mkdsl.plan import speculative as spec_model

    rows = args.draft_rows
    verify_rows = args.batch * rows
    dim = model.dims[0]
    if not dim.low <= verify_rows <= dim.high:
        raise UsageError(
            f"--batch {args.batch} x --draft-rows {rows} = {verify_rows} rows, outside `{dim.name}` in "
            f"{dim.low} .. {dim.high} (spec {args.spec})"
        )
    planned = make_plan(model, batch=verify_rows, context=args.context, ring_depth=depth, verify_rows=rows, **options)
    verify = planned.timing.modeled_us
    series = sum(a.effect_us for a in planned.timing.assumptions if a.name == "rows_in_series")
    if args.draft == "ngram":
        figure = spec_model.ngram(args.batch, rows, args.acceptance, verify)
    elif args.draft == "mtp":
        figure = _mtp_figure(args, spec_model.mtp_model(whole), verify, options)
    else:
        draft = _draft_plan(args, verify_rows)
        if isinstance(draft, tuple):  # its kernel does not lower yet: (floor us, why)
            figure = spec_model.with_draft_floor(args.batch, rows, args.acceptance, verify, *draft, args.draft)
        else:
            figure = spec_model.with_draft_spec(args.batch, rows, args.acceptance, verify, draft, args.draft)
    return dataclasses.replace(figure, series_us=series)


def _mtp_figure(args, head, verify: float, options: dict):
    """`plan --draft mtp`: the target's head planned as a step of --batch rows, R - 1 of them per
    verify step; a head the kernel cannot lower (`mkdsl check` says why) at its HBM floor."""
    from mkdsl.plan import make_plan
    from mkdsl.plan import speculative as spec_model
    from mkdsl.spmd.shard import shard

    try:
        planned = make_plan(shard(head), batch=args.batch, context=args.context, **options)
    except SpecError as e:
        from mkdsl.run.spec_drafters import drafter_floor_us

        first = e.diagnostics[0].message if e.diagnostics else str(e)
        from mkdsl.plan.planner import default_context

        context = args.context if args.context is not None else default_context(head)  # as the target's plan
        floor = drafter_floor_us(head, args.batch, context)[0]
        return spec_model.mtp_floor(args.batch, args.draft_rows, args.acceptance, verify, floor, first)
    return spec_model.with_mtp(args.batch, args.draft_rows, args.acceptance, verify, planned)


def _check_plan_draft(args) -> None:
    """`plan --draft`'s arguments, before anything is planned."""
    from mkdsl.plan import speculative as spec_model

    if args.draft is None:
        return
    shown = [f"--{o}" for o in ("full", "json", "placement", "levers", "static") if getattr(args, o)]
    if shown:
        raise UsageError(f"--draft prints the summary and the speculative figure; it does not combine with {shown[0]}")
    if args.draft not in ("ngram", "mtp") and Path(args.draft).suffix != ".mk":
        raise UsageError(f"--draft {args.draft}: expected ngram, mtp or a draft spec (a .mk file)")
    if args.draft not in ("ngram", "mtp"):
        _read(args.draft)  # unreadable or oversized files are usage errors
    if args.draft_rows < 1:
        raise UsageError(f"--draft-rows must be at least 1, got {args.draft_rows}")
    try:
        spec_model.check_acceptance(args.draft_rows, args.acceptance)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _draft_plan(args, rows: int):
    """A draft spec's step planned at `rows` rows, its context as the target's; for a draft spec
    whose kernel does not lower yet, (its HBM floor in us, why)."""
    from mkdsl.api import load
    from mkdsl.plan import make_plan, static_costs

    try:
        draft = load(args.draft)
    except SpecError as e:
        raise UsageError(f"--draft {args.draft}: not a valid spec:\n{e.render(args.draft, e.source)}") from None
    dim = draft.model.dims[0]
    if not dim.low <= rows <= dim.high:
        raise UsageError(f"--draft {args.draft}: its `{dim.name}` in {dim.low} .. {dim.high} has no {rows}-row block")
    context = args.context
    if context is not None and len(draft.model.dims) > 1:
        context = min(context, draft.model.dims[1].high - 1)
    static, where = static_costs.default_costs(args.draft, None)  # as `mkdsl plan DRAFT.mk` with no flags
    try:
        return make_plan(draft.local, batch=rows, context=context, static=static, static_from=where)
    except SpecError as e:  # the kernel cannot lower it (yet): the floor its step cannot beat
        from mkdsl.run.spec_drafters import drafter_floor_us

        first = e.diagnostics[0].message if e.diagnostics else str(e)
        return drafter_floor_us(draft.model, rows, context or 0)[0], f"`mkdsl check` says: {first}"


def _cost_options(args) -> dict:
    """The cost model's options of `mkdsl plan`: steps per device call, static compute ratios (the
    spec's committed file unless `--static-costs FILE|none` says otherwise)."""
    from mkdsl.plan import static_costs

    if args.steps_per_call < 1:
        raise UsageError(f"--steps-per-call must be at least 1, got {args.steps_per_call}")
    if args.static_costs == "none":
        return {"steps_per_call": args.steps_per_call, "static": None, "static_from": "the per-op estimate"}
    if args.static_costs:
        try:
            static = static_costs.load(Path(args.static_costs))
        except (OSError, ValueError) as e:
            raise UsageError(
                f"--static-costs {args.static_costs}: not a JSON object with `compute_over_stream` (op -> number): {e}"
            ) from None
        return {"steps_per_call": args.steps_per_call, "static": static, "static_from": args.static_costs}
    try:
        static, where = static_costs.default_costs(args.spec, args.profile)
    except (OSError, ValueError) as e:
        raise UsageError(f"{static_costs.default_path(args.spec)}: {e} (`--static-costs none` skips it)") from None
    return {"steps_per_call": args.steps_per_call, "static": static, "static_from": where}


@contextlib.contextmanager
def _calibration(path: str | None):
    """The measured constants of plan/measured.py, replaced by a calibration file's while planning."""
    from mkdsl.plan import measured

    if path is None:
        yield
        return
    from mkdsl.backends.tpu import calibrate

    try:
        values = calibrate.read(Path(path))
        old = measured.apply(values, f"calibration {path}")
    except (OSError, ValueError) as e:
        raise UsageError(f"--calibration {path}: {e}") from None
    try:
        yield
    finally:
        measured.restore(old)


def _plan_static(args, source: str) -> int:
    """Compile the kernel with libtpu and time its loops from the final bundles."""
    from mkdsl.backends.tpu import bundles, static_run
    from mkdsl.backends.tpu.bundle_dump import DumpError

    clock = args.clock_ghz * 1e9
    print("compiling with libtpu ...", file=sys.stderr)
    try:
        read = static_run.read_schedule(source, args.spec, args.profile, args.batch, args.context, clock)
    except DumpError as e:
        raise CompilerFailure(str(e)) from None
    print(bundles.render_static(read.out.model.name, read.dump, read.timings, read.total_bundles, clock))
    if args.save_costs:
        found = static_run.save_costs(read, args.spec, args.batch, clock, Path(args.save_costs))
        print(f"\ncompute / stream per op for --static-costs: {found or 'none matched'} -> {args.save_costs}")
    return 0


def cmd_static_costs(args) -> int:
    """Every spec's static costs, one libtpu compile after the other, into specs/costs/."""
    from mkdsl.backends.tpu import static_run

    specs = args.specs or sorted(str(p) for p in Path("specs").glob("*.mk"))
    if not specs:
        raise UsageError("no specs given and no specs/*.mk here")
    for spec in specs:
        _read(spec)  # unreadable specs are usage errors, before any compile
    if not args.clock_ghz > 0:
        raise UsageError(f"--clock-ghz must be positive, got {args.clock_ghz}")
    return 1 if static_run.write_all(specs, args.clock_ghz * 1e9) else 0


def cmd_calibrate(args) -> int:
    """Microbenchmarks for plan/measured.py: timed on a TPU into a calibration file; checked only in
    interpret mode."""
    if args.devices is not None and (args.devices < 2 or args.devices & (args.devices - 1)):
        raise UsageError(f"--devices must be a power of two of at least 2, got {args.devices}")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_file():
        raise UsageError(f"--out {out}: not a file")
    if out is not None and not out.parent.is_dir():
        raise UsageError(f"--out {out}: no directory {out.parent}")
    if args.interpret:
        _host_devices(args.devices or 4)  # before jax starts: virtual CPU devices for the exchanges
    import jax

    from mkdsl.backends.tpu import calibrate

    if not args.interpret and jax.default_backend() != "tpu":
        raise UsageError("no TPU here: `mkdsl calibrate --interpret` checks the microbenchmarks on the CPU")
    have = len(jax.devices())
    devices = args.devices or (4 if args.interpret else 1 << (have.bit_length() - 1))
    if devices > have or devices < 2:
        raise UsageError(f"the exchanges need {max(devices, 2)} devices; {have} here")
    return 1 if calibrate.calibrate(out, args.interpret, devices) else 0


_PROCESSES = 1  # processes in the cluster (`_join_cluster`)


def _one_process_kernel(what: str, hint: str = "") -> None:
    """The kernel in TPU interpret mode (no TPU here) does not run across processes (it hangs in
    jax 0.10.2: docs/multihost.md); say so before any slow work."""
    from mkdsl.jax_setup import tpu_attached

    if _PROCESSES > 1 and not tpu_attached():
        raise UsageError(
            f"{what} runs the kernel in TPU interpret mode, which does not run across processes "
            f"(docs/multihost.md); run it as one process{hint}"
        )


def _host_devices(n: int) -> None:
    """Ask XLA for `n` virtual CPU devices in all (sharded kernels run one per device in
    interpret mode), `n / processes` in each process of a cluster. Must happen before jax starts
    its CPU backend; libtpu's compile-only devices still work."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        if n % _PROCESSES:
            raise UsageError(f"the spec's {n} devices do not divide among {_PROCESSES} processes")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n // _PROCESSES}".strip()


def cmd_verify(args) -> int:
    import math
    import tempfile

    from mkdsl.compiler import compile_source

    _one_process_kernel("mkdsl verify")
    if args.against is not None:
        return _verify_against(args)
    if args.weights is not None or args.prompt is not None:
        raise UsageError("--weights and --prompt compare a checkpoint with transformers: add --against transformers")
    source = _read(args.spec)
    try:
        out, _ = compile_source(source, args.spec, args.profile, None)
    except SpecError as e:
        e.source = source
        raise
    devices = math.prod(n for _, n in out.model.mesh) if out.model.mesh else 1
    if args.devices is not None and args.devices < devices:
        raise UsageError(f"--devices {args.devices}: the spec's mesh needs {devices} devices")
    _host_devices(args.devices or max(devices, 1))
    rows = out.model.dims[0]
    batches = args.batch or [rows.low]
    for b in batches:
        if not rows.low <= b <= rows.high:
            raise UsageError(f"--batch {b} is outside `{rows.name}` in {rows.low} .. {rows.high} (spec {args.spec})")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if not 1 <= args.rows <= 16 or any(b * args.rows > max(rows.high, 16) for b in batches):
        raise UsageError(f"--rows {args.rows}: verify rows must be 1..16, batch x rows at most {max(rows.high, 16)}")
    if not args.no_compile:
        _need_libtpu("verify's compile check", "; `--no-compile` skips it")
    return _run_verify(args, out, batches, tempfile)


def _need_libtpu(what: str, alternative: str = "") -> None:
    """A missing optional dependency is a usage problem, said before any slow work."""
    from mkdsl.backends.tpu.libtpu import missing

    problem = missing()
    if problem:
        raise UsageError(f"{what} needs libtpu: {problem}{alternative}")


def _verify_against(args) -> int:
    """`verify --against transformers`: the spec against the model's own implementation."""
    if args.steps < 1 or args.prompt_tokens < 1:
        raise UsageError(f"--steps and --prompt-tokens must be at least 1, got {args.steps} and {args.prompt_tokens}")
    if args.prompt is not None and args.weights is None:
        raise UsageError("--prompt needs --weights (the checkpoint's tokenizer); without it the prompts are random")
    if args.weights is not None and not os.path.isdir(args.weights):
        raise UsageError(f"--weights {args.weights}: not a directory (a Hugging Face checkpoint directory)")
    _host_devices(1)
    spec = _load_spec(args)
    from mkdsl.checkpoint.formats import CheckpointError
    from mkdsl.verify.transformers import OracleError, verify_against_transformers, verify_checkpoint

    try:
        if args.weights is None:
            report = verify_against_transformers(spec.model, args.spec, steps=args.steps, prompt=args.prompt_tokens)
        else:
            prompts = _encoded_prompts(args.weights, args.prompt)
            report = verify_checkpoint(
                spec.model, args.spec, args.weights, prompts, steps=args.steps, prompt=args.prompt_tokens
            )
    except (OracleError, CheckpointError) as e:
        print(f"mkdsl: error: {e}", file=sys.stderr)
        return 1
    print(report.text())
    print(f"{args.spec}: {'agrees with transformers' if report.ok else 'FAILED'}")
    return 0 if report.ok else 1


def _encoded_prompts(directory: str, prompts: list[str] | None):
    """The prompts as token ids by the checkpoint's tokenizer (None: random prompts)."""
    if prompts is None:
        return None
    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.tokenizer import load_codec

    codec = load_codec(open_checkpoint(directory))
    return [codec.encode(p) for p in prompts]


def _run_verify(args, out, batches, tempfile) -> int:
    from tqdm import tqdm

    from mkdsl.verify import kernel as verify

    with tempfile.TemporaryDirectory(prefix="mkdsl-verify-") as tmp:
        text = out.files["kernel.py"]
        module = verify.import_generated(text, tmp, "kernel")
        checker = verify.LayerChecker(out.model, rows=args.rows)
        results = []
        with tqdm(total=len(batches) * args.steps, desc="interpret steps", unit="step", file=sys.stderr) as bar:
            for b in batches:
                one = verify.check_batch(
                    out.model, module, checker, b, args.steps, seed=b, progress=bar, rows=args.rows
                )
                results.append(one)
        compiled = None
        if not args.no_compile:
            print("compiling with libtpu ...", file=sys.stderr)
            fresh = lambda: verify.import_generated(text, tmp, "kernel_vmem")  # noqa: E731
            compiled = verify.compile_check(module, out.plan.vmem_total, batches[0], fresh, args.rows)
    print(verify.summary_table(results, compiled))
    if compiled is not None and compiled.internal:
        from mkdsl.backends.tpu.mosaic_errors import KernelCompileError

        raise KernelCompileError("", text=compiled.error)
    failed = any(r.failures for r in results) or (compiled is not None and compiled.error is not None)
    print(f"{args.spec}: {'FAILED' if failed else 'verified'}")
    return 1 if failed else 0


def cmd_run(args) -> int:
    from mkdsl.run import prompts as run_prompts

    with run_prompts.interrupts_kept() as interrupted:
        return _run(args, interrupted)


def _run(args, interrupted: list[bool]) -> int:
    _check_run_args(args)
    if args.decode == "kernel":
        _one_process_kernel("mkdsl run --decode kernel", ", or with --decode reference")
    texts = _prompt_texts(args)  # piped standard input is read now: an empty one is known at once
    spec, module, weights, codec, groups = _prepare_run(args, texts, interrupted)
    for group in groups if groups is not None else _typed_groups(args, codec, module):
        _run_prompt(args, spec, module, weights, codec, group, interrupted)
    return 0


def _prepare_run(args, texts: list[str] | None, interrupted: list[bool] | None, serving: bool = False):
    """(spec, kernel module, weights on the devices, tokenizer, the prompts' groups) for `run` and
    `serve`: every argument, every known prompt and the checkpoint's fit checked before the
    compile and the load. `serving`: no prompts; the batch defaults to the spec's most rows."""
    import math

    from mkdsl.api import Spec, for_checkpoint, spec_profiles
    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.loader import load_weights, plan_load
    from mkdsl.checkpoint.tokenizer import load_codec
    from mkdsl.jax_setup import tpu_attached
    from mkdsl.run import prompts as run_prompts
    from mkdsl.spmd.shard import shard

    model, source, module_ast = _load(args)
    try:
        local = shard(model)
    except SpecError as e:
        e.source = source
        raise
    spec = Spec(args.spec, args.profile, source, model, local, tuple(spec_profiles(module_ast)))
    if getattr(args, "draft", None) not in (None, "ngram"):
        args.draft_spec = _check_pairing(args, model)  # before the compile and the load
    devices = math.prod(n for _, n in model.mesh) if model.mesh else 1
    if devices > 1 and not tpu_attached():
        _host_devices(devices)  # a sharded kernel in interpret mode: one virtual CPU device per core
    rows = model.dims[0]
    if serving and args.batch is None:  # serve: the spec's most rows
        args.batch = rows.high
    elif not serving:
        args.batch = run_prompts.batch_of(args.batch, args.prompt, rows.low, rows.high)
    if not rows.low <= args.batch <= rows.high:
        raise UsageError(
            f"--batch {args.batch} is outside `{rows.name}` in {rows.low} .. {rows.high} (spec {args.spec})"
        )
    if not os.path.exists(args.weights):
        raise UsageError(f"--weights {args.weights}: no such file or directory")
    reader = open_checkpoint(args.weights)
    source, module_ast, retyped = for_checkpoint(source, module_ast, model, args.profile, reader)
    if retyped is not model:  # weights a `| stored` mapping keeps as the file has them
        _say_stored(args.weights, retyped)
        model = retyped
        spec = Spec(args.spec, args.profile, source, model, shard(model), tuple(spec_profiles(module_ast)))
    plan_load(model, reader)  # a checkpoint that does not fit fails here, before the compile
    codec = load_codec(reader)
    from mkdsl.run.decode import cached_kernel, use_compilation_cache

    module, _ = cached_kernel(source, args.spec, args.profile)
    use_compilation_cache()
    groups = None if serving else _prompt_groups(args, codec, module, texts)  # known prompts, before the load
    if not serving:
        _say_emulation(args, module)
    weights, report = load_weights(model, reader, module=module, progress=sys.stderr.isatty())
    if interrupted is not None:
        run_prompts.check(interrupted)  # an interrupt JAX's collector swallowed during the load
    print(f"{args.weights}: {report.summary()}", file=sys.stderr)
    _loaded_by_all(args.weights, report)
    return spec, module, weights, codec, groups


def _say_stored(path: str, model) -> None:
    """Which weights keep the file's GGUF block format, and the bytes a step streams for them."""
    import math
    from collections import Counter

    from mkdsl.lang.dtypes import storage_bytes

    kept = [t for t in model.weights if t.type.dtype.gguf]
    if not kept:
        return
    count = Counter(str(t.type.dtype) for t in kept)
    stored = sum(storage_bytes(t.type.dtype, tuple(t.full_shape)) for t in kept)
    values = sum(math.prod(t.full_shape) for t in kept)
    formats = ", ".join(f"{n} {f}" for f, n in sorted(count.items()))
    print(
        f"{path}: kept as stored: {formats} weights, {stored / 2**20:.1f} MiB "
        f"({8 * stored / values:.2f} bits per weight), decoded in VMEM tile by tile",
        file=sys.stderr,
    )


def _loaded_by_all(path: str, report) -> None:
    """On a cluster, process 0 adds up what every process read."""
    from mkdsl.run.distributed import gather_counts, is_main

    counts = gather_counts([report.tensors, report.bytes_read / 2**20])
    if len(counts) > 1 and is_main():
        tensors, mib = counts.sum(axis=0)
        each = ", ".join(f"{m:.1f}" for m in counts[:, 1])
        print(
            f"{path}: {len(counts)} processes read {int(tensors)} tensors, {mib:.1f} MiB in all ({each} MiB each)",
            file=sys.stderr,
        )


def _mesh(module):
    """The kernel's mesh over every process's devices (None for a one-device spec)."""
    return module.make_mesh() if hasattr(module, "MESH_SHAPE") else None


def cmd_serve(args) -> int:
    from mkdsl.run import serve

    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: not a port number")
    if args.decode == "kernel":
        _one_process_kernel("mkdsl serve --decode kernel", ", or with --decode reference")
    _check_draft_args(args)
    if args.draft is not None:
        if _PROCESSES > 1:
            raise UsageError("serve --draft runs on one process (the accept loop is on its host)")
        args.batch = 1  # one sequence per verify step, as `run --draft`
    spec, module, weights, codec, _ = _prepare_run(args, None, None, serving=True)
    batch = args.batch
    seq_len = args.context if args.context is not None else 4 * module.KV_TILE
    if seq_len % module.KV_TILE or not module.SEQ_RANGE[0] <= seq_len <= module.SEQ_RANGE[1]:
        raise UsageError(f"--context {seq_len}: must be a multiple of {module.KV_TILE} in {module.SEQ_RANGE}")
    from mkdsl.run.prefill import PrefillError

    options = {"interpret": _interpret(args), "decode": args.decode, "mesh": _mesh(module)}
    options["draft"] = _serve_drafter(args, spec, seq_len)
    try:
        serve.run_server(spec, module, weights, codec, batch, seq_len, args.host, args.port, args.model_name, **options)
    except PrefillError as e:
        raise UsageError(f"serve needs the spec's XLA prefill (each request prefills its own row): {e}") from None
    return 0


def _serve_drafter(args, spec, seq_len: int):
    """`serve --draft`: (its name, a function making a request's drafter), its weights loaded once
    (as `run --draft` loads them); None without --draft."""
    from mkdsl.run.drafters import make_drafter

    if args.draft is None:
        return None
    draft_spec = getattr(args, "draft_spec", None)  # loaded and paired by _check_pairing
    weights = _draft_weights(args, spec, draft_spec)
    if weights is None and draft_spec is not None:  # drawn once, not per request (seed 0, as make_drafter's)
        from mkdsl.run.spec_drafters import random_drafter_weights

        weights = random_drafter_weights(draft_spec)
    name = draft_spec if args.draft.endswith(".mk") else args.draft
    rows = args.draft_rows or 4
    return args.draft, lambda: make_drafter(name, rows, spec, weights, seq_len=seq_len)


def _check_run_args(args) -> None:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature and --top-k must be >= 0 and --top-p in (0, 1]")
    if args.steps_per_call < 1:
        raise UsageError(f"--steps-per-call must be at least 1, got {args.steps_per_call}")
    _check_draft_args(args)


def _check_draft_args(args) -> None:
    """`run --draft` and `serve --draft`: a drafter kind, R in 2..16, one sequence, a readable
    --draft-weights (before any loading; what the drafter pairs with is checked once the spec is
    read, `_check_pairing`)."""
    from mkdsl.run.drafters import DrafterUnavailable, check_draft

    if args.draft is None:
        if args.draft_weights is not None or args.draft_rows is not None:
            raise UsageError("--draft-weights and --draft-rows need --draft")
        return
    try:
        check_draft(args.draft)
    except DrafterUnavailable as e:
        raise UsageError(str(e)) from None
    if args.draft_weights is not None and args.draft == "ngram":
        raise UsageError("--draft-weights: the n-gram drafter has no weights")
    if args.draft_weights is not None and not os.path.exists(args.draft_weights):
        raise UsageError(f"--draft-weights {args.draft_weights}: no such file or directory")
    if args.draft.endswith(".mk"):
        _read(args.draft)  # unreadable or oversized files are usage errors
    if not 2 <= (args.draft_rows or 4) <= 16:
        raise UsageError(f"--draft-rows must be in 2 .. 16 (the anchor and 1..15 drafts), got {args.draft_rows}")
    if (
        args.batch not in (None, 1)
        or len(getattr(args, "prompt", None) or ()) > 1
        or getattr(args, "steps_per_call", 1) != 1
    ):
        needs = "--batch 1, --steps-per-call 1" if hasattr(args, "steps_per_call") else "--batch 1"  # serve: no steps
        raise UsageError(f"--draft decodes one sequence, one verify step per call: {needs}")


def _check_pairing(args, model):
    """`run --draft mtp|DRAFT.mk`: the target declares an `mtp` head, or the draft spec is valid and
    pairs with the target (context layers it has, its width, its vocabulary), and its rows fit
    --draft-rows; before the compile and the load. Returns the draft `Spec` (None for mtp)."""
    from mkdsl.api import load
    from mkdsl.run.spec_drafters import DraftSpecError, check_pairing

    if args.draft == "mtp":
        if model.mtp is None:
            raise UsageError(f"--draft mtp: {model.name} ({args.spec}) declares no `mtp` head")
        _draft_checkpoint_fits(args, model)
        return None
    try:
        draft = load(args.draft, args.profile if args.profile in _profiles_of(args.draft) else None)
        check_pairing(draft.model, model)
    except SpecError as e:
        raise UsageError(f"--draft {args.draft}: not a valid spec:\n{e.render(args.draft, e.source)}") from None
    except DraftSpecError as e:
        raise UsageError(f"--draft {args.draft}: {e}") from None
    lo, hi = draft.batch_range
    if not lo <= (args.draft_rows or 4) <= hi:
        raise UsageError(
            f"--draft {args.draft}: its rows {lo} .. {hi} have no block of --draft-rows {args.draft_rows or 4}"
        )
    _draft_checkpoint_fits(args, draft.model)
    return draft


def _draft_checkpoint_fits(args, model) -> None:
    """--draft-weights holds the drafter's tensors (CheckpointError, exit 1, naming each one that
    does not fit), before any compile or load."""
    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.loader import plan_load

    if args.draft_weights is not None:
        plan_load(model, open_checkpoint(args.draft_weights))


def _profiles_of(path: str) -> tuple[str, ...]:
    """The profiles a spec declares (none if it does not parse: `load` reports that)."""
    from mkdsl.api import spec_profiles
    from mkdsl.lang.syntax import parse

    try:
        return tuple(spec_profiles(parse(_read(path))))
    except SpecError:
        return ()


def _prompt_texts(args) -> list[str] | None:
    """`--prompt`s or piped standard input, checked; None: a terminal, read as the user types."""
    from mkdsl.run.prompts import PromptError, given

    try:
        return given(args.prompt, sys.stdin)
    except PromptError as e:
        raise UsageError(str(e)) from None


def _prompt_groups(args, codec, module, texts: list[str] | None):
    """The known prompts as generations of `--batch` rows, each checked against the cache; for a
    terminal, `--max-tokens` alone is checked (with a one-token prompt)."""
    from mkdsl.run.decode import cache_length
    from mkdsl.run.prompts import PromptError, groups

    def fits(longest: int) -> str | None:
        need = cache_length(longest, args.max_tokens, args.steps_per_call, module.KV_TILE)
        if need <= module.SEQ_RANGE[1]:
            return None
        return f"{longest} prompt tokens + --max-tokens {args.max_tokens} exceed the cache ({module.SEQ_RANGE[1]})"

    def encode(text: str) -> list[int]:
        return codec.encode(codec.chat(text) if args.chat else text)

    try:
        if texts is None:
            problem = fits(1)
            if problem:
                raise PromptError(problem)
            return None
        return groups(texts, args.batch, encode, fits)
    except PromptError as e:
        raise UsageError(str(e)) from None


def _typed_groups(args, codec, module):
    """Prompts typed at a terminal, one generation each (every row the same)."""
    for text in _stdin_prompts():
        try:
            yield from _prompt_groups(args, codec, module, [text])
        except UsageError as e:
            print(f"mkdsl: error: {e}", file=sys.stderr)


def _say_emulation(args, module) -> None:
    """Once, before the load: the CPU path is an emulation, and about how long it will take."""
    if _interpret(args) is None:
        return
    import math

    from mkdsl.run.prompts import emulation_notice

    layout = module.weight_layout()
    nbytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in layout.values())
    verify_rows = args.draft_rows if getattr(args, "draft", None) else 1
    print(emulation_notice(nbytes, args.max_tokens, args.batch, verify_rows), file=sys.stderr, flush=True)


def _stdin_prompts():
    """Prompts from standard input, one a line (a `> ` prompt on a terminal)."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _run_prompt(args, spec, module, weights, codec, group, interrupted) -> None:
    from mkdsl.run.decode import Decoder, cache_length, generate
    from mkdsl.run.sampling import Sampling

    longest = max(len(ids) for ids in group.ids)
    rows = (args.draft_rows or 4) if args.draft else args.steps_per_call  # what one call may run past the end
    seq_len = cache_length(longest, args.max_tokens, rows, module.KV_TILE)
    _fits(spec, args.batch, seq_len - 1)  # caches of this length for every row must fit in HBM
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    options = {"seed": args.seed, "steps_per_call": args.steps_per_call, "prefill": args.prefill}
    options |= {"decode": args.decode, "mesh": _mesh(module)}
    decoder = Decoder(spec, module, weights, args.batch, seq_len, sampling, interpret=_interpret(args), **options)
    stream = _TextStream(codec, interrupted)
    if not args.chat:
        sys.stdout.write(group.texts[0])
        sys.stdout.flush()
    if args.draft:
        return _run_draft(args, decoder, list(group.ids[0]), codec, stream)
    result = generate(decoder, [list(ids) for ids in group.ids], args.max_tokens, codec.eos_ids, stream.push)
    sys.stdout.write("\n")
    same = len(set(group.texts)) == 1
    for b in range(1, group.shown if not same else args.batch):
        shown = "" if same or args.chat else group.texts[b]
        print(f"[row {b}] {shown}{codec.decode(_until(result.tokens[b], codec.eos_ids))}")
    sys.stdout.flush()
    from mkdsl.run.distributed import is_main

    if is_main():
        print(result.summary(args.batch), file=sys.stderr)


def _run_draft(args, decoder, ids, codec, stream) -> None:
    """Speculative decoding of one sequence: the prefill, then the accept loop on the host, one
    R-row verify step per call."""
    from mkdsl.run.drafters import make_drafter
    from mkdsl.run.speculative import run_decoder

    draft_spec = getattr(args, "draft_spec", None)  # loaded and paired by _check_pairing
    weights = _draft_weights(args, decoder.spec, draft_spec)
    name = draft_spec if args.draft.endswith(".mk") else args.draft
    drafter = make_drafter(name, args.draft_rows or 4, decoder.spec, weights, seed=args.seed, seq_len=decoder.seq_len)
    out, prefill_s, how = run_decoder(decoder, drafter, ids, args.max_tokens, codec.eos_ids, lambda t: stream.push([t]))
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"prefill ({how}) {prefill_s:.2f} s for {len(ids)} tokens; {out.summary(args.draft)}", file=sys.stderr)


def _draft_weights(args, spec, draft_spec) -> dict | None:
    """A model drafter's weights in the spec's layout (the reference runs it): --draft-weights, or
    for mtp the target's checkpoint (its head's tensors); a draft spec without --draft-weights
    gets random ones (said on standard error: the output stays exact, the drafts are noise)."""
    from mkdsl.checkpoint.loader import load_weights

    if args.draft == "ngram":
        return None
    owner = spec if args.draft == "mtp" else draft_spec
    path = args.draft_weights or (args.weights if args.draft == "mtp" else None)
    if path is None:
        print(
            f"--draft {args.draft}: no --draft-weights, random drafter weights (exact output, few accepted)",
            file=sys.stderr,
        )
        return None
    weights, report = load_weights(owner, path, host=True, progress=False)
    print(f"{path} (drafter): {report.summary()}", file=sys.stderr)
    return weights


def _until(tokens, stop) -> list[int]:
    out = []
    for t in tokens:
        if int(t) in stop:
            break
        out.append(int(t))
    return out


class _TextStream:
    """Row 0's text printed as it is generated (a partial UTF-8 character waits for its end)."""

    def __init__(self, codec, interrupted: list[bool] | None = None):
        self.codec, self.ids, self.shown, self.stopped = codec, [], "", False
        self.interrupted = interrupted if interrupted is not None else []

    def push(self, new) -> None:
        from mkdsl.run.prompts import check

        check(self.interrupted)  # a Ctrl-C swallowed by a collector callback stops the run here
        for t in new[0]:
            if self.stopped or int(t) in self.codec.eos_ids:
                self.stopped = True
                return
            self.ids.append(int(t))
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[len(self.shown) :])
        sys.stdout.flush()
        self.shown = text


def _interpret(args):
    """TPU interpret mode (on the CPU) when asked or when JAX has no TPU; None to compile for the TPU."""
    import jax

    if not args.interpret and jax.default_backend() == "tpu":
        return None
    from mkdsl.backends.tpu.interpret import interpret_params

    return interpret_params()


def cmd_bench(args) -> int:
    from mkdsl import api
    from mkdsl.run import bench

    _one_process_kernel("mkdsl bench")
    spec = _load_spec(args)
    import math

    devices = math.prod(n for _, n in spec.model.mesh) if spec.model.mesh else 1
    _host_devices(max(devices, 1))
    native = bench.on_tpu()
    low, high = spec.batch_range
    try:
        batches = bench.parse_batches(args.batch, low, high, list(range(low, high + 1)) if native else [low])
    except ValueError as e:
        raise UsageError(f"{e} (spec {args.spec})") from None
    module = api.load_kernel(spec)
    seq_len = args.context + 1 if args.context is not None else module.KV_TILE
    if seq_len % module.KV_TILE or not module.SEQ_RANGE[0] <= seq_len <= module.SEQ_RANGE[1]:
        raise UsageError(f"--context {args.context}: the cache (context + 1) must be a multiple of {module.KV_TILE}")
    for b in batches:  # a batch x context that does not fit in HBM: exit 1 before anything runs
        _fits(spec, b, seq_len - 1)
    weights = _bench_weights(args, spec)
    if not native:
        print("mkdsl bench: no TPU here; running in TPU interpret mode (CPU timings, not TPU timings)", file=sys.stderr)
    with _calibration(args.calibration):
        rows = bench.bench(spec, batches, seq_len, steps=args.steps, weights=weights)
    print(bench.render(spec, rows, native))
    return 0


def _fits(spec, batch: int, context: int) -> None:
    """SpecError (exit 1) naming the largest context that fits when batch x context exceeds HBM."""
    from mkdsl.run.bench import modeled

    try:
        modeled(spec, batch, context)
    except SpecError as e:
        e.source = spec.source
        raise


def _load_spec(args):
    from mkdsl import api

    _read(args.spec)  # unreadable or oversized files are usage errors
    try:
        return api.load(args.spec, args.profile)
    except api.ProfileError as e:
        raise UsageError(str(e)) from None


def _bench_weights(args, spec):
    """A checkpoint's weights in the spec's (the reference's) layout, or None for random ones."""
    if args.weights is None:
        return None
    from mkdsl.checkpoint.loader import load_weights

    weights, _ = load_weights(spec, args.weights, progress=sys.stderr.isatty(), host=True)
    return weights


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mkdsl", description="Compile model decode specs (.mk) to Pallas TPU megakernels.")
    p.add_argument("--version", action="version", version=f"mkdsl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_command(name: str, help: str, fn):
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("spec", metavar="SPEC", help="path to a .mk spec")
        c.add_argument("--profile", "-p", help="apply a named profile's constant overrides (e.g. mini)")
        c.set_defaults(fn=fn, parser=c)
        return c

    c = spec_command("check", "parse and check a spec; print diagnostics only", cmd_check)
    c.add_argument(
        "--dump",
        choices=("ir", "local-ir"),
        help="print the graph IR (local-ir: what one device runs, after sharding) instead of the summary",
    )
    c = spec_command("compile", "check, plan and generate the kernel module and its plan report", cmd_compile)
    c.add_argument("-o", "--output", metavar="DIR", help="output directory (default: generated/<model>[_<profile>])")
    c.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 with a summary if the output directory is stale"
    )
    _verify_parser(spec_command)
    _plan_parser(spec_command("plan", "print where the modeled time goes (--full: the whole plan report)", cmd_plan))
    _run_parser(spec_command)
    _cost_parsers(sub)
    c = spec_command(
        "bench", "time the kernel's step: ms/step, tokens/s and % of the HBM floor (CPU: interpret mode)", cmd_bench
    )
    c.add_argument(
        "--batch",
        action="append",
        metavar="N|A..B",
        help="batches to time (default: all on a TPU, the smallest on a CPU)",
    )
    c.add_argument(
        "--context", type=int, default=None, help="cached tokens per row (cache = context + 1; default: one KV tile)"
    )
    c.add_argument("--steps", type=int, default=3, help="timed steps per batch (default 3; the median is shown)")
    c.add_argument("--weights", metavar="PATH", help="a checkpoint instead of random weights")
    c.add_argument(
        "--calibration", metavar="FILE", help="the cost model's constants from `mkdsl calibrate` (the ratio)"
    )
    _cluster_args(c)
    _serve_parser(spec_command)
    return p


def _verify_parser(spec_command) -> None:
    """`mkdsl verify`'s arguments."""
    c = spec_command(
        "verify",
        "run the kernel in TPU interpret mode against the reference, layer by layer, and compile it",
        cmd_verify,
    )
    c.add_argument("--batch", type=int, action="append", help="rows decoded together; repeat for several (default: 1)")
    c.add_argument("--steps", type=int, default=2, help="decode steps per batch (default 2)")
    c.add_argument(
        "--rows",
        type=int,
        default=1,
        help="verify rows per sequence (speculative decoding: R rows, each step committed at a random length)",
    )
    c.add_argument("--devices", type=int, default=None, help="virtual CPU devices (default: the spec's mesh size)")
    c.add_argument("--no-compile", action="store_true", help="skip the libtpu compile for TPU7x")
    c.add_argument(
        "--against",
        choices=("transformers",),
        help="instead: the spec against the model's own implementation (random weights through its `checkpoint hf`)",
    )
    c.add_argument(
        "--prompt-tokens", type=int, default=12, help="with --against: random prompt tokens before the steps (12)"
    )
    c.add_argument(
        "--weights",
        metavar="DIR",
        help="with --against: a Hugging Face checkpoint directory, read by transformers and by the spec's mapping",
    )
    c.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="with --weights: a prompt (the checkpoint's tokenizer); repeat for several (default: 3 random ones)",
    )
    _cluster_args(c)


def _cost_parsers(sub) -> None:
    """`mkdsl calibrate` and `mkdsl static-costs`: the cost model's measured inputs."""
    c = sub.add_parser(
        "calibrate",
        help="microbenchmarks for the cost model's constants: timed on a TPU (--out FILE), checked in interpret mode",
    )
    c.add_argument("--out", metavar="FILE", help="write the calibration file (for `mkdsl plan --calibration`)")
    c.add_argument("--interpret", action="store_true", help="TPU interpret mode on the CPU: results checked, not timed")
    c.add_argument("--devices", type=int, default=None, help="cores for the exchanges (default: all on a TPU, 4 here)")
    c.set_defaults(fn=cmd_calibrate, parser=c)
    c = sub.add_parser(
        "static-costs",
        help="read libtpu's schedule of every spec (compile-only TPU7x) into specs/costs/, for `plan` and `compile`",
    )
    c.add_argument("specs", nargs="*", metavar="SPEC", help="specs (default: every specs/*.mk)")
    c.add_argument("--clock-ghz", type=float, default=1.9, help="assumed TPU7x clock (not public; default 1.9)")
    c.set_defaults(fn=cmd_static_costs, parser=c)


def _cluster_args(c) -> None:
    """One process per host (docs/multihost.md): jax.distributed from these or the environment."""
    g = c.add_argument_group("multi-host (one process per host; default: JAX_COORDINATOR_ADDRESS etc.)")
    g.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address, or `auto` (JAX detects the cluster)"
    )
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in all (one per host)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process, 0 .. N-1 (0 prints and serves)")


def _serve_parser(spec_command) -> None:
    c = spec_command("serve", "serve a checkpoint over an OpenAI-compatible HTTP API", cmd_serve)
    c.add_argument("--weights", required=True, metavar="PATH", help="a .gguf or .safetensors file, index or directory")
    c.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    c.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    c.add_argument("--batch", type=int, default=None, help="rows: requests decoded together (default: the spec's most)")
    c.add_argument(
        "--context", type=int, default=None, help="tokens per row, prompt and completion (default: 4 KV tiles)"
    )
    c.add_argument("--model-name", default=None, help="the model id clients name (default: the spec's model name)")
    _decode_args(c)
    _draft_args(c, "speculative decoding with this drafter, one request at a time (ngram: prompt lookup)")
    _cluster_args(c)


def _decode_args(c) -> None:
    c.add_argument("--interpret", action="store_true", help="TPU interpret mode on the CPU (the default without a TPU)")
    c.add_argument(
        "--decode",
        choices=("kernel", "reference"),
        default="kernel",
        help="decode with the kernel (default) or the spec's unfused XLA reference step (sharded by XLA)",
    )


def _draft_args(c, what: str) -> None:
    """`run` and `serve`: the drafter of speculative decoding."""
    c.add_argument("--draft", metavar="ngram|mtp|DRAFT.mk", help=what)
    c.add_argument("--draft-rows", type=int, default=None, metavar="R", help="rows per verify step (default 4)")
    c.add_argument(
        "--draft-weights", metavar="PATH", help="the drafter's checkpoint (a draft spec's; mtp: default --weights)"
    )


def _plan_parser(c) -> None:
    """`mkdsl plan`'s options: what it shows, the plan's batch and context, the cost model's options."""
    shown = c.add_mutually_exclusive_group()
    shown.add_argument(
        "--full", action="store_true", help="the whole report (as plan.md): phases, DMAs, VMEM table, bytes"
    )
    shown.add_argument("--json", action="store_true", help="the plan as JSON (schema: docs/plan-schema.json)")
    c.add_argument(
        "--weights",
        metavar="PATH",
        default=None,
        help="plan the weights a `| stored` mapping keeps from this checkpoint in its formats (GGUF Q4_1, ...)",
    )
    shown.add_argument(
        "--placement",
        action="store_true",
        help="re-plan with each weight above its 1/N share split further; compare the modeled steps",
    )
    shown.add_argument(
        "--levers",
        action="store_true",
        help="re-plan with each lever not pulled (deeper ring, placement, fused collectives); compare",
    )
    shown.add_argument(
        "--static",
        action="store_true",
        help="compile with libtpu (compile-only TPU7x) and time each loop of the final bundles against its stream",
    )
    c.add_argument(
        "--clock-ghz", type=float, default=1.9, help="assumed TPU7x clock for --static (not public; default 1.9)"
    )
    c.add_argument(
        "--save-costs",
        metavar="FILE",
        default=None,
        help="with --static: write each op's compute / stream ratio (loops matched by bytes) for --static-costs",
    )
    c.add_argument("--batch", type=int, default=1, help="rows decoded together (default 1)")
    c.add_argument(
        "--context",
        type=int,
        default=None,
        help="cached tokens per row (default: a quarter of the cache, at most 4096)",
    )
    c.add_argument(
        "--calibration",
        metavar="FILE",
        default=None,
        help="constants measured by `mkdsl calibrate` on a TPU instead of plan/measured.py's borrowed ones",
    )
    c.add_argument(
        "--steps-per-call",
        type=int,
        default=1,
        help="decode steps per device call (default 1; the ~70 us per step is charged per step: measured so)",
    )
    c.add_argument(
        "--draft",
        metavar="ngram|mtp|DRAFT.mk",
        default=None,
        help="also model speculative decoding with this drafter: accepted tokens/s and its parts",
    )
    c.add_argument("--draft-rows", type=int, default=8, metavar="R", help="rows per verify step with --draft (8)")
    c.add_argument(
        "--acceptance", type=float, default=6.0, metavar="A", help="mean tokens accepted per step with --draft (6)"
    )
    c.add_argument(
        "--static-costs",
        metavar="FILE",
        default=None,
        help="JSON with `compute_over_stream` (op -> ratio from --static): the cost model's compute per op "
        "(default: the spec's costs/<name>.json if committed; `none`: the per-op estimate)",
    )


def _run_parser(spec_command) -> None:
    c = spec_command("run", "generate text from a checkpoint with the spec's kernel", cmd_run)
    c.add_argument("--weights", required=True, metavar="PATH", help="a .gguf or .safetensors file, index or directory")
    c.add_argument(
        "--prompt",
        action="append",
        help="a prompt; repeat for one per row of --batch (default: one prompt per line from standard input)",
    )
    c.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    c.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    c.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    c.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability")
    c.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    c.add_argument(
        "--batch",
        type=int,
        default=None,
        help="rows decoded together: the prompts fill them in order, one prompt fills all (default: one per --prompt)",
    )
    c.add_argument("--steps-per-call", type=int, default=1, help="decode steps per call (default 1)")
    _decode_args(c)
    _draft_args(c, "speculative decoding with this drafter (ngram: prompt lookup; one sequence)")
    c.add_argument(
        "--prefill",
        choices=("auto", "xla", "steps"),
        default="auto",
        help="the prompt through the spec's XLA prefill (auto: when every op has a prefill rule) or kernel steps",
    )
    _cluster_args(c)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # reported with the subcommand's usage, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        watch = _join_cluster(args)
    except UsageError as e:
        print(f"mkdsl: error: {e}", file=sys.stderr)
        return 2
    code = _dispatch(args, argv)
    if watch is not None:
        watch.stop()
        if code != 0:  # the others stop too, with this process's error
            watch.fail(getattr(args, "error_message", f"exit status {code}"), code, show=False)
    return code


def _join_cluster(args):
    """With --coordinator (or JAX_COORDINATOR_ADDRESS): join the cluster, print from process 0
    only, and watch for another process's failure. None for a single process."""
    if not hasattr(args, "coordinator"):
        return None
    from mkdsl.run import distributed

    try:
        cluster = distributed.Cluster.resolve(args.coordinator, args.num_processes, args.process_id)
    except distributed.ClusterError as e:
        raise UsageError(str(e)) from None
    if cluster is None:
        return None
    global _PROCESSES
    _PROCESSES = cluster.num_processes or 1
    distributed.initialize(cluster)
    # the id given, not jax.process_index(): that would start JAX's backends before
    # `_host_devices` sets the virtual CPU device count (with `auto`, a TPU's, it does not matter)
    main = cluster.process_id == 0 if cluster.process_id is not None else distributed.is_main()
    if not main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (text and figures from process 0 only)
    return distributed.FailureWatch(cluster.process_id).start()


def _error(args, message: str) -> None:
    """Print an error; on a cluster, the others stop with it (`FailureWatch`)."""
    args.error_message = message
    print(message, file=sys.stderr)


def _dispatch(args, argv: list[str] | None) -> int:
    try:
        return args.fn(args)
    except SpecError as e:
        _error(args, e.render(args.spec, getattr(e, "source", "")))
        return 1
    except UsageError as e:
        _error(args, f"mkdsl: error: {e}")
        return 2
    except CheckpointError as e:
        _error(args, f"mkdsl: error: {e}")
        return 1
    except (KernelCompileError, CompilerFailure) as e:  # libtpu rejected what mkdsl generated: mkdsl's bug
        print(f"mkdsl: internal compiler error: {e}\nThis is a bug in mkdsl's code generation.", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        _error(args, "mkdsl: interrupted")
        if argv is None and _PROCESSES == 1:  # the command itself: JAX's threads may be mid-compile,
            _exit_now(130)  # and tearing the interpreter down under them can crash; end it here
        return 130
    except BrokenPipeError:  # `mkdsl plan ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # a bug in mkdsl, never the user's fault
        if os.environ.get("MKDSL_DEBUG"):
            traceback.print_exc()
        if "Mosaic" in str(e):  # libtpu refused a kernel while a command ran it: say what it said
            from mkdsl.backends.tpu.libtpu import describe_failure

            _error(args, f"mkdsl: internal compiler error: {describe_failure(str(e), '')}")
            return 3
        _error(
            args,
            f"mkdsl: internal error: {type(e).__name__}: {e}\n"
            "This is a bug in mkdsl; rerun with MKDSL_DEBUG=1 for the traceback.",
        )
        return 3


def _exit_now(status: int) -> None:
    """End the process with `status` at once, output flushed, without interpreter teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
