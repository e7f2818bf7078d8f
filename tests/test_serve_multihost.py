"""`mkdsl serve` on two processes (one per "host"): process 0 serves, process 1 follows its calls.
DeepSeek-V3 mini (ep 2 x tp 2, 2 virtual CPU devices per process) from a checkpoint in the
published layout, decoded by the reference step; its greedy completion must equal `mkdsl run` of
the same prompt in one process holding all 4 devices. Every process runs under `timeout`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from safetensors.numpy import save_file
from test_multihost import free_port
from test_run import write_tokenizer
from xla_cpu import xla_flags

import mkdsl

openai = pytest.importorskip("openai", reason="the `test` extra installs the openai client")  # CI has it

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs/deepseek_v3.mk"
LIFETIME_S = 900


def checkpoint(root: Path) -> Path:
    from checkpoint_writers import PUBLISHED

    from mkdsl.run.random_params import random_params

    spec = mkdsl.load(SPEC, "mini")
    weights, _ = random_params(spec.model, {"B": 1, "S": 16}, seed=4)
    save_file(PUBLISHED["deepseek_v3"](weights, spec.model.schedule, spec.model.const), str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": len(spec.model.schedule)}))
    write_tokenizer(root, spec.model.const["V"])
    return root


@pytest.mark.slow
def test_two_processes_serve_what_one_process_runs(tmp_path):
    root = checkpoint(tmp_path)
    env = os.environ | {"PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags()}  # the CLI sets the device count
    env["MKDSL_CACHE"] = str(tmp_path / "cache")
    common = [str(SPEC), "-p", "mini", "--weights", str(root), "--decode", "reference"]
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(2):
        cmd = ["timeout", str(LIFETIME_S), sys.executable, "-m", "mkdsl", "serve", *common, "--batch", "2"]
        cmd += ["--port", str(port), "--model-name", "dsv3", "--coordinator", coordinator]
        cmd += ["--num-processes", "2", "--process-id", str(i)]
        log = open(tmp_path / f"serve{i}.log", "w")  # noqa: SIM115  (closed below)
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p, _ in procs), _logs(tmp_path)
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail("the server did not come up:\n" + _logs(tmp_path))
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
        served = client.completions.create(model="dsv3", prompt="the hello", max_tokens=6, temperature=0)
        text = served.choices[0].text
        assert served.usage.completion_tokens >= 1
    finally:
        # Ctrl-C (`timeout` relays it): process 0 stops and tells process 1, which returns. Not
        # SIGTERM: jax.distributed takes that as a preemption notice, and the process just ends
        procs[0][0].send_signal(signal.SIGINT)
        for p, log in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()
    assert procs[1][0].returncode == 0, _logs(tmp_path)
    run = ["timeout", str(LIFETIME_S), sys.executable, "-m", "mkdsl", "run", *common, "--batch", "2"]
    run += ["--prompt", "the hello", "--max-tokens", "6", "--temperature", "0"]
    alone = subprocess.run(run, capture_output=True, text=True, env=env, timeout=LIFETIME_S)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert alone.stdout.startswith("the hello" + text + "\n"), (alone.stdout, text)  # then `[row 1] ...`


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- process {i}\n" + (tmp_path / f"serve{i}.log").read_text()[-2500:] for i in range(2))
