"""The docs cannot rot: every `mk` example in docs/language.md is checked by mkdsl, and the
manual's tables of ops (the ones a spec may call: internal ops, the collectives the shard pass
inserts, are left out), hints and constant expressions are compared with the code.

Fenced blocks are told apart by their info string (documented at the end of language.md):
`mk` a complete spec, `mk fragment` top-level items, `mk fragment body` statements, `mk error`
a spec whose diagnostics are the `text` block after it, `mk skip` not checked.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from mkdsl.cli import main
from mkdsl.lang.consts import ConstEnv
from mkdsl.lang.diagnostics import Reporter
from mkdsl.lang.elaborate import HINTS
from mkdsl.lang.syntax import parse
from mkdsl.ops import OPS, REQUIRED

DOCS = Path(__file__).resolve().parents[1] / "docs"
LANGUAGE = DOCS / "language.md"
KINDS = {"", "fragment", "fragment body", "error", "skip"}


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence
    info: str  # the info string after "```"
    text: str

    @property
    def kind(self) -> str:
        return self.info[len("mk") :].strip() if self.info.split()[:1] == ["mk"] else ""

    def __str__(self) -> str:
        return f"docs/language.md:{self.line} ({self.info})"


def fenced_blocks(path: Path) -> list[Block]:
    blocks, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\S.*)?$", lines[i])
        if m is None:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        blocks.append(Block(start, (m.group(1) or "").strip(), "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = fenced_blocks(LANGUAGE)
MK = [b for b in BLOCKS if b.info.split()[:1] == ["mk"]]


def by_kind(kind: str) -> list[Block]:
    return [b for b in MK if b.kind == kind]


def test_every_mk_block_has_a_known_kind():
    assert MK, "no mk blocks found"
    for b in MK:
        assert b.kind in KINDS, f"{b}: unknown info string; use one of: mk, " + ", ".join(
            f"mk {k}" for k in sorted(KINDS) if k
        )


def _check(tmp_path, monkeypatch, capsys, text: str, profile: str | None = None) -> tuple[int, str, str]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.mk").write_text(text, encoding="utf-8")
    status = main(["check", "spec.mk"] + (["--profile", profile] if profile else []))
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("block", by_kind(""), ids=str)
def test_complete_specs_check(block, tmp_path, monkeypatch, capsys):
    assert re.search(r"^\s*model\s+\w+", block.text, re.M), f"{block}: a complete spec needs `model NAME`"
    assert re.search(r"^\s*step\s*\(", block.text, re.M), f"{block}: a complete spec needs a `step`"
    profiles = [None, *re.findall(r"^\s*profile\s+(\w+)", block.text, re.M)]
    for profile in profiles:
        status, out, err = _check(tmp_path, monkeypatch, capsys, block.text, profile)
        assert status == 0, f"{block} (profile {profile}) does not check:\n{err}"
        assert ": ok: model " in out


@pytest.mark.parametrize("block", by_kind("fragment"), ids=str)
def test_fragments_parse(block):
    parse(block.text)


@pytest.mark.parametrize("block", by_kind("fragment body"), ids=str)
def test_statement_fragments_parse(block):
    parse("block fragment() {\n" + block.text + "}\n")


def test_error_examples_have_their_output():
    for b in by_kind("error"):
        after = BLOCKS[BLOCKS.index(b) + 1 :]
        assert after and after[0].info == "text", f"{b}: must be followed by a ```text block with the expected output"


@pytest.mark.parametrize("block", by_kind("error"), ids=str)
def test_error_examples_print_what_the_doc_shows(block, tmp_path, monkeypatch, capsys):
    expected = BLOCKS[BLOCKS.index(block) + 1].text
    status, out, err = _check(tmp_path, monkeypatch, capsys, block.text)
    assert status == 1
    assert out == ""
    assert err == expected


def table(heading: str) -> list[list[str]]:
    """Rows (cells stripped) of the markdown table whose header row starts with `heading`."""
    lines = LANGUAGE.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_op_table_matches_the_registry():
    rows = table("| op | operands | attributes |")
    documented = {}
    for row in rows:
        (name,) = ticked(row[0])
        assert name not in documented, f"op `{name}` is listed twice"
        documented[name] = row
    public = {name for name, op in OPS.items() if not op.internal}  # collectives are inserted, never called
    missing, extra = sorted(public - set(documented)), sorted(set(documented) - public)
    assert not missing, f"ops missing from the op table in docs/language.md: {', '.join(missing)}"
    assert not extra, f"the op table lists ops that are not registered or are internal: {', '.join(extra)}"
    for name, row in documented.items():
        op = OPS[name]
        assert tuple(ticked(row[1])) == op.operands, f"`{name}`: operands"
        attrs = {}
        for item in ticked(row[2]):
            key, _, value = item.partition("=")
            if key in op.attrs:
                attrs[key] = value
        assert set(attrs) == set(op.attrs), f"`{name}`: attributes"
        for key, value in attrs.items():
            default = op.attrs[key]
            if default is REQUIRED:
                assert value == "" and f"`{key}` (required)" in row[2], f"`{name}`: `{key}` is required"
            elif default is None:
                assert value == "" and f"`{key}` (default" in row[2], f"`{name}`: `{key}` has a computed default"
            else:
                value = {"true": "True", "false": "False"}.get(value, value)  # the language's spelling
                assert ast.literal_eval(value) == default and type(ast.literal_eval(value)) is type(default), (
                    f"`{name}`: default of `{key}` is {default!r}, the doc says {value}"
                )
        if op.inout:
            assert "in place" in row[4], f"`{name}` updates {op.inout} in place: say so"
        if op.outputs > 1:
            assert row[3].startswith(("two", "three")), f"`{name}` has {op.outputs} results"


def test_internal_ops_are_described_but_not_tabled():
    text = LANGUAGE.read_text(encoding="utf-8")
    internal = sorted(name for name, op in OPS.items() if op.internal)
    assert internal, "no internal ops registered"
    for name in internal:
        assert f"`{name}`" in text, f"internal op `{name}` (inserted by the compiler) is not described in language.md"


def test_hint_table_matches_the_checker():
    rows = table("| hint | meaning |")
    assert [ticked(r[0])[0] for r in rows] == list(HINTS)


_LITERALS = {"true": True, "false": False}


@pytest.mark.parametrize("row", table("| expression | value |"), ids=lambda r: r[0])
def test_constant_expression_table(row):
    (expr,) = ticked(row[0])
    module = parse(f"const c = {expr}")
    rep = Reporter()
    env = ConstEnv({d.name: d for d in module.items}, {}, rep)
    value = env.get("c")
    if row[1].startswith("error:"):
        assert value is None
        message = row[1][len("error:") :].strip()
        assert [d.message for d in rep.diagnostics] == [message]
    else:
        assert not rep.diagnostics, rep.diagnostics
        (shown,) = ticked(row[1])
        want = _LITERALS.get(shown, None)
        want = ast.literal_eval(shown) if want is None else want
        assert value == want and type(value) is type(want), f"`{expr}` is {value!r}, the doc says {shown}"


# ---------------------------------------------------------------- the worked examples of adding-an-op.md

ADDING = DOCS / "adding-an-op.md"
ROOT = DOCS.parent
# example -> (the files its diffs may touch, the spec edit that uses it in specs/tiny.mk)
EXAMPLES = {
    "leaky_relu": (
        {"mkdsl/ops/elementwise.py", "tests/test_ops_oracle.py"},
        ("  x = x + linear(a, wo)", "  x = x + linear(leaky_relu(a, slope=0.1), wo)"),
    ),
}
# In the patched copy: the spec compiles, and the op's reference matches a float64 formula.
PROBE = """
import sys, numpy as np
from mkdsl.compiler import compile_source
from mkdsl.ops import OPS
out, _ = compile_source(open("spec.mk").read(), "spec.mk", None)
sys.stdout.write(out.files["kernel.py"])
x = np.linspace(-2, 2, 32, dtype=np.float32).reshape(2, 16)
got, want = OPS["leaky_relu"].reference(x, slope=0.1)[0], np.where(x >= 0, x, 0.1 * x)
assert np.allclose(np.asarray(got), want, rtol=1e-5, atol=0), (got, want)  # f32 arithmetic: a few ulps
"""


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_adding_an_op_example_touches_only_its_files_and_compiles(example, tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    blocks = fenced_blocks(ADDING)
    diffs = [b.text for b in blocks if b.info == f"diff {example}"]
    files, (old, new) = EXAMPLES[example]
    assert diffs and set(re.findall(r"^\+\+\+ b/(\S+)$", "".join(diffs), re.M)) == files
    shutil.copytree(ROOT / "mkdsl", tmp_path / "mkdsl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for d in diffs:
        subprocess.run(["git", "apply", "-"], input=d, text=True, cwd=tmp_path, check=True)
    spec = (ROOT / "specs/tiny.mk").read_text(encoding="utf-8")
    assert spec.count(old) == 1
    (tmp_path / "spec.mk").write_text(spec.replace(old, new), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", PROBE, example], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (shown,) = [b.text.strip() for b in blocks if b.info == f"python {example} kernel"]
    assert shown in r.stdout, f"adding-an-op.md shows `{shown}`, which the compiled kernel does not contain"
    for path in files:
        if path.startswith("tests/"):
            compile((tmp_path / path).read_text(encoding="utf-8"), path, "exec")  # the test diff applies and parses


# ---------------------------------------------------------------- the Python API and the README's quickstart

ROOT = DOCS.parent
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M)
# What libtpu and JAX's TPU plugin print when they look for a TPU that is not there.
TPU_NOISE = ("libtpu", "TPU_", "InitGoogle", "accelerator type", "E0000")


def user_env() -> dict[str, str]:
    """A user's environment: nothing set for JAX, XLA or libtpu (this worktree's mkdsl importable)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TPU_", "XLA_"))}
    return {**env, "PYTHONPATH": str(ROOT)}


