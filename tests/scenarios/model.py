"""The model, the data and the data order that every scenario shares, in plain torch.

The data order is written down here from `DistributedSampler`'s definition (a permutation drawn from
`seed + epoch`, rank r reading every world_size-th sample), not taken from torchloom: the oracle and the loop
under test must agree on it independently.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

D = 8
SEQ = 2  # tokens per sample: sequence parallel splits them across the tensor-parallel ranks
N_BLOCKS = 2
GLOBAL_BATCH = 12  # divisible by every data-parallel size (1, 2, 3, 4)
N_A, N_B = 72, 48  # samples of the main loader (6 batches an epoch) and the second one (4 batches)
STEPS = 4  # optimizer steps of every scenario
BREAK_AT = 4  # the "break" loop leaves each epoch after this many batches
SEED = 7
B_OFFSET = 1000  # the second loader's sample indices, shifted so both loaders' indices can be told apart


class Block(nn.Module):
    """A pre-norm MLP block: under tensor parallel, fc1 is split by output features and fc2 by input features
    (one all-reduce per block); under sequence parallel the norm and the residual stream hold a sequence shard."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    """An input projection plus a position embedding (fed by a tensor the forward builds: torch.arange on the
    input's device), optionally a BatchNorm, blocks, a final norm, an output projection. `tied` shares the
    projections' weight; `frozen`: the position embedding's requires_grad=False. The modules are created in
    the order they are registered (and tied before any unit is made), so a reset in module order (a one-device
    `empty_init=True` followed by the user's `reset_parameters()`, a materialisation from the meta device) draws
    what the construction draws."""

    def __init__(
        self, tied: bool = False, wrap_fn=None, batchnorm: bool = False, frozen: bool = False
    ) -> None:
        super().__init__()
        unit = wrap_fn or (lambda m, edge: m)
        inp, pos = nn.Linear(D, D), nn.Embedding(SEQ, D)
        bn = nn.BatchNorm1d(D) if batchnorm else None
        blocks = [Block() for _ in range(N_BLOCKS)]
        norm, out = nn.LayerNorm(D), nn.Linear(D, D)
        if tied:  # tied before any unit is made, as a model's own __init__ does
            out.weight = inp.weight
        if frozen:  # before any unit is made (FSDP1 flattens what it wraps)
            pos.weight.requires_grad_(False)
        self.inp = unit(inp, True)
        self.pos = unit(pos, True)
        self.bn = unit(bn, True) if bn is not None else None
        self.blocks = nn.ModuleList(unit(b, False) for b in blocks)
        self.norm = unit(norm, True)
        self.out = unit(out, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = embed(self, x)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))


def embed(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input projection, the position embedding of a tensor built in the forward, the BatchNorm (over the
    features of every token: the tokens flattened, so the activations stay contiguous; a transposed one between
    two pipeline stages fails in the receive, reported apart)."""
    h = module.inp(x) + module.pos(torch.arange(x.shape[1], device=x.device))
    if module.bn is not None:
        h = module.bn(h.reshape(-1, D)).view(h.shape)
    return h


def net_options(scenario) -> dict:
    """Net's arguments for a scenario (the reference builds the same model)."""
    return {"tied": scenario.tied, "batchnorm": scenario.batchnorm, "frozen": scenario.frozen}


# The pieces of each pipeline stage (split_fn), by the number of stages: every stage holds parameters, and under
# every placement (round robin, or zbv's V of stages 0 and 3 on one rank) each pipeline rank holds a block and
# something outside the blocks, so the scenarios' two optimizers (blocks, the rest) have parameters on every rank.
STAGE_PIECES = {
    1: [("inp", "blocks.0", "blocks.1", "norm", "out")],
    2: [("inp", "blocks.0"), ("blocks.1", "norm", "out")],
    4: [("inp", "blocks.0"), ("blocks.1",), ("norm",), ("out",)],
}
# The same stages as split_points (PipelineStrategy(split_points=..., example_input=...)): where each begins.
SPLIT_POINTS = {n: [pieces[0] for pieces in STAGE_PIECES[n][1:]] for n in STAGE_PIECES}


class Stage(nn.Module):
    """What the user's `split_fn` returns for one pipeline stage: the model's modules of that stage under their
    names in the model (`blocks` keeps the model's indices), the others None."""

    def __init__(self, model: Net, pieces: tuple[str, ...]) -> None:
        super().__init__()
        # "inp" stands for the embedding: the input projection, the position embedding and the BatchNorm.
        self.inp = model.inp if "inp" in pieces else None
        self.pos = model.pos if "inp" in pieces else None
        self.bn = model.bn if "inp" in pieces else None
        self.blocks = nn.ModuleDict(
            {str(i): b for i, b in enumerate(model.blocks) if f"blocks.{i}" in pieces}
        )
        self.norm = model.norm if "norm" in pieces else None
        self.out = model.out if "out" in pieces else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            h = embed(self, h)
        for block in self.blocks.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.out(h) if self.out is not None else h


def split_fn(model: Net, index: int, num_stages: int) -> Stage:
    # The modules themselves (not copies): PipelineStrategy materialises and places them.
    return Stage(model, STAGE_PIECES[num_stages][index])


def dataset(which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, sample indices) of loader "a" or "b"."""
    n, seed, offset = (N_A, 11, 0) if which == "a" else (N_B, 12, B_OFFSET)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SEQ, D, generator=g)
    y = torch.tanh(x @ torch.randn(D, D, generator=g)) + 0.1 * torch.randn(n, SEQ, D, generator=g)
    return x, y, torch.arange(n) + offset


def accumulation(scenario) -> int:
    return 1 if scenario.accum == "none" else 2


def loss_factor(scenario) -> float:
    # fp16's loss scale starts at 2**16: keep scaled gradients far from fp16's overflow, so the run and the
    # reference take every step (an overflow would be agreed by both, but a step near the edge could differ).
    return 1e-2 if scenario.precision == "16-mixed" else 1.0


def loader_generator() -> torch.Generator:
    """The main loader's own generator: a custom sampler (loop "subset") draws from it instead of the global
    generator, so the order does not depend on the training's other draws (DistributedSampler's ignores it)."""
    return torch.Generator().manual_seed(SEED)


class UserSampler(torch.utils.data.Sampler):
    """A user's own sampler class with len(): each pass, a permutation drawn from its own generator, reversed."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        yield from reversed(torch.randperm(self.n, generator=self.generator).tolist())


def global_batches(scenario, micro_batches: int) -> list[list[int]]:
    """The sample indices of each global micro-batch the scenario's loop reads, in order (sorted within one),
    as plain torch gives them for Fabric's rule. Every scenario runs in ranks a launcher-like harness started, where
    torchloom reads DistributedSampler's order even in one process (a lone launched process may be restarted
    elastically at another world size): DistributedSampler's order for the seed (its global order is the
    one-replica order); a custom sampler's draws pass after pass (split across ranks in order)."""
    bs = GLOBAL_BATCH
    if scenario.loop == "subset":
        subset = torch.utils.data.SubsetRandomSampler(range(N_A), generator=loader_generator())
        plain = torch.utils.data.DataLoader(range(N_A), batch_size=bs, sampler=subset)
    elif scenario.sampler == "custom":  # drawn whole each pass and split across the data-parallel ranks
        plain = torch.utils.data.DataLoader(
            range(N_A), batch_size=bs, sampler=UserSampler(N_A, loader_generator())
        )
    else:  # auto, the user's DistributedSampler, a BatchSampler over a RandomSampler: DistributedSampler's order
        sampler = torch.utils.data.DistributedSampler(
            range(N_A), num_replicas=1, rank=0, shuffle=True, seed=SEED
        )
        plain = torch.utils.data.DataLoader(range(N_A), batch_size=bs, sampler=sampler)

    def epoch_a(epoch: int) -> list[list[int]]:
        if isinstance(plain.sampler, torch.utils.data.DistributedSampler):
            plain.sampler.set_epoch(epoch)
        # A pass left at the cap stops its sampler there too (a RandomSampler draws lazily: what it has not
        # drawn yet, it never draws from the generator).
        limit = BREAK_AT if scenario.loop == "break" else None
        return [sorted(batch.tolist()) for batch in itertools.islice(plain, limit)]

    def stream_a():
        epoch = 0
        while True:
            yield from epoch_a(epoch)
            epoch += 1

    def stream_b():
        while True:  # not shuffled: the same order every epoch
            for i in range(0, N_B, bs):
                yield list(range(B_OFFSET + i, B_OFFSET + i + bs))

    a, b = stream_a(), stream_b()
    out = []
    for _ in range(micro_batches):
        batch = next(a)
        if scenario.loop == "two_loaders":
            batch = batch + next(b)
        out.append(batch)
    return out


def kept_by_filter(name: str, value=None) -> bool:
    """The `save(filter={"model": ...})` of the scenarios with ckpt_state "filter": the blocks' entries."""
    return "blocks." in name


def split_params(named: list[tuple[str, torch.Tensor]], n_opt: int) -> list[list[tuple[str, torch.Tensor]]]:
    """One optimizer: everything. Two: the blocks' parameters, and the rest."""
    if n_opt == 1:
        return [named]
    return [
        [(n, p) for n, p in named if ".blocks." in f".{n}"],
        [(n, p) for n, p in named if ".blocks." not in f".{n}"],
    ]


# Adam's eps well above 1e-8: its first step is lr * g / (|g| + eps), so with the default a gradient element
# that happens to be near zero (1.5e-7 among elements of 0.026, found by a random run) turns its rounding into
# a step of up to lr in either direction; a run that sums in another order (tensor parallel) cannot match that
# to 1e-5. With 1e-4 such an element hardly moves, and the others take Adam's steps.
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}),
    "plain_sgd": (torch.optim.SGD, {"lr": 0.2}),  # no momentum: the optimizer holds no state
    "adam": (torch.optim.Adam, {"lr": 1e-2, "eps": 1e-4}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-4}),
}
IMPL = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def make_optimizers(scenario, named: list[tuple[str, torch.Tensor]]) -> list[torch.optim.Optimizer]:
    """The scenario's optimizers over `named` parameters (weights and biases in two groups when asked)."""
    cls, options = OPTIMIZERS[scenario.optimizer]
    if scenario.optimizer in ("sgd", "plain_sgd"):  # SGD's step scales with the loss: undo the fp16 factor
        options = {**options, "lr": options["lr"] / loss_factor(scenario)}
    out = []
    for part in split_params(named, scenario.n_opt):
        if scenario.groups == 1:
            groups = [{"params": [p for _, p in part]}]
        else:
            groups = [
                {"params": [p for n, p in part if not n.endswith("bias")]},
                {
                    "params": [p for n, p in part if n.endswith("bias")],
                    "lr": options["lr"] / 2,
                    "weight_decay": 0.0,
                },
            ]
        out.append(cls(groups, **options, **IMPL[scenario.impl]))
    return out


