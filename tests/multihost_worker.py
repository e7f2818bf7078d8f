"""One process of a multi-controller run (tests/test_multihost.py starts N of these, or one alone):
load a sharded mini spec's weights (this process's shards only), prefill with the spec's XLA
prefill per device, decode with its reference step and sample, and (process 0) write the tokens,
the last logits and the final state's bytes' hash as JSON.

    python tests/multihost_worker.py SPEC PROFILE OUT --devices D [--weights PATH]
        [--coordinator HOST:PORT --num-processes N --process-id I] [--temperature T] [--fail-on I]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

from xla_cpu import xla_flags


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("spec")
    p.add_argument("profile")
    p.add_argument("out")
    p.add_argument("--devices", type=int, required=True, help="virtual CPU devices of this process")
    p.add_argument("--weights")
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--decode", default="reference", help="kernel: the kernel's step in TPU interpret mode")
    p.add_argument("--fail-on", type=int, default=None, help="this process raises after loading (a failure test)")
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = xla_flags(a.devices)
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    from mkdsl.run import distributed

    cluster = distributed.Cluster.resolve(a.coordinator, a.num_processes, a.process_id)
    if cluster is not None:
        distributed.initialize(cluster, timeout_s=120)
    watch = distributed.FailureWatch(a.process_id).start()
    try:
        run(a)
    except Exception as e:
        import traceback

        traceback.print_exc()
        watch.fail(f"worker: {type(e).__name__}: {e}")
    watch.stop()
    return 0


def run(a) -> None:
    import numpy as np

    import mkdsl
    from mkdsl.run import distributed
    from mkdsl.run.decode import Decoder, generate
    from mkdsl.run.sampling import Sampling

    spec = mkdsl.load(a.spec, a.profile)
    module = mkdsl.load_kernel(spec)
    mesh = module.make_mesh()
    if a.weights:
        weights = load_measured(spec, module, mesh, a)
    else:
        host, _ = mkdsl.random_inputs(spec, batch=2, seq_len=module.KV_TILE, seed=1)
        host = mkdsl.kernel_weights(host)
        host = module.pad_weights(host) if hasattr(module, "pad_weights") else host
        weights = distributed.place({k: np.asarray(v) for k, v in host.items()}, module.weight_shardings(mesh))
    if a.fail_on is not None and a.fail_on == distributed.process_index():
        raise RuntimeError(f"failing on purpose on process {a.fail_on}")
    sampling = Sampling(a.temperature, 0, 1.0)
    interpret = None
    if a.decode == "kernel":
        from mkdsl.backends.tpu.interpret import interpret_params

        interpret = interpret_params()  # with mkdsl's interpreter speed-ups, as `mkdsl run` has them
    decoder = Decoder(
        spec, module, weights, 2, module.KV_TILE, sampling, interpret=interpret, seed=7, decode=a.decode, mesh=mesh
    )
    prompt = [3, 1, 4, 1, 5]
    result = generate(decoder, prompt, a.tokens, frozenset())
    logits = distributed.to_host(decoder.logits)
    state = hashlib.sha256()
    for name in sorted(decoder.state):
        state.update(np.ascontiguousarray(distributed.to_host(decoder.state[name])).tobytes())
    if distributed.is_main():
        record = {
            "tokens": [[int(t) for t in row] for row in result.tokens],
            "logits": logits.astype(np.float32).tolist(),
            "state_sha256": state.hexdigest(),
            "processes": __import__("jax").process_count(),
            "local_devices": len(__import__("jax").local_devices()),
        }
        with open(a.out, "w") as f:
            json.dump(record, f)


def load_measured(spec, module, mesh, a) -> dict:
    """This process's shards, with what the load held on the host (numpy's allocations, traced)
    beyond what it keeps, against the loader's bound: written beside `a.out` per process."""
    import tracemalloc

    import mkdsl
    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.loader import plan_load, working_set_bound
    from mkdsl.run import distributed

    reader = open_checkpoint(a.weights)
    bound = working_set_bound(plan_load(spec.model, reader), reader, module, module.weight_shardings(mesh))
    tracemalloc.start()
    weights, report = mkdsl.load_weights(spec, reader, module=module, mesh=mesh, progress=False)
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stats = {"peak": peak, "kept": kept, "bound": bound, "read": report.bytes_read, "tensors": report.tensors}
    with open(f"{a.out}.load{distributed.process_index()}.json", "w") as f:
        json.dump(stats, f)
    return weights


if __name__ == "__main__":
    sys.exit(main())
