"""Cutting a model into pipeline stages that keep the model's own parameter names.

Two ways: split points (module names where a stage begins), traced by torch's `pipeline()` frontend on the
meta device; or the user's `split_fn(model, stage_index, num_stages) -> stage module`, for forwards that cannot
be traced, or stages that need their own module classes (a tensor-parallel plan matches `nn.Linear` children,
which the traced stages replace by graph modules).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchloom.errors import MisuseError, MisuseValueError

SplitFn = Callable[[nn.Module, int, int], nn.Module]


def check_split_points(model: nn.Module, split_points: Sequence[str], num_stages: int) -> None:
    """Each split point names a module of `model`, in forward order, and there is one fewer than stages."""
    names = [n for n, _ in model.named_modules() if n]
    known = set(names)
    for point in split_points:
        if point not in known:
            close = difflib.get_close_matches(point, names, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise MisuseValueError(
                f"Pipeline split point {point!r} names no module of {type(model).__name__}.{hint} A split point is "
                "a module name as model.named_modules() spells it (e.g. 'layers.4'): the stage begins there."
            )
    if len(split_points) != num_stages - 1:
        raise MisuseValueError(
            f"{len(split_points)} split point(s) {list(split_points)} make {len(split_points) + 1} stages, but the "
            f"pipeline has {num_stages} (pipeline_parallel_size x stages_per_rank): pass {num_stages - 1} split "
            "points."
        )


def trace_stages(
    model: nn.Module, split_points: Sequence[str], example: tuple[Any, ...], stage_ids: Sequence[int]
) -> dict[int, nn.Module]:
    """The stage modules `stage_ids` of `model` cut before each split point, traced on the meta device (so no
    rank allocates the whole model). Their parameters keep the model's names ("layers.4.fc.weight")."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    # The example goes where the model is: a meta model traces without allocating anything.
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    meta_example = tuple(_to_device(a, device) for a in example)
    spec = {point: SplitPoint.BEGINNING for point in split_points}
    originals = {id(p): p for p in model.parameters()}
    try:
        pipe = pipeline(model, mb_args=meta_example, split_spec=spec)
    except Exception as error:
        raise MisuseError(
            f"The forward of {type(model).__name__} cannot be split at {list(split_points)}: torch's tracer "
            f"failed ({type(error).__name__}: {str(error)[:300]}). Pass split_fn=fn(model, stage_index, "
            "num_stages) -> the stage's module instead (a copy of the model with the other stages' layers "
            "removed, whose forward runs one stage; see docs/model-parallel.md, 'Pipeline parallelism')."
        ) from error
    if pipe.num_stages != len(split_points) + 1:
        raise MisuseError(
            f"Splitting {type(model).__name__} at {list(split_points)} made {pipe.num_stages} stages, not "
            f"{len(split_points) + 1}: a split point lies inside a module the forward does not call in order "
            "(or calls twice). Pick split points at the top-level blocks the forward calls one after another, or "
            "pass split_fn."
        )
    stages = {i: pipe.get_stage_module(i) for i in stage_ids}
    names = {n for n, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    lost = sorted(
        {f"{name} (stage {i})" for i, stage in stages.items() for name in _meta_constants(stage, names)}
    )
    if lost:
        raise MisuseError(
            f"The forward of {type(model).__name__} builds tensor constant(s) from data on the meta device "
            f"({', '.join(lost[:3])}; e.g. `torch.tensor([...], device=x.device)`): the traced stage keeps them "
            "without values, and would train on uninitialised memory. Build such a constant where it has values "
            "(`torch.tensor([...]).to(x.device)`, or a buffer the module's reset_parameters fills), build the model "
            "without init_module(empty_init=True), or pass split_fn."
        )
    if any(not p.is_meta for p in model.parameters()):
        # The tracer works on copies; a model built for real gives its own values to the stage.
        named = dict(model.named_parameters())
        for stage in stages.values():
            with torch.no_grad():
                for name, p in stage.named_parameters():
                    source = named.get(name, originals.get(id(p)))
                    if source is not None and not source.is_meta:
                        _replace(stage, name, source)
        named_buffers = dict(model.named_buffers())
        for stage in stages.values():
            for name, _ in stage.named_buffers():
                if name in named_buffers and not named_buffers[name].is_meta:
                    _replace(stage, name, named_buffers[name], buffer=True)
    persistent = {n for n, _ in model.named_parameters(remove_duplicate=False)} | set(model.state_dict())
    for stage in stages.values():
        _keep_out_of_checkpoints(stage, persistent)
    return stages


def _keep_out_of_checkpoints(stage: nn.Module, persistent: set[str]) -> None:
    """Make the buffers of a traced stage that are not in the model's state dict non-persistent: the tracer's
    lifted constants (`lifted_tensor_0`, a `torch.tensor([...])` the forward builds) and the model's own
    non-persistent buffers (which the tracer registers as plain buffers). Kept, they would be written into
    checkpoints under names the model does not have, and a strict load elsewhere would refuse them."""
    for name, buffer in list(stage.named_buffers()):
        if name in persistent:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = stage.get_submodule(owner_name)
        del owner._buffers[leaf]
        owner.register_buffer(leaf, buffer, persistent=False)


def _constants(stage: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """The tensors the traced graphs of `stage` read that are neither its parameters nor its buffers (constants
    the tracer keeps as plain attributes; others it registers as buffers): name -> (owner, attribute, tensor)."""
    own = {id(t) for _, t in _tensors(stage)}
    found = {}
    for prefix, gm, graph in _graphs(stage):
        for node in graph.nodes:
            if node.op != "get_attr":
                continue
            owner_name, _, leaf = str(node.target).rpartition(".")
            owner = gm.get_submodule(owner_name)
            value = getattr(owner, leaf, None)
            if isinstance(value, torch.Tensor) and id(value) not in own:
                found[f"{prefix}.{node.target}" if prefix else str(node.target)] = (owner, leaf, value)
    return found


def _meta_constants(stage: nn.Module, model_names: set[str]) -> list[str]:
    """The meta tensors of a traced stage that are not the model's: the tracer's lifted constants (buffers of the
    stage, or plain attributes of its graphs), whose values a meta trace never had."""
    plain = [(name, t) for name, (_, _, t) in _constants(stage).items()]
    return [name for name, t in [*_tensors(stage), *plain] if t.is_meta and name not in model_names]


def place_graphs(stages: dict[int, nn.Module], device: torch.device) -> None:
    """Make the traced stages compute on `device` what the forward computes there. The tracer records a tensor
    the forward builds (`torch.arange(n, device=x.device)`, a position embedding's indices) with the device of
    the trace: traced on the meta device (`init_module(empty_init=True)`), a real stage would build it on meta
    and compute garbage from it. That device becomes `device`, and the lifted constants move there."""
    from torch import fx

    def placed(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    for stage in stages.values():
        for _, gm, graph in _graphs(stage):
            changed = False
            for node in graph.nodes:
                args, kwargs = (
                    fx.node.map_aggregate(node.args, placed),
                    fx.node.map_aggregate(node.kwargs, placed),
                )
                if args != node.args or kwargs != node.kwargs:
                    node.args, node.kwargs, changed = args, kwargs, True
            # A GraphModule runs code generated from its graph, and so may an InterpreterModule (its
            # `graph_module`): generated again.
            code = gm if isinstance(gm, fx.GraphModule) else getattr(gm, "graph_module", None)
            if changed and code is not None:
                code.recompile()
        for owner, leaf, value in _constants(stage).values():
            if not value.is_meta and value.device != device:
                setattr(owner, leaf, value.to(device))


def _graphs(stage: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """The traced modules of a stage and their graphs: the stage's `GraphModule` and the `InterpreterModule`s
    standing for the model's modules inside it."""
    from torch import fx

    return [
        (n, m, m.graph) for n, m in stage.named_modules() if isinstance(getattr(m, "graph", None), fx.Graph)
    ]


def mode_bound(stages: dict[int, nn.Module]) -> list[str]:
    """The traced modules of these stages that behave as in training whatever `model.eval()` says: the tracer
    records the forward in training mode, and an op's `training` argument (BatchNorm's, dropout's) is a constant
    of the graph. A stage from `split_fn` runs the modules themselves, which follow eval()."""
    return sorted(
        {
            n
            for stage in stages.values()
            for n, _, graph in _graphs(stage)
            if any(map(_trains_always, graph.nodes))
        }
    )


def _trains_always(node: Any) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.name in ("training", "train"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return value is True
    return False


def _replace(stage: nn.Module, name: str, tensor: torch.Tensor, buffer: bool = False) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = stage.get_submodule(owner_name)
    if buffer:
        owner._buffers[leaf] = tensor.detach().clone()
    else:
        owner._parameters[leaf] = nn.Parameter(tensor.detach().clone(), requires_grad=tensor.requires_grad)


def _to_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def user_stages(
    model: nn.Module, split_fn: SplitFn, num_stages: int, stage_ids: Sequence[int]
) -> dict[int, nn.Module]:
    """The user's stage modules; each must be a module (not the model itself) holding parameters named as in the
    model."""
    # A tied weight's second name is the model's too (each stage using it holds a copy: `_ties`).
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    stages = {}
    fn_name = getattr(split_fn, "__name__", repr(split_fn))
    for i in stage_ids:
        stage = split_fn(model, i, num_stages)
        if not isinstance(stage, nn.Module):
            raise MisuseError(
                f"split_fn {fn_name!r} returned {type(stage).__name__} for stage {i}: it must return the stage's "
                "nn.Module."
            )
        if stage is model:
            raise MisuseError(
                f"split_fn {fn_name!r} returned the model itself for stage {i}: return a copy with only this "
                "stage's layers (copy.deepcopy(model) on the meta device, then delete the others)."
            )
        foreign = [n for n, _ in stage.named_parameters() if n not in names]
        if foreign:
            raise MisuseError(
                f"split_fn {fn_name!r}: stage {i} holds parameters that are not the model's under these names "
                f"({foreign[:3]}): keep each layer at its path in the model (delete the other layers from a copy), "
                "so checkpoints keep the model's names."
            )
        stages[i] = stage
    return stages


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The model's tied parameters: the names of each tensor held under several names (e.g. a Llama-style
    model's `embed.weight` and `lm_head.weight`), in the model's order."""
    from torchloom._layout import clean_name

    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(clean_name(name))
    return [names for names in by_id.values() if len(names) > 1]


def tie_trainable(model: nn.Module, groups: list[list[str]]) -> list[bool]:
    """Whether each tied weight trains (a frozen one's copies need no gradient sum)."""
    from torchloom._layout import clean_name

    grad = {clean_name(n): p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
    return [grad[names[0]] for names in groups]


def tie_holdings(
    stages: dict[int, nn.Module], groups: list[list[str]]
) -> dict[int, list[tuple[int, list[str], bool]]]:
    """For each stage of this rank and each tie group it touches: (the group's index, the group's names it
    holds, whether they are still one tensor there). Gathered from every rank for `_ties.plan`."""
    from torchloom._layout import clean_name

    out: dict[int, list[tuple[int, list[str], bool]]] = {}
    for i, stage in stages.items():
        held = [(clean_name(n), p) for n, p in stage.named_parameters(remove_duplicate=False)]
        for g, names in enumerate(groups):
            mine = [(n, p) for n, p in held if n in names]
            if mine:
                out.setdefault(i, []).append(
                    (g, sorted({n for n, _ in mine}), len({id(p) for _, p in mine}) == 1)
                )
    return out


def stage_problems(stages: dict[int, nn.Module]) -> list[str]:
    """What is wrong with these stages, to be agreed on by every rank before any of them raises."""
    return [
        f"stage {i} holds no parameters (a pipeline stage without parameters only adds a hop; move the split "
        "point so each stage owns layers)"
        for i, stage in stages.items()
        if not any(True for _ in stage.parameters())
    ]


def materialize(stages: dict[int, nn.Module], model: nn.Module, device: torch.device) -> None:
    """Allocate the stages' meta tensors on `device` and give them the values one process draws for the whole
    model from the same seed: every module of `model` with meta tensors runs its initialiser in the model's
    order (its `reset_parameters`, or a Hugging Face model's `_init_weights`, as `init_module(empty_init=True)`
    does elsewhere), so the random numbers are drawn in the order a real initialisation draws them; the
    values of this rank's stages are kept, the others freed at once. Each rank thus allocates its stages plus
    one module of another stage at a time, and spends the whole model's initialisation time."""
    from torchloom import _meta_init

    place_graphs(stages, device)
    # Listed before this rank's stages are allocated: a split_fn may hand the model's own modules to a stage.
    pending = _meta_init.meta_modules(model)
    mine: dict[str, torch.Tensor] = {}
    for stage in stages.values():
        meta = {n for n, t in _tensors(stage) if t.is_meta}
        for mod in stage.modules():
            if any(t.is_meta for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]):
                _empty_on(mod, device)
        mine.update((n, t) for n, t in _tensors(stage) if n in meta)
    if not mine:
        return
    filled: set[str] = set()
    with torch.no_grad():
        for prefix, mod in pending:
            # A module a split_fn put into its stage as it is (no copy) was allocated above: initialised in place.
            shared = not any(t.is_meta for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)])
            if not shared:
                _empty_on(mod, device)
            _meta_init.run_init(mod)
            for key, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                name = f"{prefix}.{key}" if prefix else key
                target = mine.get(name)
                if target is not None:
                    filled.add(name)
                    if target is not t:
                        target.copy_(t)
            if not shared:
                _empty_on(mod, torch.device("meta"))
    unfilled = sorted(set(mine) - filled)
    if unfilled:
        raise MisuseError(
            f"Pipeline stage tensors {unfilled[:3]} were built on the meta device but the model has no meta tensor "
            "of that name to initialise them from: keep each stage's tensors at their names in the model, or build "
            "the model for real, or load weights after setup (loom.load_raw)."
        )


def _empty_on(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device=device, recurse=False)`. On fake tensors (under `torchloom plan`) `to_empty`
    swaps the contents of the parameter objects, which a traced stage shares with the model there: new
    tensors go into the module instead, so that the model's stay meta for `materialize` to initialise them."""
    from torchloom import _torch_compat

    if not any(_torch_compat.is_fake(t) for t in [*module._parameters.values(), *module._buffers.values()]):
        module.to_empty(device=device, recurse=False)
        return
    for name, p in module._parameters.items():
        if p is not None:
            module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
    for name, b in module._buffers.items():
        if b is not None:
            module._buffers[name] = torch.empty_like(b, device=device)


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def graft(model: nn.Module, stages: Sequence[nn.Module]) -> None:
    """Make `model` hold only these stages, under its own names: its children and tensors are replaced by the
    stages' (merged where two stages of this rank share a container such as "layers"). The model's forward is
    then no longer runnable; parameters(), state_dict() and checkpoints see this rank's stages by the model's
    names."""
    model._modules.clear()
    model._parameters.clear()
    model._buffers.clear()
    for stage in stages:
        _merge_into(model, stage, "")


def _merge_into(target: nn.Module, source: nn.Module, path: str) -> None:
    for key, p in source._parameters.items():
        if p is not None:
            if key in target._parameters:
                raise MisuseError(f"Two pipeline stages of one rank both hold parameter {path + key!r}.")
            target._parameters[key] = p
    for key, b in source._buffers.items():
        if b is not None:
            target._buffers[key] = b
            # A buffer left out of the stage's state dict stays out of the model's (a rotary cache, a constant).
            if key in source._non_persistent_buffers_set:
                target._non_persistent_buffers_set.add(key)
            else:
                target._non_persistent_buffers_set.discard(key)
    for key, child in source._modules.items():
        if child is None:
            continue
        existing = target._modules.get(key)
        if existing is None:
            target._modules[key] = child
        else:
            if not isinstance(existing, _Merged):
                merged = _Merged()
                _merge_into(merged, existing, f"{path}{key}.")
                target._modules[key] = existing = merged
            _merge_into(existing, child, f"{path}{key}.")


class _Merged(nn.Module):
    """A container two stages of one rank share (the "layers" that holds blocks of both): names only."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never called
        raise MisuseError(
            "A pipeline stage container is not callable: run the model through loom.forward_backward."
        )
