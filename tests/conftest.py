"""Shared test setup: JAX on the CPU (libtpu's compile-only TPU7x devices still work)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
