"""Compile a generated kernel module with libtpu and keep its final bundles: `mkdsl plan --static`.

libtpu reads its dump flags once, when it loads, so the compile runs in a child Python process
with `LIBTPU_INIT_ARGS` set (`python -m mkdsl.backends.tpu.bundle_dump KERNEL BATCH SEQ_LEN DIR`); the child
prints the compiled executable's code size as JSON. The parent then picks the largest
`*-final_bundles.txt` in DIR (the megakernel; the other files are XLA's small glue fusions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DUMP_FLAGS = "--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true"


INTERNAL = 3  # the child's exit status when libtpu rejects the kernel (mosaic_errors.KernelCompileError)


class DumpError(Exception):
    """The compile failed or left no bundle dump."""


@dataclass(frozen=True)
class KernelDump:
    bundles: Path  # *-final_bundles.txt of the megakernel
    utilization: Path | None  # its *-final_hlo-static-per-bundle-utilization.txt
    code_bytes: int  # the compiled executable's generated code size
    topology: str


def dump_kernel(kernel: Path, batch: int, seq_len: int, out: Path, timeout: float = 3600) -> KernelDump:
    """Compile `kernel` (a generated kernel.py) for its TPU7x topology in a child process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", LIBTPU_INIT_ARGS=DUMP_FLAGS.format(dir=out))
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    cmd = [sys.executable, "-m", "mkdsl.backends.tpu.bundle_dump", str(kernel), str(batch), str(seq_len), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode == INTERNAL:
        from mkdsl.backends.tpu.mosaic_errors import KernelCompileError

        raise KernelCompileError("", text=json.loads(done.stdout.strip().splitlines()[-1])["internal"])
    if done.returncode != 0:
        raise DumpError(f"the libtpu compile failed:\n{done.stderr.strip()[-3000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    dumps = sorted(out.glob("*-final_bundles.txt"), key=lambda p: p.stat().st_size)
    if not dumps:
        raise DumpError(f"libtpu wrote no final bundles to {out}")
    kernel_file = dumps[-1]
    prefix = kernel_file.name.rsplit("-", 2)[0]  # "<id>-<kernel name>"
    util = sorted(out.glob(f"{_glob_escape(prefix)}-*-final_hlo-static-per-bundle-utilization.txt"))
    return KernelDump(kernel_file, util[-1] if util else None, info["code_bytes"], info["topology"])


def _glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "[]*?" else c for c in text)


def _compile_here(kernel: str, batch: int, seq_len: int) -> dict:
    """In the child: import the module, compile one step, report the code size."""
    from mkdsl.backends.tpu import libtpu as tpu_compile
    from mkdsl.verify import kernel as verify

    module = verify.import_generated(Path(kernel).read_text(), str(Path(kernel).parent), "kernel_static")
    topology = tpu_compile.topology_for(module)
    seq_len = seq_len or verify.check_seq_len(module)  # 0: two KV tiles, as `mkdsl verify` compiles
    compiled, _ = tpu_compile.compile_module(module, tpu_compile.tpu7x_devices(topology), batch, seq_len)
    return {"code_bytes": int(compiled.memory_analysis().generated_code_size_in_bytes), "topology": topology}


if __name__ == "__main__":
    from mkdsl.backends.tpu.mosaic_errors import KernelCompileError

    kernel_path, b, s, _ = sys.argv[1:5]
    try:
        print(json.dumps(_compile_here(kernel_path, int(b), int(s))))
    except KernelCompileError as e:  # reported by the parent as mkdsl's internal compiler error
        print(json.dumps({"internal": str(e)}))
        sys.exit(INTERNAL)
