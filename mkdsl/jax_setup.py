"""Keep libtpu quiet on a machine without a TPU, before JAX initialises.

With libtpu installed (the `tpu` and `test` extras), JAX tries its TPU plugin on first use and
libtpu prints start-up errors and warnings when no TPU is attached; the compile-only TPU7x
devices (`jax.experimental.topologies`) print them even on the CPU platform. So when it sees
no TPU chip attached, mkdsl tells libtpu there is no cloud TPU to look for and, unless the
user chose a platform (`JAX_PLATFORMS` or JAX's `jax_platforms` option), selects the CPU. On a
machine with a TPU nothing changes. Run once by `import mkdsl`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips are PCI devices of Google's vendor id
# What libtpu asks for when it finds no TPU metadata; only ever set when no TPU is attached.
NO_TPU_HINTS = {"TPU_ACCELERATOR_TYPE": "tpu7x-2", "TPU_WORKER_HOSTNAMES": "localhost"}


def tpu_attached(pci_root: Path = Path("/sys/bus/pci/devices"), dev: Path = Path("/dev")) -> bool:
    """True if a TPU chip is visible: a PCI device of Google's vendor id, or an accelerator node."""
    for vendor in pci_root.glob("*/vendor"):
        try:
            if vendor.read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return any(dev.glob("accel[0-9]*")) or any(dev.glob("vfio/[0-9]*"))


def _chosen_in_jax() -> bool:
    """JAX is already imported and its platform is set, or its backends already exist."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    try:
        from jax._src import xla_bridge

        return bool(jax.config.jax_platforms) or bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # another JAX layout: leave it alone
        return True


def quiet_libtpu(environ: MutableMapping[str, str] = os.environ, tpu: bool | None = None) -> str | None:
    """Without a TPU: tell libtpu not to look for one and, if the user chose no platform,
    choose the CPU. Returns the platform chosen (None: left to the user or to JAX)."""
    if tpu if tpu is not None else tpu_attached():
        return None
    for name, value in NO_TPU_HINTS.items():
        environ.setdefault(name, value)
    if "JAX_PLATFORMS" in environ or _chosen_in_jax():
        return None
    environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported before mkdsl: its options were read already
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return "cpu"
