"""mkdsl's version: the generated modules' headers and `mkdsl --version` print it."""

__version__ = "0.1.0"
