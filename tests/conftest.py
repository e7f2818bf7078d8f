"""Shared test setup: JAX on the CPU (libtpu's compile-only TPU7x devices still work)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a machine-wide lock; compile-only use from a second process (a dev server, a
# parallel run) must not make the compile tests fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Eight virtual CPU devices, so sharded kernels run over a real mesh in interpret mode (tests of
# one-device kernels use the first). Must be set before JAX initialises its CPU backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
