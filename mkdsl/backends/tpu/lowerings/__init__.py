"""The TPU lowering of every structured op, one module per op family (mirroring mkdsl/ops/)."""

from mkdsl.backends.tpu.lowerings import (  # noqa: F401
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
    state,
)
