"""libtpu is quiet by default: `import mkdsl` on a machine without a TPU prints no TPU start-up
noise, without the user setting JAX_PLATFORMS; a platform the user chose, or a TPU, is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mkdsl.jax_setup import NO_TPU_HINTS, quiet_libtpu, tpu_attached

ROOT = Path(__file__).resolve().parents[1]
# What libtpu and JAX's TPU plugin print when they look for a TPU that is not there.
NOISE = ("libtpu", "TPU_", "tpu", "InitGoogle", "accelerator type", "E0000", "WARNING")
USE_JAX = """
import jax, jax.numpy as jnp
from jax.experimental import topologies
print(jax.default_backend(), float(jnp.ones(3).sum()))
print(len(topologies.get_topology_desc(platform="tpu", topology_name="tpu7x:2x2x1").devices))
"""


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user who set nothing for JAX or libtpu."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TPU_", "XLA_"))}
    env.pop("ALLOW_MULTIPLE_LIBTPU_LOAD", None)
    return {**env, "PYTHONPATH": str(ROOT), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **extra}


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(word in line for word in NOISE)]


@pytest.mark.skipif(tpu_attached(), reason="this machine has a TPU: JAX is meant to start it")
@pytest.mark.parametrize("order", ["mkdsl first", "jax first"])
def test_no_tpu_startup_noise_without_any_setting(order):
    imports = "import mkdsl\n" if order == "mkdsl first" else "import jax\nimport mkdsl\n"
    r = run(imports + USE_JAX, user_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "3.0", "8"]  # the CPU runs, libtpu's compile-only devices still work
    assert noise(r.stderr) == [], r.stderr


@pytest.mark.skipif(tpu_attached(), reason="this machine has a TPU: JAX is meant to start it")
def test_without_mkdsl_libtpu_is_noisy():
    """The test above can fail: plain JAX on this machine does print libtpu's start-up noise."""
    r = run(USE_JAX, user_env())
    assert noise(r.stderr), r.stderr


def test_the_cli_is_quiet():
    r = subprocess.run(
        [sys.executable, "-m", "mkdsl", "check", "specs/tiny.mk"], capture_output=True, text=True, env=user_env()
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_platform_the_user_chose_is_kept():
    r = run(
        "import mkdsl, os, jax\nprint(os.environ['JAX_PLATFORMS'], jax.config.jax_platforms)",
        user_env(JAX_PLATFORMS="cpu,tpu"),
    )
    assert r.stdout.split() == ["cpu,tpu", "cpu,tpu"], r.stderr


def test_jax_option_set_before_mkdsl_is_kept():
    code = "import jax\njax.config.update('jax_platforms', 'cpu,tpu')\nimport mkdsl\nprint(jax.config.jax_platforms)"
    assert run(code, user_env()).stdout.split() == ["cpu,tpu"]


def test_a_tpu_machine_is_left_alone():
    env: dict[str, str] = {}
    assert quiet_libtpu(env, tpu=True) is None
    assert env == {}


def test_no_tpu_chooses_cpu_and_hints_libtpu(monkeypatch):
    monkeypatch.delitem(sys.modules, "jax", raising=False)  # as before JAX is imported
    env: dict[str, str] = {"TPU_WORKER_HOSTNAMES": "mine"}
    assert quiet_libtpu(env, tpu=False) == "cpu"
    assert env == {**NO_TPU_HINTS, "JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "mine"}


def test_tpu_detection(tmp_path):
    pci, dev = tmp_path / "pci", tmp_path / "dev"
    (pci / "0000:00:04.0").mkdir(parents=True)
    (pci / "0000:00:04.0" / "vendor").write_text("0x1af4\n")  # a virtio device
    dev.mkdir()
    assert not tpu_attached(pci, dev)
    (pci / "0000:00:05.0").mkdir()
    (pci / "0000:00:05.0" / "vendor").write_text("0x1ae0\n")  # Google: a TPU chip
    assert tpu_attached(pci, dev)
    (pci / "0000:00:05.0" / "vendor").unlink()
    (dev / "accel0").touch()
    assert tpu_attached(pci, dev)
