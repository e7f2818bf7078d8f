"""The whole pipeline for one spec, and writing its output atomically.

parse -> elaborate -> shard -> plan -> emit (kernel.py) + report (plan.md)
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from mkdsl.backends.tpu.emit import Source, emit_module
from mkdsl.lang.elaborate import elaborate, spec_sha256
from mkdsl.lang.ir import Model
from mkdsl.lang.syntax import parse
from mkdsl.output import write_output
from mkdsl.plan import Plan, make_plan, static_costs
from mkdsl.plan.speculative import verify_plan
from mkdsl.report.markdown import render_picture, render_plan
from mkdsl.spmd.shard import shard


@dataclass(frozen=True)
class Output:
    model: Model  # the spec's model
    plan: Plan  # of `local`, at the smallest batch
    files: dict[str, str]  # file name -> text
    local: Model | None = None  # what one device runs (the model itself on a one-device mesh)


def project_root(spec: str) -> Path:
    """The project holding `spec`: the parent of specs/, else the spec's own directory."""
    spec_dir = Path(spec).resolve().parent
    return spec_dir.parent if spec_dir.name == "specs" else spec_dir


def default_out_dir(spec: str, model_name: str, profile: str | None) -> Path:
    """generated/<model>[_<profile>]/ in the project holding `spec`."""
    return project_root(spec) / "generated" / (model_name + (f"_{profile}" if profile else ""))


def compile_source(
    source: str, spec_path: str, profile: str | None, out_dir: Path | None = None
) -> tuple[Output, Path]:
    """Run every stage; nothing is written. Raises SpecError with all diagnostics of a stage."""
    model = elaborate(parse(source), profile, source)
    out = out_dir or default_out_dir(spec_path, model.name, profile)
    # The spec as named in the output: relative to its project, so the output does not depend on `out`.
    shown = os.path.relpath(Path(spec_path).resolve(), project_root(spec_path)).replace(os.sep, "/")
    local = shard(model)  # what one device runs (the model itself on a one-device mesh)
    static, where = static_costs.default_costs(spec_path, profile)  # as `mkdsl plan SPEC` with no flags
    budget = make_plan(local, batch=model.dims[0].high)  # VMEM at the largest batch
    timed = make_plan(local, batch=model.dims[0].high, static=static, static_from=where)  # plan.md's batch-8 row
    plan = make_plan(  # traffic and timing at the smallest
        local, batch=model.dims[0].low, ring_depth=budget.ring_depth, static=static, static_from=where
    )
    verify = verify_plan(local, None, budget.ring_depth, static=static, static_from=where)
    default = os.path.relpath(default_out_dir(spec_path, model.name, profile), project_root(spec_path))
    command = f"mkdsl compile {shown}{f' --profile {profile}' if profile else ''} -o {default.replace(os.sep, '/')}"
    src = Source(shown, source, spec_sha256(source), command)
    files = {
        "kernel.py": emit_module(model, local, budget, src),
        "plan.md": render_plan(local, plan, shown, wide=timed, verify=verify),
        "plan.svg": render_picture(local, plan),
    }
    return Output(model, plan, files, local), out


def stale_files(out: Output, out_dir: Path) -> list[str]:
    """Summary lines for every file that differs from what is on disk (empty: up to date)."""
    lines = []
    try:
        # every entry but Python's bytecode cache: a stray file or subdirectory is drift too
        existing = {p.name for p in out_dir.iterdir() if p.name != "__pycache__"} if out_dir.is_dir() else set()
    except OSError as e:
        return [f"{out_dir}: cannot be listed ({e.strerror or e})"]
    for name, text in out.files.items():
        path = out_dir / name
        old, problem = _read_generated(path)
        if problem:
            lines.append(f"{path}: {problem}")
        elif old != text:
            diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), lineterm="", n=0))
            plus = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
            minus = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
            first = next((d for d in diff if d.startswith("@@")), "")
            lines.append(f"{path}: differs (+{plus} -{minus} lines, first change {first})")
    for name in sorted(existing - set(out.files)):
        lines.append(f"{out_dir / name}: not produced by the compiler")
    return lines


def _read_generated(path: Path) -> tuple[str, str | None]:
    """The text of a file --check compares, or why it cannot be compared."""
    if not path.exists():
        return "", "missing"
    if not path.is_file():
        return "", "not a regular file"
    try:
        text = path.read_text(encoding="utf-8")
        if "\r" in path.read_bytes().decode("utf-8"):  # read_text translates line ends: CRLF would pass
            return "", "differs (CR or CRLF line ends)"
        return text, None
    except OSError as e:
        return "", f"unreadable ({e.strerror or e})"
    except UnicodeDecodeError:
        return "", "differs (not UTF-8 text)"


def write_atomically(out: Output, out_dir: Path) -> None:
    """Replace `out_dir` by the output, whole; refuse (OutputError) a path holding anything else."""
    write_output(out.files, out_dir)