def make_schedulers(scenario, optimizers) -> list:
    if not scenario.scheduler:
        return []
    return [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8) for opt in optimizers]


def clip_arguments(scenario) -> dict[str, float]:
    """Thresholds that bite on most steps (the reference reports how often they did)."""
    f = loss_factor(scenario)
    if scenario.clip == "norm":
        return {"max_norm": 0.3 * f}
    if scenario.clip == "value":
        return {"clip_val": 0.05 * f}
    return {}


EVALUATE_AFTER = 2  # the evaluate axis: the optimizer step after which the script evaluates
EVAL_SAMPLES = 12  # the validation batch: loader "b"'s first samples, the same on every rank


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _ = dataset("b")
    return x[:EVAL_SAMPLES], y[:EVAL_SAMPLES]


def eval_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The validation loss (`loss_fn` of `loom.evaluate`): the mean over the samples it is given, so a pipeline's
    micro-batches average to the batch's."""
    if out.dtype in (torch.float16, torch.bfloat16):
        out = out.float()
    return nn.functional.mse_loss(out, y)


def batch_loss(scenario, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training script's loss, as `loss_fn(output, target)` of `loom.forward_backward`: the mean over the
    samples it is given, times the loaders (two loaders give equal parts of every batch, so this is the mean per
    loader summed, as `micro_loss` writes it). A pipeline cuts the batch into micro-batches and calls it on each:
    it may not depend on where the loaders' parts begin."""
    if out.dtype in (torch.float16, torch.bfloat16):
        out = out.float()
    loaders = 2 if scenario.loop == "two_loaders" else 1
    return nn.functional.mse_loss(out, y) * loaders * loss_factor(scenario) / accumulation(scenario)


def micro_loss(scenario, out: torch.Tensor, y: torch.Tensor, n_a: int) -> torch.Tensor:
    """Each rank's (or the reference's) loss for one micro-batch: the mean over its own samples, per loader."""
    if out.dtype in (torch.float16, torch.bfloat16):
        out = out.float()
    loss = nn.functional.mse_loss(out[:n_a], y[:n_a])
    if scenario.loop == "two_loaders":
        loss = loss + nn.functional.mse_loss(out[n_a:], y[n_a:])
    return loss * loss_factor(scenario) / accumulation(scenario)