def run_python(code: str, cwd: Path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=user_env())
    assert r.returncode == 0, f"the example failed:\n{r.stderr[-3000:]}"
    assert not [line for line in r.stderr.splitlines() if any(w in line for w in TPU_NOISE)], r.stderr
    return r


def test_python_api_examples_run():
    """Every python block of docs/python-api.md, in order, as one script from the project root."""
    blocks = PYTHON_BLOCK.findall((DOCS / "python-api.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 4
    r = run_python("\n".join(blocks), ROOT)
    assert "no profile named `minii` in specs/llama3_8b.mk; its profiles: mini" in r.stdout
    assert "tokens[1] = 256 is outside 0..255 (the vocabulary has 256 tokens)" in r.stdout
    assert "seq_len must be an int in 1..256, got 512" in r.stdout
    assert "['kernel.py', 'plan.md', 'plan.svg']" in r.stdout
    assert re.search(r"^True \[[0-9, ]+\]$", r.stdout, re.M), r.stdout  # mkdsl.generate: speculative == plain
    # one R-row verify step per call; a draft spec's drafts verified: plain's tokens again
    assert re.search(r"^True \[[0-9, ]+\]\nTrue\nTrue$", r.stdout, re.M), r.stdout


def test_readme_quickstart_runs_as_written(tmp_path):
    """The quickstart's mkdsl commands and its Python, as written, in a directory holding the
    specs (the venv and pip line sets up what this test already runs in)."""
    import shlex
    import shutil

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (sh,) = SH_BLOCK.findall(section)
    (py,) = PYTHON_BLOCK.findall(section)
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    commands = [line.split("#")[0] for line in sh.splitlines() if line.startswith("mkdsl ")]
    assert len(commands) == 3
    for command in commands:
        args = shlex.split(command)[1:]
        run_python(f"import sys; from mkdsl.cli import main; sys.exit(main({args!r}))", tmp_path)
    assert sorted(p.name for p in (tmp_path / "out" / "tiny").iterdir()) == ["kernel.py", "plan.md", "plan.svg"]
    r = run_python(py, tmp_path)
    m = re.fullmatch(r"\[ *\d+ +\d+\] ([0-9.e-]+)\n", r.stdout)
    assert m, r.stdout
    # Kernel and reference round matmul inputs to bf16 and accumulate in f32 (docs/python-api.md).
    assert float(m[1]) <= 2**-5


# ---------------------------------------------------------------------------- performance figures
# A step time or a rate in the docs says where it came from: the command that prints it, or the
# word "modeled" (no TPU ran mkdsl's kernels) or "measured" (compile times, interpret-mode runs,
# public figures of other systems), in its paragraph, its table with the paragraph before it, or
# its section's heading.
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:us|µs|ms/step|ms per step|tokens/s|tok/s)(?!\w)")
LABEL = re.compile(r"\bmodell?ed\b|\bmeasured\b|`(?:python -m )?mkdsl [a-z]", re.IGNORECASE)
# A modeled step (or its tokens/s) also says which reading it is: conservative, or optimistic (the
# range's other end, a floor, or a previous model's), in its paragraph or an enclosing heading.
STEP = re.compile(r"modell?ed (?:step|accepted tokens/s|tokens/s)|step time|\*\*modell?ed", re.IGNORECASE)
READING = re.compile(r"conservative|optimistic", re.IGNORECASE)
ROOT = DOCS.parent
FIGURE_FILES = sorted(
    [ROOT / "README.md", *DOCS.glob("*.md"), *(ROOT / "generated").glob("*/plan.md")], key=lambda p: str(p)
)


def _paragraphs(text: str) -> list[tuple[int, str, str]]:
    """(first line, enclosing headings, text) of each paragraph; a table or fenced block joined
    with the paragraph just before it (its caption), in the same section."""
    out: list[list] = []
    cur: list[str] = []
    start, heading, fence = 0, "", False

    def flush() -> None:
        if cur:
            joined = "\n".join(cur)
            if out and joined[:1] in "|`" and out[-1][1] == heading:
                out[-1][2] += "\n" + joined
            else:
                out.append([start, heading, joined])
            cur.clear()

    for i, line in enumerate(text.splitlines(), 1):
        if fence or line.startswith("```"):
            if not cur:
                start = i
            cur.append(line)
            fence = fence != line.startswith("```")
            if not fence and line.startswith("```") and len(cur) > 1:
                flush()
        elif line.startswith("#") or not line.strip():
            flush()
            if line.startswith("#"):  # the chain of headings this one is under, then itself
                level = len(line) - len(line.lstrip("#"))
                chain = [h for h in heading.splitlines() if h and len(h) - len(h.lstrip("#")) < level]
                heading = "\n".join([*chain, line])
        else:
            start = i if not cur else start
            cur.append(line)
    flush()
    return [(s, h, t) for s, h, t in out]


def unlabelled_figures(text: str) -> list[tuple[int, list[str]]]:
    """(line, figures) of each paragraph quoting a µs / ms-per-step / tokens/s figure with no
    command, no "modeled" and no "measured" near it, or a modeled step with no reading."""
    bad = []
    for start, heading, body in _paragraphs(text):
        figures = FIGURE.findall(body)
        near = heading + "\n" + body
        if figures and (not LABEL.search(near) or (STEP.search(body) and not READING.search(near))):
            bad.append((start, figures))
    return bad


def test_the_figure_check_finds_an_unlabelled_figure():
    bad = "## Kimi K3\n\nThe step takes 8073.7 us at batch 8, 990.8 tokens/s.\n\n| batch | step |\n|---|---|\n| 1 | 5296.3 us |\n"
    # the table is read with the paragraph before it, its caption
    assert unlabelled_figures(bad) == [(3, ["8073.7 us", "990.8 tokens/s", "5296.3 us"])]
    good = bad.replace("The step takes", "`mkdsl plan specs/kimi_k3.mk --batch 8` models").replace(
        "| batch | step |", "| batch | modeled step (conservative) |"
    )
    assert unlabelled_figures(good) == []
    assert unlabelled_figures("## Modeled time\n\n12.5 us per layer\n") == []  # the section says it
    assert unlabelled_figures("```\n$ x\n3.0 ms/step\n```\n") == [(1, ["3.0 ms/step"])]
    # a modeled step says which reading it is, here or in a heading above
    step = "## Kimi K3\n\nThe modeled step is 8073.7 us.\n"
    assert unlabelled_figures(step) == [(3, ["8073.7 us"])]
    assert unlabelled_figures(step.replace("us.", "us (conservative).")) == []
    assert unlabelled_figures("# Previous, optimistic model\n\n## Kimi K3\n\n" + step[12:]) == []


@pytest.mark.parametrize("path", FIGURE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_performance_figure_says_where_it_came_from(path):
    bad = unlabelled_figures(path.read_text(encoding="utf-8"))
    where = [f"{path.relative_to(ROOT)}:{line}: {', '.join(figs)}" for line, figs in bad]
    assert not bad, "figures without a command or a modeled / measured label:\n" + "\n".join(where)
