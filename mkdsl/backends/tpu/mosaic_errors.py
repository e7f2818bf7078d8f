"""A kernel libtpu rejects, reported as mkdsl's internal compiler error naming the spec line.

Mosaic's message names only the MLIR operation it refused (e.g. a `tpu.vector_load` of
`vector<1x64xf32>` from a `memref<16x1024xf32>`), without a location. The kernel is lowered again
with full Python tracebacks in the MLIR locations; the operations of the same kind and types in
the Mosaic body carry the generated kernel.py lines that made them, from the runtime code (its
function, e.g. `Recurrent.block`) out to the op's call in the decode step, which the emitter put
under a `# spec line N: ...` comment. A libtpu failure is never the user's fault: the CLI exits 3.
"""

from __future__ import annotations

import ast
import base64
import re
from collections.abc import Callable
from dataclasses import dataclass

MOSAIC = "Mosaic failed to compile"
_OP = re.compile(r'^\s*(?:%\S+ = )?"?([\w.]+)"?\(.*?:\s*\((.*?)\)\s*->\s*(.+?)\s+loc\((#loc\d*)\)$', re.M)
_SPEC_LINE = re.compile(r"^\s*# spec line (\d+): (.*)$")
_FILE_LINE = re.compile(r'"([^"]+)":(\d+):')


@dataclass(frozen=True)
class Site:
    """Where the refused operation came from: the spec line, its statement, the runtime function."""

    spec_line: int
    statement: str
    function: str
    kernel_line: int


class KernelCompileError(Exception):
    """libtpu rejected a generated kernel (a bug in mkdsl: exit 3). `text`: the rendered report
    as a child process printed it (`mkdsl plan --static` compiles in one)."""

    def __init__(self, mosaic: str, sites: tuple[Site, ...] = (), text: str | None = None):
        self.mosaic, self.sites = mosaic, sites
        super().__init__(text or self.render())

    def render(self) -> str:
        from mkdsl.ops import OPS

        lines = ["libtpu rejected the generated kernel"]
        by_line: dict[int, list[Site]] = {}
        for s in self.sites:
            by_line.setdefault(s.spec_line, []).append(s)
        for line, sites in sorted(by_line.items()):
            ops = [o for o in dict.fromkeys(re.findall(r"(\w+)\(", sites[0].statement)) if o in OPS]
            where = ", ".join(f"`{s.function}` (kernel.py:{s.kernel_line})" for s in sites)
            lines.append(f"  op {', '.join(ops) or '?'} at spec line {line}: {sites[0].statement}\n    in {where}")
        if not self.sites:
            lines.append("  (the operation could not be traced to a spec line)")
        lines.append("Mosaic: " + _mosaic_summary(self.mosaic))
        return "\n".join(lines)


def _mosaic_summary(message: str) -> str:
    """The message up to the operation it involves (without the "report a bug to JAX" trailer)."""
    keep = [ln for ln in message.strip().splitlines() if ln.strip() and "report a bug" not in ln]
    return "\n  ".join(keep[:6])


def is_mosaic_failure(error: BaseException) -> bool:
    return MOSAIC in str(error)


def _refused(message: str) -> tuple[str, str, str] | None:
    """(operation kind, memref shape, result type) of the operation Mosaic names."""
    m = re.search(r'"?(?:tpu|vector)[._](\w+)"?\((.*?)\).*?:\s*\((.*?)\)\s*->\s*(\S+)', message)
    if not m:
        return None
    memref = re.search(r"memref<([0-9x]+[a-z0-9]+)", m.group(3))
    return m.group(1).split("_")[-1], memref.group(1) if memref else "", m.group(4)


def _bare(type_: str) -> str:
    """A memref or vector type without its layout and memory space: `memref<512x576xbf16`."""
    return type_.split(",")[0].rstrip(">")


def _bodies(lowered_text: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", lowered_text)]


def _mosaic_text(body: bytes) -> str:
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir

    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True
    tpu.register_dialect(ctx)
    with ctx:
        return ir.Module.parse(body).operation.get_asm(enable_debug_info=True)


def _kernel_lines(loc: str, aliases: dict[str, str], path: str) -> list[int]:
    """The kernel.py lines of a location, innermost first (aliases `#locN` expanded)."""
    seen, out, todo = set(), [], [loc]
    while todo:
        ref = todo.pop(0)
        if ref in seen:
            continue
        seen.add(ref)
        text = aliases.get(ref, ref)
        out += [int(n) for f, n in _FILE_LINE.findall(text) if f == path]
        todo += re.findall(r"#loc\d*", text)
    return list(dict.fromkeys(out))


def _function_at(tree: ast.AST, line: int) -> str:
    """The innermost class/function of the kernel source containing `line`, dotted."""
    best: list[str] = []

    def walk(node, names):
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)) and child.lineno <= line <= child.end_lineno:
                walk(child, [*names, child.name])
                return
        best = names

    walk(tree, [])
    return ".".join(best) or "<module>"


