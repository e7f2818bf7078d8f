"""mkdsl: a model's decode step, written once in a small language, compiled to a Pallas TPU
megakernel with an unfused JAX reference to test it against."""

from mkdsl.jax_setup import quiet_libtpu

__version__ = "0.1.0"

quiet_libtpu()  # before anything imports jax: no libtpu start-up noise on a machine without a TPU
