"""mkdsl: a model's decode step, written once in a small language, compiled to a Pallas TPU
megakernel with an unfused JAX reference to test it against.

The Python API (docs/python-api.md): `load` a spec, `compile_text` / `compile_to` it, the
`reference_step` (plain, or verifying R rows: `commit`, `verify_state`,
`plain_state`), `random_inputs` and `kernel_weights`, the kernel's step (`build_step`, from
the module `load_kernel` imports), the XLA `prefill_step`, `Sampling` / `sample_tokens`, and
`load_weights` from a checkpoint (`export_hf`: a GGUF written out as a Hugging Face one);
`generate` (speculatively with a `Drafter`, e.g. `NgramDrafter`, or one by name: `make_drafter`); `join_cluster` for one process per host.
"""

from mkdsl.jax_setup import quiet_libtpu
from mkdsl.version import __version__  # noqa: F401  (mkdsl.__version__)

quiet_libtpu()  # before anything imports jax: no libtpu start-up noise on a machine without a TPU

from mkdsl.api import (  # noqa: E402  (after the platform is chosen)
    ProfileError,
    Spec,
    build_step,
    commit,
    compile_text,
    compile_to,
    generate,
    join_cluster,
    kernel_weights,
    load,
    load_kernel,
    make_drafter,
    plain_state,
    prefill_step,
    random_inputs,
    reference_step,
    state_shardings,
    verify_state,
)
from mkdsl.checkpoint import export_hf, load_weights  # noqa: E402
from mkdsl.checkpoint.formats import CheckpointError  # noqa: E402
from mkdsl.lang.diagnostics import SpecError  # noqa: E402
from mkdsl.run.drafters import Drafter, NgramDrafter  # noqa: E402
from mkdsl.run.sampling import Sampling, sample_tokens  # noqa: E402

__all__ = [
    "CheckpointError",
    "ProfileError",
    "Spec",
    "SpecError",
    "build_step",
    "commit",
    "compile_text",
    "join_cluster",
    "compile_to",
    "Drafter",
    "generate",
    "make_drafter",
    "export_hf",
    "kernel_weights",
    "load",
    "load_kernel",
    "load_weights",
    "NgramDrafter",
    "plain_state",
    "random_inputs",
    "prefill_step",
    "reference_step",
    "Sampling",
    "sample_tokens",
    "state_shardings",
    "verify_state",
]
