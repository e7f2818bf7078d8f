"""Every op mkdsl knows, registered by importing its module."""

import mkdsl.ops.draft  # noqa: F401
import mkdsl.ops.state  # noqa: F401
from mkdsl.ops import attention, collective, elementwise, kda, linear, mla, moe, norm, residual, rope, routing, select  # noqa: F401
from mkdsl.ops.registry import OPS, REQUIRED, Cost, OpDef, Operand, OpError

__all__ = ["OPS", "REQUIRED", "Cost", "OpDef", "OpError", "Operand"]
