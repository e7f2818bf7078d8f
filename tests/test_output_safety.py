"""`mkdsl compile -o DIR` never destroys data it did not write, and its swap is crash-safe.

mkdsl replaces an output directory only when it holds nothing but files mkdsl writes; a
directory with other files, a file, a symlink or a read-only directory is refused (exit 2) and
left exactly as it was. The new output is swapped in whole: after a kill at any point the
directory holds a complete old or new output, and the next compile leaves no litter.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mkdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.mk"


def run(*args, cwd: Path | None = None) -> int:
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return main([str(a) for a in args])
    finally:
        os.chdir(old)


def tree(path: Path) -> dict:
    """Every entry below `path` (not following symlinks): kind, mode and bytes."""
    out = {}
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        body = p.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(p) if p.is_symlink() else None
        out[str(p.relative_to(path))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), body)
    return out


@pytest.fixture
def project(tmp_path) -> Path:
    """A user's project: a README, sources, docs and the spec under specs/."""
    root = tmp_path / "proj"
    (root / "specs").mkdir(parents=True)
    shutil.copy(TINY, root / "specs" / "tiny.mk")
    (root / "README.md").write_text("my project\n")
    (root / "src").mkdir()
    (root / "src" / "main.py").write_text("print('hi')\n")
    (root / "docs").mkdir()
    (root / "docs" / "notes.md").write_text("notes\n")
    return root


def refused(capsys, *args, cwd=None) -> str:
    assert run(*args, cwd=cwd) == 2
    err = capsys.readouterr().err
    assert err.startswith("mkdsl: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("target", [".", "PWD", "docs", "specs", "src"])
def test_directories_with_user_files_are_refused(project, capsys, target):
    before = tree(project)
    out = project if target == "PWD" else Path(target)
    err = refused(capsys, "compile", "specs/tiny.mk", "-o", out, cwd=project)
    assert "did not write" in err, err
    assert tree(project) == before
    assert sorted(os.listdir(project.parent)) == ["proj"]  # no litter beside it either


def test_a_file_is_refused(project, capsys):
    target = project / "out"
    target.write_text("precious\n")
    before = tree(project)
    err = refused(capsys, "compile", project / "specs" / "tiny.mk", "-o", target)
    assert "not a directory" in err
    assert tree(project) == before  # in particular no `.out.old`


@pytest.mark.parametrize("points_at", ["user dir", "output dir", "nothing"])
def test_a_symlink_is_refused(project, capsys, points_at):
    spec = project / "specs" / "tiny.mk"
    target = project / "target"
    if points_at == "user dir":
        target.mkdir()
        (target / "keep.txt").write_text("keep\n")
    elif points_at == "output dir":
        assert run("compile", spec, "-o", target) == 0
        capsys.readouterr()
    (project / "link").symlink_to(target)
    before = tree(project)
    err = refused(capsys, "compile", spec, "-o", project / "link")
    assert "symbolic link" in err
    assert tree(project) == before


@pytest.mark.parametrize("content", ["user file", "mkdsl output"])
def test_a_read_only_directory_is_refused(project, capsys, content):
    spec = project / "specs" / "tiny.mk"
    target = project / "ro"
    if content == "user file":
        target.mkdir()
        (target / "keep.txt").write_text("keep\n")
    else:
        assert run("compile", spec, "-o", target) == 0
        capsys.readouterr()
    target.chmod(0o555)
    try:
        before = tree(project)
        refused(capsys, "compile", spec, "-o", target)
        assert tree(project) == before
    finally:
        target.chmod(0o755)


def test_a_read_only_parent_is_refused(project, capsys):
    parent = project / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        err = refused(capsys, "compile", project / "specs" / "tiny.mk", "-o", parent / "out")
        assert "read-only" in err
        assert os.listdir(parent) == []
    finally:
        parent.chmod(0o755)


def test_empty_output_name_is_a_usage_error(project, capsys):
    before = tree(project)
    err = refused(capsys, "compile", "specs/tiny.mk", "-o", "", cwd=project)
    assert "-o" in err
    assert tree(project) == before


def test_own_output_is_replaced(project, capsys):
    """A directory mkdsl wrote (even for another spec, with Python's bytecode cache) is replaced."""
    out = project / "gen"
    assert run("compile", ROOT / "specs" / "llama3_8b.mk", "--profile", "mini", "-o", out) == 0
    (out / "__pycache__").mkdir()
    (out / "__pycache__" / "kernel.cpython-311.pyc").write_bytes(b"\0")
    assert run("compile", project / "specs" / "tiny.mk", "-o", out) == 0
    assert sorted(os.listdir(out)) == ["kernel.py", "plan.md", "plan.svg"]
    assert "from specs/tiny.mk" in (out / "kernel.py").read_text().splitlines()[0]
    assert sorted(os.listdir(project)) == ["README.md", "docs", "gen", "specs", "src"]  # no litter


def test_an_empty_directory_is_filled(project):
    out = project / "empty"
    out.mkdir()
    assert run("compile", project / "specs" / "tiny.mk", "-o", out) == 0
    assert sorted(os.listdir(out)) == ["kernel.py", "plan.md", "plan.svg"]


def test_output_respects_the_umask(project):
    out = project / "gen" / "tiny"
    old = os.umask(0o022)
    try:
        assert run("compile", project / "specs" / "tiny.mk", "-o", out) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}


