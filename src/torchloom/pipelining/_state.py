"""Checkpoint state across pipeline stages: each stage's state dict under the model's names, merged into one
(full format) or filtered to a stage's own names (loading)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def to_cpu(value: Any) -> Any:
    """A full tensor in host memory (a DTensor gathered first); anything else as it is."""
    if isinstance(value, torch.Tensor):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return value.detach().cpu()
    return value


def optimizer_to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "state": {k: {n: to_cpu(v) for n, v in s.items()} for k, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def merge_modules(pieces: Iterable[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for piece in pieces:
        merged.update(piece)
    return merged


def merge_optimizers(pieces: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The stages' optimizer state dicts (keyed by parameter name) as one: the states together, and each param
    group's names concatenated (the groups are the same on every stage: one optimizer built alike)."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for piece in pieces:
        merged["state"].update(piece["state"])
        for i, group in enumerate(piece["param_groups"]):
            if i == len(merged["param_groups"]):
                merged["param_groups"].append({**group, "params": []})
            names = merged["param_groups"][i]["params"]
            # A tied weight's copies on several stages are saved under one name (`_ties`): listed once.
            listed = set(names)
            names.extend(n for n in group["params"] if n not in listed)
    return merged


def optimizer_of_stage(state: dict[str, Any], own: set[str]) -> dict[str, Any]:
    """The part of a whole model's optimizer state dict that belongs to the parameters named `own`."""
    return {
        **state,
        "state": {k: v for k, v in state["state"].items() if k in own},
        "param_groups": [
            {**g, "params": [n for n in g["params"] if n in own]} for g in state["param_groups"]
        ],
    }