def _spec_line(source: list[str], line: int) -> tuple[int, str] | None:
    """The `# spec line N: ...` comment the emitter put above a line of the decode step."""
    for i in range(line - 1, -1, -1):
        if m := _SPEC_LINE.match(source[i]):
            return int(m.group(1)), m.group(2)
        if re.match(r"(def|class) ", source[i]):
            return None
    return None


def locate(lowered_text: str, kernel_path: str, kernel_source: str, message: str) -> tuple[Site, ...]:
    """The spec lines whose kernel code made operations like the one Mosaic refused."""
    refused = _refused(message)
    if refused is None:
        return ()
    kind, memref, result = refused
    source, tree = kernel_source.splitlines(), ast.parse(kernel_source)
    sites: dict[tuple[int, str], Site] = {}
    for body in _bodies(lowered_text):
        text = _mosaic_text(body)
        aliases = dict(re.findall(r"^(#loc\d*) = (.*)$", text, re.M))
        for name, operands, res, loc in _OP.findall(text):
            if (
                not name.endswith(kind)
                or _bare(res) != _bare(result)
                or (memref and f"memref<{memref}" not in operands)
            ):
                continue
            lines = _kernel_lines(loc, aliases, kernel_path)
            if not lines:
                continue
            found = [s for s in (_spec_line(source, n) for n in lines) if s][:1]
            function = _function_at(tree, lines[0])
            for line, statement in found or _callers(source, _function_at(tree, lines[-1]).split(".")[0]):
                sites.setdefault((line, function), Site(line, statement, function, lines[0]))
    return _on_tensor(tuple(sites.values()), kernel_source, memref)


def _on_tensor(sites: tuple[Site, ...], kernel_source: str, memref: str) -> tuple[Site, ...]:
    """The sites whose statement names a declared tensor of the refused memref's shape (its
    trailing dims in the kernel's layout), where any does: a shared runtime function (the weight
    ring) is called from many spec lines, the refused access reads one tensor."""
    dims = tuple(int(d) for d in re.findall(r"(\d+)x", memref))
    if not dims:
        return sites
    names = {
        name
        for name, shape in re.findall(r'^\s*"(\w+)": \(\(([\d, ]+)\)', kernel_source, re.M)
        if tuple(int(d) for d in shape.replace(" ", "").split(",") if d)[-len(dims) :] == dims
    }
    named = tuple(s for s in sites if any(re.search(rf"\b{n}\b", s.statement) for n in names))
    return named or sites


def _callers(source: list[str], name: str) -> list[tuple[int, str]]:
    """The spec lines of the decode step's calls of runtime class or function `name` (a class's
    objects are built as `obj = Name(...)` and called as `obj(...)` or `obj.method(...)`)."""
    objects = {m.group(1) for ln in source if (m := re.match(rf"\s*(\w+) = {name}\(", ln))}
    called = objects or {name}
    out = []
    for i, ln in enumerate(source):
        if any(re.search(rf"(^|[^\w.]){re.escape(c)}[.(]", ln) for c in called) and (s := _spec_line(source, i + 1)):
            out.append(s)
    return list(dict.fromkeys(out))


def explain(error: BaseException, relower: Callable[[], object], kernel_path: str) -> KernelCompileError:
    """The internal compiler error for a libtpu failure, located when the kernel's source is found."""
    from pathlib import Path

    message = str(error)
    try:
        with _full_tracebacks():
            text = relower().as_text(debug_info=True)
        sites = locate(text, kernel_path, Path(kernel_path).read_text(encoding="utf-8"), message)
    except Exception:  # locating is best effort: the Mosaic message is reported either way
        sites = ()
    return KernelCompileError(message, sites)


class _full_tracebacks:  # noqa: N801 (a context manager used as a statement)
    """Full Python tracebacks (deep enough to reach the decode step) in MLIR locations."""

    def __enter__(self):
        from mkdsl.lazy import jax

        self.saved = (jax.config.jax_include_full_tracebacks_in_locations, jax.config.jax_traceback_in_locations_limit)
        jax.config.update("jax_include_full_tracebacks_in_locations", True)
        jax.config.update("jax_traceback_in_locations_limit", 64)

    def __exit__(self, *exc):
        from mkdsl.lazy import jax

        jax.config.update("jax_include_full_tracebacks_in_locations", self.saved[0])
        jax.config.update("jax_traceback_in_locations_limit", self.saved[1])
