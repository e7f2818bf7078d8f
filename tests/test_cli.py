"""The command line: exit codes, messages, no tracebacks."""

import subprocess
import sys
import time

import pytest

from mkdsl import __version__
from mkdsl.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdsl", *args], capture_output=True, text=True)


def test_version():
    r = run("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"mkdsl {__version__}"


@pytest.mark.parametrize("spec", ["specs/llama3_8b.mk", "specs/tiny.mk"])
@pytest.mark.parametrize("profile", [None, "mini"])
def test_check_committed_specs(spec, profile, capsys):
    if profile and spec.endswith("tiny.mk"):
        pytest.skip("tiny.mk has no profile: it is already minimal")
    args = ["check", spec] + (["--profile", profile] if profile else [])
    assert main(args) == 0
    assert ": ok: model " in capsys.readouterr().out


def test_check_llama_under_one_second():
    t0 = time.perf_counter()
    r = run("check", "specs/llama3_8b.mk")
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert elapsed < 1.0, f"mkdsl check took {elapsed:.2f} s"


def test_missing_file_is_a_usage_error():
    r = run("check", "no/such/spec.mk")
    assert r.returncode == 2
    assert r.stderr == "mkdsl: error: cannot read no/such/spec.mk: No such file or directory\n"


def test_bad_arguments_exit_2():
    r = run("check")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_unknown_profile(tmp_path):
    r = run("check", "specs/llama3_8b.mk", "--profile", "minii")
    assert r.returncode == 1
    assert "no profile named `minii` (profiles in this spec: mini)" in r.stderr
    assert "did you mean `mini`?" in r.stderr
    assert "Traceback" not in r.stderr
