"""Issue 39, break 4: `launch(fn)` with spawned ranks pickles the Loom and its strategy, so every policy form a
sharded strategy takes must survive pickling and decide the same modules afterwards (a policy of classes was kept
as a local lambda: "Can't pickle local object 'as_module_policy.<locals>.<lambda>'"). No ranks start here."""

from __future__ import annotations

import functools
import pickle

import pytest
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

from torchloom import Loom
from torchloom.strategies import FSDP2Strategy, FSDPStrategy, ModelParallelStrategy
from torchloom.strategies._policies import as_module_policy, is_wrap_policy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Head(nn.Linear):
    pass


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = Head(4, 2)


def is_block(module: nn.Module) -> bool:
    return isinstance(module, Block)


def parallelize(model: nn.Module, device_mesh: object) -> nn.Module:
    return model


# name -> policy; "wrap form" policies are FSDP1's (module, recurse, nonwrapped_numel) callables.
POLICIES = {
    "set": lambda: {Block, Head},
    "list": lambda: [Block],
    "class": lambda: Block,
    "predicate": lambda: is_block,
    "ModuleWrapPolicy": lambda: ModuleWrapPolicy({Block}),
    "partial": lambda: functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block, Head}),
    "none": lambda: None,
}
WRAP_FORM = {"partial"}


def _decisions(policy: object) -> list[bool] | None:
    """Which of a model's modules the policy selects (None for no policy)."""
    if policy is None:
        return None
    modules = list(Net().modules())
    if is_wrap_policy(policy):
        return [bool(policy(m, False, 10**9)) for m in modules]  # type: ignore[operator]
    decide = as_module_policy(policy, "policy")
    return [bool(decide(m)) for m in modules]


def _strategies(name: str) -> list[tuple[object, tuple[str, ...]]]:
    """Each strategy made with the policy, and the attributes that hold it."""
    make = POLICIES[name]
    made: list[tuple[object, tuple[str, ...]]] = [
        (
            FSDPStrategy(auto_wrap_policy=make(), activation_checkpointing_policy=make()),
            ("auto_wrap_policy", "activation_checkpointing_policy"),
        ),
        (FSDP2Strategy(activation_checkpointing_policy=make()), ("activation_checkpointing_policy",)),
    ]
    if name not in WRAP_FORM:  # shard_policy refuses FSDP1's wrap form
        made.append((FSDP2Strategy(shard_policy=make()), ("shard_policy",)))
    return made


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_form_pickles_and_decides_the_same_modules(name):
    for strategy, attributes in _strategies(name):
        copy = pickle.loads(pickle.dumps(strategy))
        for attr in attributes:
            label = f"{type(strategy).__name__}.{attr}"
            before, after = _decisions(getattr(strategy, attr)), _decisions(getattr(copy, attr))
            assert before == after, label
            assert (before is None) == (name == "none"), label
            if before is not None:
                assert any(before) and not all(before), (label, before)


def test_a_loom_with_each_strategy_pickles():
    """What `launch(fn)` sends to spawned ranks: the Loom, with its strategy and the user's functions in it."""
    strategies = [
        FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}),
        FSDP2Strategy(shard_policy=[Block], activation_checkpointing_policy=ModuleWrapPolicy({Block})),
        ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=2),
    ]
    for strategy in strategies:
        loom = Loom(accelerator="cpu", devices=2, strategy=strategy)
        copy = pickle.loads(pickle.dumps(loom))
        assert type(copy.strategy) is type(strategy)
    copy_strategy = pickle.loads(pickle.dumps(strategies[2]))
    assert copy_strategy.parallelize_fn is parallelize
    assert copy_strategy.activation_checkpointing_policy is None
