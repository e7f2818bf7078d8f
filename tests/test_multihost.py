"""Multi-controller runs on one machine: N processes on a localhost coordinator, each with its own
virtual CPU devices, CPU collectives across processes by gloo (tests/multihost_worker.py).

Each run loads a sharded mini spec's weights (each process only its shards), prefills with the
spec's per-device XLA prefill, decodes with its reference step and samples. It must equal one
process holding all the devices bit for bit (tokens, logits, the final state's bytes) where the
arithmetic is the same: the baseline also goes through `jax.distributed` (one process) so that its
all-reduces are gloo's too. JAX's in-process CPU all-reduce adds in device order and gloo's does
not (a float sum of 8 values in another order), so against that baseline only the order of
additions differs; `test_gloo_sums_in_another_order_than_one_process` shows it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mkdsl.run.distributed import Cluster, ClusterError

ROOT = Path(__file__).parents[1]
WORKER = ROOT / "tests" / "multihost_worker.py"
TIMEOUT_S = 600  # a process that hangs (a lost peer) is killed; the test fails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, devices: int, args: list[str], out: Path) -> list[subprocess.CompletedProcess]:
    """`n` worker processes (process 0 writes `out`), each with `devices` virtual CPU devices;
    every process is waited for, and killed at the timeout."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args, str(out), "--devices", str(devices)]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(n)
    ]
    results = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


def run_ok(n: int, devices: int, args: list[str], out: Path) -> dict:
    results = launch(n, devices, args, out)
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i} of {n} failed:\n{r.stderr[-3000:]}"
    return json.loads(out.read_text())


def assert_same_run(one: dict, many: dict, processes: int, local_devices: int) -> None:
    assert (many["processes"], many["local_devices"]) == (processes, local_devices)
    assert many["tokens"] == one["tokens"]
    logits_one, logits_many = np.asarray(one["logits"]), np.asarray(many["logits"])
    assert np.isfinite(logits_one).all() and np.abs(logits_one).max() > 0  # a real run, not zeros
    assert logits_many.tobytes() == logits_one.tobytes()  # bit for bit
    assert many["state_sha256"] == one["state_sha256"]


@pytest.mark.slow
def test_kimi_mini_on_two_processes_equals_one_process(tmp_path):
    """Kimi K3 mini (ep 4 x tp 2 = 8 devices): 2 processes x 4 devices against 1 x 8, sampled
    (temperature 0.8, the same seed), random weights placed shard by shard per process."""
    args = [str(ROOT / "specs/kimi_k3.mk"), "mini", "--temperature", "0.8"]
    one = run_ok(1, 8, args, tmp_path / "one.json")
    two = run_ok(2, 4, args, tmp_path / "two.json")
    assert_same_run(one, two, 2, 4)


@pytest.mark.slow
def test_deepseek_v3_mini_on_four_processes_equals_one_process(tmp_path):
    """DeepSeek-V3 mini (ep 2 x tp 2): 4 processes x 1 device against 1 x 4, greedy, each
    process loading its own shards from a checkpoint in the published layout (fp8 + block scales)."""
    from checkpoint_writers import PUBLISHED
    from safetensors.numpy import save_file

    import mkdsl
    from mkdsl.run.random_params import random_params

    spec = mkdsl.load(ROOT / "specs/deepseek_v3.mk", "mini")
    weights, _ = random_params(spec.model, {"B": 1, "S": 16}, seed=3)
    tensors = PUBLISHED["deepseek_v3"](weights, spec.model.schedule, spec.model.const)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    args = [str(ROOT / "specs/deepseek_v3.mk"), "mini", "--weights", str(tmp_path / "model.safetensors")]
    one = run_ok(1, 4, args, tmp_path / "one.json")
    four = run_ok(4, 1, args, tmp_path / "four.json")
    assert_same_run(one, four, 4, 1)
    size = (tmp_path / "model.safetensors").stat().st_size
    whole = json.loads((tmp_path / "one.json.load0.json").read_text())
    for i in range(4):
        load = json.loads((tmp_path / f"four.json.load{i}.json").read_text())
        # the loader's bound on what a load holds beyond the shards it keeps, below the checkpoint
        assert 0 < load["bound"] < size
        assert load["peak"] - load["kept"] <= load["bound"], load
        # each process reads only the stored tensors its device's shards need: fewer than one
        # process holding every device (a pair's piece is read once for its codes, once for its scales)
        assert 0 < load["tensors"] < whole["tensors"] and load["read"] < whole["read"], (load, whole)


