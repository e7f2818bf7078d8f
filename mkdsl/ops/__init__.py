"""Every op mkdsl knows, registered by importing its module."""

from mkdsl.ops import (
    attention,
    collective,
    draft,
    elementwise,
    kda,
    linear,
    mla,
    moe,
    norm,
    residual,
    rope,
    routing,
    select,
)  # noqa: F401
from mkdsl.ops.registry import OPS, REQUIRED, Cost, OpDef, Operand, OpError

__all__ = ["OPS", "REQUIRED", "Cost", "OpDef", "OpError", "Operand"]
