"""The TPU lowering of every structured op, one module per op family (mirroring mkdsl/ops/)."""

from mkdsl.backends.tpu.lowerings import attention, collective, kda, linear, mla, moe, norm, residual, rope, select  # noqa: F401
