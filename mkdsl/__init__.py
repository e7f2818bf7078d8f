"""mkdsl: a model's decode step, written once in a small language, compiled to a Pallas TPU
megakernel with an unfused JAX reference to test it against."""

__version__ = "0.1.0"
