"""The `mkdsl` command: check, plan and compile specs.

Exit status: 0 success, 1 errors in the spec (or stale output with --check), 2 usage errors
(bad arguments, unreadable files), 3 an internal compiler error (a bug in mkdsl).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import traceback

from mkdsl import __version__
from mkdsl.diagnostics import SpecError


class UsageError(Exception):
    pass


MAX_SPEC_BYTES = 2**20  # a spec is text a person writes (kimi_k3.mk is 10 KB): more is a mistake, slow to parse


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)  # bounded: the path may be /dev/zero or a huge file
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise UsageError(f"cannot read {path}: more than {MAX_SPEC_BYTES // 2**20} MiB, too large for a spec")
    try:
        return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()  # universal newlines, as open()
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {path}: not UTF-8 text") from None


def _load(args):
    from mkdsl.elaborate import elaborate
    from mkdsl.syntax import parse

    source = _read(args.spec)
    try:
        return elaborate(parse(source), args.profile, source), source
    except SpecError as e:
        e.source = source
        raise


def cmd_check(args) -> int:
    from mkdsl.shard import devices, shard

    t0 = time.perf_counter()
    model, source = _load(args)
    try:
        shard(model)  # shardings must also agree where tensors meet in an op
    except SpecError as e:
        e.source = source
        raise
    n_layers = len(model.schedule)
    kinds = ", ".join(f"{k.name} x{model.schedule.count(k.name)}" for k in model.kinds)
    print(
        f"{args.spec}: ok: model {model.name}"
        f"{f' (profile {model.profile})' if model.profile else ''}, {n_layers} layers ({kinds}), "
        f"{len(model.weights)} weights, {len(model.states)} state tensors"
        f"{f', {devices(model)} devices' if devices(model) > 1 else ''} [{time.perf_counter() - t0:.2f} s]"
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
    try:
        out, out_dir = compile_source(
            source, args.spec, args.profile, None if args.output is None else Path(args.output)
        )
    except SpecError as e:
        e.source = source
        raise
    shown = os.path.relpath(out_dir)
    if args.check:
        stale = stale_files(out, out_dir)
        if stale:
            print("\n".join(stale), file=sys.stderr)
            print(
                f"{shown} is stale: run `mkdsl compile {args.spec}"
                f"{f' --profile {args.profile}' if args.profile else ''}` and commit the result",
                file=sys.stderr,
            )
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
        f"  modeled step at batch {out.plan.batch}: {t.modeled_us:.1f} us, HBM floor {t.floor_us:.1f} us "
        f"({t.modeled_us / t.floor_us:.3f} x); VMEM {out.plan.vmem_total / 2**20:.1f} of {out.plan.vmem_cap / 2**20:.0f} MiB"
    )
    return 0


def cmd_plan(args) -> int:
    from mkdsl.plan import make_plan
    from mkdsl.report import render_plan

    model, source = _load(args)
    rows = model.dims[0]
    if not rows.low <= args.batch <= rows.high:
        raise UsageError(
            f"--batch {args.batch} is outside `{rows.name}` in {rows.low} .. {rows.high} (spec {args.spec})"
        )
    if args.context is not None and args.context < 0:
        raise UsageError(f"--context must be at least 0, got {args.context}")
    try:
        from mkdsl.shard import shard

        model = shard(model)  # the per-device model: plans and figures are per device (core)
        wide = make_plan(model, batch=rows.high, context=args.context)
        depth = wide.ring_depth  # the kernel's ring is sized for the largest batch
        plan = make_plan(model, batch=args.batch, context=args.context, ring_depth=depth)
    except SpecError as e:
        e.source = source
        raise
    print(render_plan(model, plan, args.spec, wide=wide))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mkdsl", description="Compile model decode specs (.mk) to Pallas TPU megakernels.")
    p.add_argument("--version", action="version", version=f"mkdsl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_command(name: str, help: str, fn):
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("spec", metavar="SPEC", help="path to a .mk spec")
        c.add_argument("--profile", "-p", help="apply a named profile's constant overrides (e.g. mini)")
        c.set_defaults(fn=fn)
        return c

    spec_command("check", "parse and check a spec; print diagnostics only", cmd_check)
    c = spec_command("compile", "check, plan and generate the kernel module and its plan report", cmd_compile)
    c.add_argument("-o", "--output", metavar="DIR", help="output directory (default: generated/<model>[_<profile>])")
    c.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 with a summary if the output directory is stale"
    )
    c = spec_command("plan", "print the plan: phases, DMA schedule, VMEM table, bytes, floor, modeled time", cmd_plan)
    c.add_argument("--batch", type=int, default=1, help="rows decoded together (default 1)")
    c.add_argument(
        "--context",
        type=int,
        default=None,
        help="cached tokens per row (default: a quarter of the cache, at most 4096)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except SpecError as e:
        print(e.render(args.spec, getattr(e, "source", "")), file=sys.stderr)
        return 1
    except UsageError as e:
        print(f"mkdsl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mkdsl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `mkdsl plan ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # a bug in mkdsl, never the user's fault
        if os.environ.get("MKDSL_DEBUG"):
            traceback.print_exc()
        print(
            f"mkdsl: internal error: {type(e).__name__}: {e}\n"
            "This is a bug in mkdsl; rerun with MKDSL_DEBUG=1 for the traceback.",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
