"""Arguments of the collectives as Fabric accepts them: Python numbers become tensors, and
`torch.distributed.ReduceOp` values become torchloom's reduce-op names."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def numbers_to_tensors(data: Any, device: torch.device) -> Any:
    """Every number (and NumPy array or scalar) in a nested structure as a tensor on `device`; tensors move to
    `device`. bool becomes uint8 (NCCL cannot reduce bool), int int64, float float32 (as torch.tensor does)."""

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, bool):
            return torch.tensor(value, dtype=torch.uint8, device=device)
        if isinstance(value, int):
            return torch.tensor(value, dtype=torch.int64, device=device)
        if isinstance(value, float):
            return torch.tensor(value, dtype=torch.float32, device=device)
        if type(value).__module__ == "numpy" and hasattr(value, "dtype"):  # ndarray or NumPy scalar
            return torch.as_tensor(value, device=device)
        return value

    return torch.utils._pytree.tree_map(convert, data)


_OP_NAMES = (
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.AVG, "mean"),
    (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.MIN, "min"),
    (dist.ReduceOp.PRODUCT, "product"),
)


def reduce_op_name(reduce_op: Any) -> Any:
    """A `torch.distributed.ReduceOp` as its name ("sum", "mean", ...); anything else unchanged (strings are
    checked by the strategy)."""
    if isinstance(reduce_op, str):
        return reduce_op
    for op, name in _OP_NAMES:
        try:
            if reduce_op == op:
                return name
        except (TypeError, RuntimeError):
            continue
    raise ValueError(
        f"reduce_op={reduce_op!r} is not supported. Use 'mean', 'sum', 'max', 'min', 'product' or the matching "
        "torch.distributed.ReduceOp."
    )
