"""Shared test setup: JAX on the CPU (libtpu's compile-only TPU7x devices still work)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a machine-wide lock; compile-only use from a second process (a dev server, a
# parallel run) must not make the compile tests fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
