"""The command line's rough edges from the new-user walk (issue 13, point 6): profiles, per-device
sizes, paths as the user gave them, full regenerate commands and the subcommand's usage."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "specs" / "tiny.mk").read_text(encoding="utf-8")


def mkdsl(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdsl", *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("command", ["check", "plan", "compile"])
def test_unknown_profile_is_a_usage_error_listing_the_profiles(command):
    r = mkdsl(command, "specs/kimi_k3.mk", "--profile", "cor")
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "mkdsl: error: no profile named `cor` in specs/kimi_k3.mk; its profiles: mini, core (did you mean `core`?)\n"
    )


def test_profile_of_a_spec_without_profiles():
    r = mkdsl("check", "specs/tiny.mk", "-p", "mini")
    assert r.returncode == 2
    assert r.stderr == "mkdsl: error: no profile named `mini` in specs/tiny.mk; it declares no profiles\n"


@pytest.mark.parametrize("spec, profiles", [("specs/kimi_k3.mk", "mini, core"), ("specs/tiny.mk", "none")])
def test_check_ok_line_lists_the_profiles(spec, profiles):
    r = mkdsl("check", spec)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(rf"{spec}: ok: model .*; profiles: {profiles} \[[0-9.]+ s\]\n", r.stdout), r.stdout


def sharded_tiny(tmp_path: Path, ffn: int) -> Path:
    """tiny.mk on two devices with its MLP split by columns over `tp`, FFN width `ffn`."""
    text = TINY.replace("const F = 256", f"const F = {ffn}\nmesh {{ tp = 2 }}")
    for w in ("w_gate:    bf16[H, F]", "w_up:      bf16[H, F]"):
        text = text.replace(w, w.replace("F]", "F @tp]"))
    text = text.replace("w_down:    bf16[F, H]", "w_down:    bf16[F @tp, H]")
    path = tmp_path / "tp.mk"
    path.write_text(text, encoding="utf-8")
    return path


def test_planner_diagnostic_gives_per_device_and_global_size(tmp_path):
    spec = sharded_tiny(tmp_path, 360)  # 180 rows of w_down per device: no tile of 16-row multiples
    want = (
        "error: weight `w_down` has 180 rows per device (360 in all, split 2 ways over tp); "
        "streaming it in tiles needs a tile that divides it and suits bf16"
    )
    for command in ("check", "plan"):  # check runs every check plan and compile run
        r = mkdsl(command, spec)
        assert r.returncode == 1 and want in r.stderr, (command, r.stderr)


def test_vmem_budget_of_a_sharded_spec_is_per_device(tmp_path):
    spec = sharded_tiny(tmp_path, 256)
    spec.write_text(spec.read_text().replace("mesh { tp = 2 }", "mesh { tp = 2 }\nhints { vmem_cap_mib = 1 }"))
    r = mkdsl("plan", spec)
    assert r.returncode == 1
    assert "error: VMEM budget exceeded per device: the plan needs " in r.stderr
    spec.with_name("one.mk").write_text(TINY.replace("const F = 256", "const F = 256\nhints { vmem_cap_mib = 1 }"))
    r = mkdsl("plan", spec.with_name("one.mk"))
    assert "error: VMEM budget exceeded: the plan needs " in r.stderr


def test_shape_rule_per_device_gives_both_types(tmp_path):
    spec = tmp_path / "pd.mk"
    spec.write_text(
        "model m\n\nconst V = 256\nconst H = 128\n\ndim B in 1 .. 8\ndim S in 1 .. 256\n\nmesh { tp = 2 }\n\n"
        "weight embed:   bf16[V, H]\nweight wq:      bf16[H, 512 @tp]\nweight lm_head: bf16[384, V]\n\n"
        "step(tokens, pos) {\n  x = embedding(tokens, embed)\n"
        "  q = compact(linear(x, wq), block=512, keep=384)\n"
        "  logits = linear(q, lm_head)\n  return logits, argmax(logits)\n}\n",
        encoding="utf-8",
    )
    r = mkdsl("check", spec)
    assert r.returncode == 1
    assert (
        "error: compact: per device: `linear` has 256 columns, not a whole number of 512-column blocks "
        "(`linear` is f32[B, 256] per device, f32[B, 512] whole)" in r.stderr
    )


def test_absolute_paths_stay_absolute(tmp_path):
    out = tmp_path / "out"
    r = mkdsl("compile", ROOT / "specs" / "tiny.mk", "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out}/: kernel.py")
    r = mkdsl("compile", ROOT / "specs" / "tiny.mk", "--check")  # no -o: the spec's path decides
    assert r.stdout.startswith(f"{ROOT / 'generated' / 'tiny'}: up to date"), r.stdout
    r = mkdsl("compile", "specs/tiny.mk", "--check")
    assert r.stdout.startswith("generated/tiny: up to date"), r.stdout


def test_check_message_gives_the_full_command(tmp_path):
    out = tmp_path / "tiny"
    shutil.copytree(ROOT / "generated" / "tiny", out)
    (out / "plan.md").write_text("old\n", encoding="utf-8")
    r = mkdsl("compile", "specs/tiny.mk", "--check", "-o", out)
    assert r.returncode == 1
    assert f"{out} is stale: run `mkdsl compile specs/tiny.mk -o {out}` and commit the result" in r.stderr
    r = mkdsl("compile", "specs/kimi_k3.mk", "-p", "mini", "--check")
    assert r.returncode == 1  # generated/kimi_k3_mini is not committed
    assert "run `mkdsl compile specs/kimi_k3.mk --profile mini -o generated/kimi_k3_mini`" in r.stderr


@pytest.mark.parametrize("kernel", sorted((ROOT / "generated").glob("*/kernel.py")), ids=lambda p: p.parent.name)
def test_header_command_regenerates_its_own_directory(kernel):
    """The header's command, run as written (plus --check) from the project root, checks this very
    directory: it names the spec, the profile and `-o`."""
    m = re.search(
        r"^# DO NOT EDIT: change the spec or mkdsl and run `(mkdsl compile [^`]*)`\.$", kernel.read_text(), re.M
    )
    assert m, "no regenerate command in the header"
    args = shlex.split(m[1])
    assert args[-2:] == ["-o", f"generated/{kernel.parent.name}"]
    r = mkdsl(*args[1:], "--check")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"generated/{kernel.parent.name}: up to date")


def test_unknown_option_gives_the_subcommand_usage():
    r = mkdsl("compile", "specs/tiny.mk", "--batch", "2")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: mkdsl compile ")
    assert "mkdsl compile: error: unrecognized arguments: --batch 2" in r.stderr