@pytest.mark.slow
def test_a_failure_on_one_process_stops_all_with_its_error(tmp_path):
    """Process 1 raises after loading; process 0 (waiting in the prefill's collectives) exits 1
    naming process 1's error, well before the timeout."""
    args = [str(ROOT / "specs/kimi_k3.mk"), "mini", "--fail-on", "1"]
    results = launch(2, 4, args, tmp_path / "none.json")
    assert [r.returncode for r in results] == [1, 1], [r.stderr[-2000:] for r in results]
    assert "error on process 1: worker: RuntimeError: failing on purpose on process 1" in results[0].stderr
    assert not (tmp_path / "none.json").exists()


def test_gloo_sums_in_another_order_than_one_process(tmp_path):
    """Why the baseline goes through jax.distributed: 8 f32 values summed by JAX's in-process
    all-reduce equal the sum in device order; through gloo (1 process, 8 ranks) they do not all."""
    script = (
        "import os, sys, numpy as np\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
        "import jax\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "from mkdsl.run import distributed\n"
        "if sys.argv[1] == 'gloo':\n"
        "    distributed.initialize(distributed.Cluster(sys.argv[2], 1, 0), timeout_s=60)\n"
        "x = np.random.default_rng(0).standard_normal((8, 4096)).astype(np.float32)\n"
        "x *= np.logspace(-3, 3, 4096).astype(np.float32)\n"
        "mesh = jax.make_mesh((8,), ('x',))\n"
        "a = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P('x')), lambda i: x[i])\n"
        "f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, 'x'), mesh=mesh, in_specs=P('x'), out_specs=P()))\n"
        "got = np.asarray(f(a).addressable_data(0))[0]\n"
        "seq = x[0].copy()\n"
        "for i in range(1, 8):\n"
        "    seq = seq + x[i]\n"
        "print(float((got == seq).mean()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    same = {}
    for how in ("local", "gloo"):
        r = subprocess.run(
            [sys.executable, "-c", script, how, f"127.0.0.1:{free_port()}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        same[how] = float(r.stdout.split()[-1])
    assert same["local"] == 1.0  # in device order, bit for bit
    assert same["gloo"] < 0.9  # another order: many sums differ in their last bits


def test_cluster_from_flags_and_environment():
    assert Cluster.resolve(None, None, None, environ={}) is None
    assert Cluster.resolve("h:1", 4, 2, environ={}) == Cluster("h:1", 4, 2)
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert Cluster.resolve(None, None, None, environ=env) == Cluster("10.0.0.1:8476", 4, 3)
    assert Cluster.resolve(None, None, 1, environ=env) == Cluster("10.0.0.1:8476", 4, 1)  # flags first
    assert Cluster.resolve("auto", None, None, environ={}) == Cluster("auto", None, None)
    for bad, message in [
        (("h:1", None, 0), "needs --num-processes"),
        (("h:1", 2, 2), "not in 0 .. 1"),
        (("nohost", 2, 0), "HOST:PORT"),
        ((None, 2, 1), "need --coordinator"),
    ]:
        with pytest.raises(ClusterError, match=message):
            Cluster.resolve(*bad, environ={})
    with pytest.raises(ClusterError, match="not an integer"):
        Cluster.resolve(None, None, None, environ={**env, "JAX_NUM_PROCESSES": "four"})


def test_the_cli_refuses_the_interpret_kernel_across_processes_on_every_process(tmp_path):
    """`mkdsl bench` on 2 processes without a TPU: a usage error before any slow work, on each
    process its own (exit 2) or the other's, relayed by the failure watch (exit 1)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "mkdsl", "bench", str(ROOT / "specs/deepseek_v3.mk"), "-p", "mini"]
    cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    procs = [subprocess.Popen([*cmd, str(i)], stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    errs = [p.communicate(timeout=180)[1] for p in procs]
    for p, err in zip(procs, errs):
        assert p.returncode in (1, 2) and "does not run across processes" in err, err
        assert "Traceback" not in err