def test_abandoned_temporary_directories_are_removed(project):
    out = project / "gen" / "tiny"
    assert run("compile", project / "specs" / "tiny.mk", "-o", out) == 0
    (out.parent / ".tiny.mkdsl-dead").mkdir()
    (out.parent / ".tiny.mkdsl-dead" / "kernel.py").write_text("# half")
    (out.parent / ".tiny.old").mkdir()  # not ours by name: kept
    assert run("compile", project / "specs" / "tiny.mk", "-o", out) == 0
    assert sorted(os.listdir(out.parent)) == [".tiny.old", "tiny"]


def test_concurrent_writers(project):
    """Eight compiles of two specs race for one directory: all succeed, one whole output wins."""
    out = project / "gen" / "x"
    specs = [project / "specs" / "tiny.mk", ROOT / "specs" / "llama3_8b.mk"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mkdsl", "compile", specs[i % 2], "-o", out],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for i in range(8)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert sorted(os.listdir(out.parent)) == ["x"]
    first = (out / "kernel.py").read_text().splitlines()[0]
    model = "tiny" if "tiny.mk" in first else "llama3_8b"
    assert (out / "plan.md").read_text().startswith(f"# {model}: decode step plan")
    assert tree(project / "src") and (project / "README.md").read_text() == "my project\n"


# A child that swaps NEW into `out` (which holds OLD) and SIGKILLs itself just before its k-th
# filesystem operation (seen through audit events), so every point of the swap is a crash point.
_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from mkdsl.compiler import Output, write_atomically
    k, out, tag = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    files = {"kernel.py": f"# Generated by mkdsl test\\n{tag}\\n" * 2000, "plan.md": f"# t: decode step plan\\n{tag}\\n"}
    out_obj = Output(None, None, files)
    EVENTS = {"open", "os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.chmod",
              "shutil.rmtree", "os.scandir", "os.listdir", "ctypes.call_function", "fcntl.flock"}
    seen = 0
    def hook(event, args):
        global seen
        if event in EVENTS:
            seen += 1
            if seen == k:
                os.kill(os.getpid(), signal.SIGKILL)
    sys.addaudithook(hook)
    write_atomically(out_obj, out)
    """
)


def _complete(out: Path) -> str:
    """The tag of the whole output in `out` (asserting it is whole)."""
    assert sorted(os.listdir(out)) == ["kernel.py", "plan.md"], os.listdir(out)
    kernel, plan = (out / "kernel.py").read_text(), (out / "plan.md").read_text()
    tag = plan.splitlines()[1]
    assert kernel == f"# Generated by mkdsl test\n{tag}\n" * 2000
    return tag


def test_a_kill_at_any_point_leaves_a_whole_output(tmp_path):
    out = tmp_path / "gen" / "m"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def child(k: int, tag: str) -> int:
        r = subprocess.run([sys.executable, "-c", _CHILD, str(k), str(out), tag], env=env, capture_output=True)
        assert r.returncode in (0, -signal.SIGKILL), r.stderr.decode()
        return r.returncode

    assert child(0, "v0") == 0
    (tmp_path / "gen" / "keep.txt").write_text("keep\n")
    tags, k = ["v0"], 1
    while True:
        code = child(k, f"v{k}")
        tag = _complete(out)
        assert tag in (tags[-1], f"v{k}"), (k, tag)
        tags.append(tag)
        if code == 0:
            break
        k += 1
        assert k < 500
    assert tags[-1] == f"v{k}"
    assert k > 3, "the hook saw too few operations to test anything"
    assert sorted(os.listdir(out.parent)) == ["keep.txt", "m"]  # the last clean run removed all litter


def test_without_an_atomic_exchange_the_two_rename_swap_works(project, monkeypatch):
    """Where renameat2 is missing the swap falls back to two renames, still leaving no litter."""
    from mkdsl import output

    monkeypatch.setattr(output, "_exchange", lambda a, b: False)
    out = project / "gen" / "tiny"
    for _ in range(2):
        assert run("compile", project / "specs" / "tiny.mk", "-o", out) == 0
    assert sorted(os.listdir(out.parent)) == ["tiny"] and sorted(os.listdir(out)) == [
        "kernel.py",
        "plan.md",
        "plan.svg",
    ]
