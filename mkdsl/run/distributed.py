"""One JAX process per host: `jax.distributed` set up from flags or the environment, the
global mesh, host copies of global arrays, and a failure on one process stopping all of them.

A multi-host TPU slice runs the same program in one process per host (multi-controller JAX):
every process calls the same jitted functions on global arrays (`jax.Array`s whose shards live
on several processes' devices) and owns only its own devices' shards. mkdsl's part:

- `Cluster.resolve(...)`: the coordinator, process count and this process's id, from the flags
  `--coordinator HOST:PORT --num-processes N --process-id I`, else from the environment
  (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`); `--coordinator auto` lets
  JAX detect the cluster itself (TPU pod metadata, SLURM, Open MPI, Kubernetes).
- `initialize(cluster)`: `jax.distributed.initialize`, and on the CPU the gloo collectives
  across processes (jax 0.10.2's CPU client has none across processes otherwise).
- The spec's mesh is the generated module's `make_mesh()`: `jax.make_mesh` over `jax.devices()`,
  which lists every process's devices, process by process, so a mesh axis split first over hosts
  keeps a host's devices together: the order the kernel's collectives (peers by mesh
  coordinate) assume.
- `FailureWatch`: a process that fails publishes its error in the coordinator's key-value store
  and exits; every other process polls that key and exits with the failed process's message
  rather than wait in a collective for a peer that is gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

FAILED_KEY = "mkdsl/failed"  # the key-value store entry a failing process writes its error to
LINGER_S = 3.0  # how long a failed process 0 keeps the coordinator up for the others to read its error
ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


class ClusterError(ValueError):
    """Flags or environment that do not describe a cluster (a usage error)."""


@dataclass(frozen=True)
class Cluster:
    coordinator: str  # HOST:PORT of process 0's coordination service, or "auto"
    num_processes: int | None
    process_id: int | None

    @staticmethod
    def resolve(
        coordinator: str | None, num_processes: int | None, process_id: int | None, environ=os.environ
    ) -> Cluster | None:
        """The cluster the flags (else the environment) describe; None for a single process."""
        coordinator = coordinator or environ.get(ENV["coordinator"])
        if num_processes is None and environ.get(ENV["num_processes"]):
            num_processes = _int(environ[ENV["num_processes"]], ENV["num_processes"])
        if process_id is None and environ.get(ENV["process_id"]):
            process_id = _int(environ[ENV["process_id"]], ENV["process_id"])
        if coordinator is None:
            if num_processes not in (None, 1) or process_id not in (None, 0):
                raise ClusterError("--num-processes/--process-id need --coordinator HOST:PORT (or auto)")
            return None
        if coordinator != "auto":
            if num_processes is None or process_id is None:
                raise ClusterError(f"--coordinator {coordinator} needs --num-processes N and --process-id I")
            if num_processes < 1 or not 0 <= process_id < num_processes:
                raise ClusterError(f"--process-id {process_id} is not in 0 .. {num_processes - 1}")
            if ":" not in coordinator:
                raise ClusterError(f"--coordinator {coordinator}: expected HOST:PORT")
        return Cluster(coordinator, num_processes, process_id)


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ClusterError(f"{name}={text!r} is not an integer") from None


def initialize(cluster: Cluster, timeout_s: int = 300) -> None:
    """Join the cluster (once per process). On the CPU, collectives across processes use gloo."""
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cluster.coordinator == "auto":
        jax.distributed.initialize(initialization_timeout=timeout_s)
    else:
        jax.distributed.initialize(
            cluster.coordinator, cluster.num_processes, cluster.process_id, initialization_timeout=timeout_s
        )


def process_index() -> int:
    import jax

    return jax.process_index()


def is_main() -> bool:
    """Process 0: the one that prints text and figures (and serves)."""
    return "jax" not in sys.modules or process_index() == 0


def to_host(x) -> np.ndarray:
    """A global array's value on this host: its own if fully addressable, a replica's if fully
    replicated, else gathered from every process (a collective: every process must call it)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_counts(values: list[float]) -> np.ndarray:
    """Each process's `values` ([processes, len(values)], f32), on every process (a collective
    on a cluster: every process must call it)."""
    import jax

    mine = np.asarray(values, np.float32)
    if jax.process_count() == 1:
        return mine[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)


def place(host: dict, shardings: dict) -> dict:
    """Host arrays (the same on every process) as global arrays: each process copies only the
    shards of its own devices (`jax.make_array_from_callback`)."""
    import jax

    return {n: jax.make_array_from_callback(a.shape, shardings[n], lambda idx, a=a: a[idx]) for n, a in host.items()}


def _client():
    from jax._src import distributed

    return distributed.global_state.client


class FailureWatch:
    """A failure on one process stops every process with that process's error."""

    def __init__(self, process_id: int | None = None, poll_s: float = 0.5):
        # the id given, if known: jax.process_index() starts JAX's backends, which on a cluster
        # waits for every process (one that has failed may never come)
        self.process_id = process_id
        self.poll_ms = int(poll_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mkdsl-failure-watch", daemon=True)

    def start(self) -> FailureWatch:
        if _client() is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and wait for the watcher to leave its blocking read: a daemon thread still
        inside the coordination client's C++ call when the interpreter exits aborts the process
        ("terminate called after throwing ..."; seen with jax 0.10.2)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_ms / 1000 + 5)

    def publish(self, message: str) -> None:
        """This process failed: tell the others (first failure wins)."""
        client = _client()
        if client is None:
            return
        try:
            client.key_value_set(FAILED_KEY, f"process {self._me()}: {message}")
        except Exception:  # already set by another process, or the service is gone
            pass

    def _me(self) -> int:
        return self.process_id if self.process_id is not None else process_index()

    def fail(self, message: str, exit_code: int = 1, show: bool = True) -> None:
        """Publish this process's error, print it and leave at once (`os._exit`: JAX's exit hook
        would wait at a shutdown barrier for peers that wait in a collective). Process 0 runs the
        coordination service, so it stays a moment for the others to read the error first."""
        self.publish(message)
        if show:
            print(message, file=sys.stderr, flush=True)
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(LINGER_S if self._me() == 0 else 0.2)
        os._exit(exit_code)

    def _watch(self) -> None:
        client = _client()
        while not self._stop.is_set():
            try:
                message = client.blocking_key_value_get(FAILED_KEY, self.poll_ms)
            except Exception:  # not set yet (a timeout), or the coordinator is gone
                self._stop.wait(0.05)
                continue
            if not message.startswith(f"process {self._me()}:"):
                print(f"mkdsl: error on {message}", file=sys.stderr, flush=True)
                if self._me() == 0:  # the coordinator stays a moment: the others leave first
                    time.sleep(LINGER_S)
                os._exit(1)
            return
