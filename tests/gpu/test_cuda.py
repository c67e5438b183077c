"""The GPU path, ready for a machine with CUDA: NCCL, models on GPUs, offload to host memory.

Tests marked `cuda` run when `torch.cuda.is_available()` and are skipped with the reason otherwise (the hook is
in tests/conftest.py); `cuda(min_devices=2)` also needs two GPUs. Every body takes the accelerator as a
parameter, and where the same check means something on CPU (gloo) it runs there too, so this code is exercised
by every `make test`. Checks, one launch of the ranks each:

- every strategy x precision ("32-true", "bf16-mixed", "16-mixed", "bf16-true") on 1 GPU and on 2: parity with
  one process training on the whole global batch on the same device with plain torch (autocast, GradScaler,
  a bf16 model), judged against how far training moved the weights; every parameter and buffer on the device;
- units made by hand outside `init_module` (`fully_shard(block)`, `FSDP(block, device_id=)`) on a model built
  on the CPU: every parameter and buffer ends on the GPU, and training matches the reference;
- meta-device init, with and without `cpu_offload`: nothing left on meta, shards where offload wants them,
  computed buffers kept, training finite;
- full and sharded (asynchronous) checkpoints with `cpu_offload`: an exact round trip;
- the replicated leftovers' gradient sync under NCCL: identical leftover gradients on every rank, equal to the
  mean of the ranks' gradients;
- the async sharded save's staging options (pinned memory, non-blocking copies on CUDA);
- a model built on the CPU and sharded by a policy (the start-from-rank-0 broadcast before FSDP moves it), with
  and without `cpu_offload`;
- full loads under `cpu_offload` (torch's full-state-dict loading wants one device; buffers and leftovers stay
  on the GPU): a full checkpoint and `load_raw` of a plain state dict round-trip exactly, optimizer included;
- `save_raw` under `cpu_offload` (shards in host memory, gathered over NCCL);
- FSDP1 offload of units it does not shard (one GPU, `NO_SHARD`), by the strategy or in units made by hand: refused;
- every rank's own GPU generator in checkpoints, also from a checkpoint that lists more GPUs than are visible.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp_models import ACCUM, D_IN, STEPS, Block, Net, data, train
from harness import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchloom import Loom
from torchloom._layout import analyze

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
STRATEGIES = ("single_device", "ddp", "fsdp", "fsdp2")
LR = 4.0  # SGD with momentum: parity-safe for every precision (see tests/strategies/test_fp16.py)
MAX_NORM = 0.004  # below every step's gradient norm, so clipping acts on every step
# A small loss keeps fp16 far from overflow at GradScaler's initial scale of 2**16: the distributed run and the
# reference must take the same steps (overflow itself is tested on CPU in tests/strategies/test_fp16.py).
LOSS_FACTOR = 1e-2
# How far the final parameters may be from the reference's, as a fraction of how far training moved them:
# NCCL and the reference sum in different orders (fp32), and half-precision rounds at different points.
TOLERANCE = {"32-true": 1e-3, "bf16-mixed": 3e-2, "16-mixed": 3e-2, "bf16-true": 1e-1}
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def _offload_mark(flavour: str, offload: bool = True) -> pytest.MarkDecorator:
    """FSDP1's offload needs units sharded over 2 GPUs or more: on one GPU FSDP1 runs NO_SHARD, whose offload
    torchloom refuses (test_fsdp1_offload_without_sharding_is_refused)."""
    return pytest.mark.cuda(min_devices=2) if flavour == "fsdp" and offload else pytest.mark.cuda


def _world(device: str) -> int:
    """2 ranks on CPU; on CUDA one per GPU, at most 2."""
    return 2 if device == "cpu" else min(2, max(1, torch.cuda.device_count()))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return LOSS_FACTOR * nn.functional.mse_loss(out.float(), target.float()) / ACCUM


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _build(loom: Loom, strategy: str) -> nn.Module:
    """The model as a user builds it, on the CPU: fsdp2's blocks sharded by hand (`fully_shard`), fsdp's
    wrapped inside `init_module` (its policy); the input projection and head stay outside every unit."""
    torch.manual_seed(0)
    if strategy == "fsdp":
        with loom.init_module():
            return Net(wrap_blocks=True)
    model = Net()
    if strategy == "fsdp2":
        for block in model.blocks:
            _shard_by_hand(loom, block)
    return model


def _shard_by_hand(loom: Loom, block: nn.Module) -> None:
    """`fully_shard(block)` as a user writes it; with cpu_offload, given the strategy's configuration
    (`unit_kwargs()`, as the README says), since torchloom cannot move a hand-made unit's shards afterwards."""
    from torch.distributed.fsdp import fully_shard

    if getattr(loom.strategy, "cpu_offload", False):
        fully_shard(block, **loom.strategy.unit_kwargs())
    else:
        fully_shard(block)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _reference(device: torch.device, precision: str, strategy: str) -> dict:
    """One process on the whole global batch, same device, plain torch. The model starts from the same weights
    as the strategy's: `_build` makes fsdp's inside `loom.init_module()`, on the device and in the parameter
    dtype (a different random stream from the CPU's, and bf16 draws differ from fp32 ones), the others on the
    CPU in fp32, converted by `setup_module`."""
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    torch.manual_seed(0)
    if strategy == "fsdp":
        with device, _default_dtype(dtype):
            model = Net()
    else:
        model = Net().to(device=device, dtype=dtype)
    initial = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    opt = _optimizer(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    x, y = data()
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            xs = x[step, micro].to(device)
            if precision == "bf16-true":
                xs = xs.to(torch.bfloat16)
            autocast = AUTOCAST.get(precision)
            with torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext():
                out = model(xs)
            loss = _loss(out, y[step, micro].to(device))
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    final = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return {"initial": initial, "params": final, "norms": norms}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _misplaced(module: nn.Module, device: torch.device, shards_on_cpu: bool = False) -> list[str]:
    """Names of parameters and buffers not where they belong: everything on `device`, except the units'
    parameter shards under cpu_offload (in host memory)."""
    layout = analyze(module)
    outside = {id(p) for _, p in layout.leftovers}
    wrong = []
    for name, p in module.named_parameters():
        want = torch.device("cpu") if shards_on_cpu and id(p) not in outside else device
        if _local(p).device.type != want.type or (want.index is not None and _local(p).device != want):
            wrong.append(f"{name} on {_local(p).device}")
    for name, b in module.named_buffers():
        if b.device.type != device.type or (device.index is not None and b.device != device):
            wrong.append(f"buffer {name} on {b.device}")
    return wrong


def _full_cpu_state(loom: Loom, model, as_float: bool = True) -> dict[str, torch.Tensor]:
    """Full parameters in host memory, as fp32 (`as_float`) or in their own dtypes. On GPUs with a process group
    only rank 0 gathers them (the others get an empty dict): FSDP1 with offloaded parameters gathers into host
    memory only this way, and its offloading path crashes on CPU, where every rank gathers instead."""
    offload = dist.is_initialized() and loom.device.type == "cuda"
    state = get_model_state_dict(
        model.forward_module, options=StateDictOptions(full_state_dict=True, cpu_offload=offload)
    )
    return {k: (v.detach().float() if as_float else v.detach()).cpu().clone() for k, v in state.items()}


# ---- every strategy x precision ------------------------------------------------------------------------------
def _parity_body(rank: int, world_size: int, accelerator: str, strategy: str) -> dict:
    out: dict = {}
    for precision in PRECISIONS:
        loom = Loom(accelerator=accelerator, devices=world_size, strategy=strategy, precision=precision)
        loom.launch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sharding summaries and the one-unit notes are tested elsewhere
            model = loom.setup_module(_build(loom, strategy))
        opt = loom.setup_optimizers(_optimizer(model.parameters()))
        result = {"misplaced": _misplaced(model.forward_module, loom.device)}
        result["norms"] = train(loom, model, opt, loss=_loss, max_norm=MAX_NORM)
        result["params"] = _full_cpu_state(loom, model)
        if rank == 0:
            result["reference"] = _reference(loom.device, precision, strategy)
        out[precision] = result
    return out


def _parity_cases():
    for device in ("cpu", "cuda"):
        for strategy in STRATEGIES:
            for world in (1, 2):
                if strategy == "single_device" and world == 2:
                    continue
                if device == "cpu" and world == 1 and strategy != "single_device":
                    continue  # the CPU suite covers these at 2 ranks; one launch each here is enough
                marks = [] if device == "cpu" else [pytest.mark.cuda(min_devices=world)]
                yield pytest.param(device, strategy, world, id=f"{device}-{strategy}-{world}", marks=marks)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].numel())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device,strategy,world", list(_parity_cases()))
def test_strategy_precision_parity(device, strategy, world):
    results = run_ranks(_parity_body, world, device, strategy, timeout=540)
    for precision in PRECISIONS:
        for rank, r in enumerate(results):
            assert r[precision]["misplaced"] == [], (precision, rank, r[precision]["misplaced"])
        got = results[0][precision]
        ref = got["reference"]
        for rank, r in enumerate(results[1:], start=1):  # the clipped norm is the global one on every rank
            assert r[precision]["norms"] == pytest.approx(got["norms"], rel=1e-6), (precision, rank)
        assert all(n > MAX_NORM for n in ref["norms"]), (precision, "clipping must act on every step")
        rel = 1e-4 if precision == "32-true" else 5e-2
        assert got["norms"] == pytest.approx(ref["norms"], rel=rel), precision
        movement = _max_diff(ref["params"], ref["initial"])
        diff = _max_diff(got["params"], ref["params"])
        assert movement > 1e-2, (precision, movement)  # the comparison has teeth
        assert diff < TOLERANCE[precision] * movement, (precision, diff, movement)


# ---- units made by hand, outside init_module -----------------------------------------------------------------
class _Normed(nn.Module):
    """Blocks between an input projection and a BatchNorm'd head: leftovers with buffers of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _hand_made_body(rank: int, world_size: int, accelerator: str, flavour: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    loom = Loom(accelerator=accelerator, devices=world_size, strategy=flavour)
    loom.launch()
    torch.manual_seed(0)
    model = _Normed()  # built on the CPU, as examples/train_lm.py and the README's FSDP2 example do
    for i, block in enumerate(model.blocks):
        if flavour == "fsdp2":
            fully_shard(block)  # moves only the block's own parameters to the GPU
        else:
            model.blocks[i] = FSDP(block, device_id=loom.device, use_orig_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = loom.setup_module(model)
    out = {"misplaced": _misplaced(wrapped.forward_module, loom.device)}
    opt = loom.setup_optimizers(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the leftovers' broadcast and gradient sync run: NCCL refuses CPU tensors
        x = torch.randn(8, D_IN, generator=g).to(loom.device)
        loss = wrapped(x).pow(2).mean()
        loom.backward(loss)
        opt.step()
        opt.zero_grad()
    out["finite"] = bool(torch.isfinite(loss).item())
    out["leftovers"] = {n: p.detach().cpu().clone() for n, p in analyze(wrapped.forward_module).leftovers}
    out["running_mean"] = wrapped.forward_module.norm.running_mean.detach().cpu().clone()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("device", DEVICES)
def test_hand_made_units_outside_init_module_end_on_the_device(device, flavour):
    results = run_ranks(_hand_made_body, _world(device), device, flavour, timeout=240)
    for rank, r in enumerate(results):
        assert r["misplaced"] == [], (rank, r["misplaced"])
        assert r["finite"], rank
        assert r["leftovers"].keys() >= {"embed.weight", "head.weight", "norm.weight"}, rank
        for name, value in r["leftovers"].items():  # replicated leftovers stay identical on every rank
            assert torch.equal(value, results[0]["leftovers"][name]), (rank, name)


# ---- meta-device init, with and without cpu_offload ----------------------------------------------------------
class _Rotary(nn.Module):
    """A non-persistent buffer computed in __init__ (never by reset_parameters), as rotary embeddings have."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("inv_freq", _inv_freq(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x) * torch.cos(self.inv_freq).repeat(2)


def _inv_freq() -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))


class _MetaModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, 16)
        self.blocks = nn.ModuleList(_Rotary() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _meta_body(rank: int, world_size: int, accelerator: str, flavour: str, offload: bool) -> dict:
    from torch.distributed.fsdp.wrap import wrap

    from torchloom.strategies import FSDP2Strategy, FSDPStrategy

    cls = FSDPStrategy if flavour == "fsdp" else FSDP2Strategy
    loom = Loom(accelerator=accelerator, devices=world_size, strategy=cls(cpu_offload=offload))
    loom.launch()
    with loom.init_module(empty_init=True):
        model = _MetaModel()
    out = {"params_meta": all(p.is_meta for p in model.parameters())}
    if flavour == "fsdp":
        with loom.init_module():  # FSDP1 units of meta blocks: FSDP materialises them when it wraps
            for i in range(3):
                model.blocks[i] = wrap(model.blocks[i])
    else:
        for block in model.blocks:
            _shard_by_hand(loom, block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = loom.setup_module(model)
    tensors = [*wrapped.parameters(), *wrapped.buffers()]
    out["any_meta"] = any(_local(t).is_meta for t in tensors)
    # FSDP1 offloads the flat parameters (the leftovers stay on the GPU); FSDP2 keeps offloaded shards on CPU.
    out["misplaced"] = _misplaced(wrapped.forward_module, loom.device, shards_on_cpu=offload)
    out["inv_freq"] = [
        m.inv_freq.detach().cpu().clone() for m in wrapped.forward_module.modules() if isinstance(m, _Rotary)
    ]
    opt = loom.setup_optimizers(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    x = torch.randn(8, D_IN, generator=torch.Generator().manual_seed(rank)).to(loom.device)
    loss = wrapped(x).pow(2).mean()
    loom.backward(loss)
    opt.step()
    out["finite"] = bool(torch.isfinite(loss).item()) and all(
        bool(torch.isfinite(_local(p)).all()) for p in wrapped.parameters()
    )
    return out


def _offload_cases():
    """Each flavour on CPU, and on CUDA with and without cpu_offload."""
    for flavour in ("fsdp", "fsdp2"):
        yield pytest.param("cpu", flavour, False, id=f"cpu-{flavour}")
        for offload in (False, True):
            yield pytest.param(
                "cuda",
                flavour,
                offload,
                id=f"cuda-{flavour}-offload{int(offload)}",
                marks=_offload_mark(flavour, offload),
            )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device,flavour,offload", list(_offload_cases()))
def test_meta_init_with_and_without_cpu_offload(device, flavour, offload):
    results = run_ranks(_meta_body, _world(device), device, flavour, offload, timeout=240)
    for rank, r in enumerate(results):
        assert r["params_meta"], rank
        assert not r["any_meta"], rank
        assert r["misplaced"] == [], (rank, r["misplaced"])
        assert len(r["inv_freq"]) == 3 and all(torch.equal(v, _inv_freq()) for v in r["inv_freq"]), rank
        assert r["finite"], rank


# ---- checkpoints with cpu_offload ----------------------------------------------------------------------------
def _checkpoint_body(
    rank: int, world_size: int, accelerator: str, flavour: str, offload: bool, tmp: str
) -> dict:
    from torchloom.strategies import FSDP2Strategy, FSDPStrategy

    cls = FSDPStrategy if flavour == "fsdp" else FSDP2Strategy
    out: dict = {}
    for fmt, async_save in (("full", False), ("full", True), ("sharded", False), ("sharded", True)):

        def make(fmt: str = fmt) -> tuple[Loom, object, object]:
            loom = Loom(
                accelerator=accelerator,
                devices=world_size,
                strategy=cls(cpu_offload=offload, state_dict_type=fmt),
            )
            loom.launch()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = loom.setup_module(_build(loom, flavour))
            opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
            return loom, model, opt

        def step(loom: Loom, model, opt, seed: int) -> None:
            g = torch.Generator().manual_seed(100 * seed + rank)
            x = torch.randn(4, D_IN, generator=g).to(loom.device)
            y = torch.randn(4, 1, generator=g).to(loom.device)
            loom.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

        loom, model, opt = make()
        for seed in range(2):
            step(loom, model, opt, seed)
        path = f"{tmp}/{flavour}-{fmt}-{async_save}"
        loom.save(path, {"model": model, "optimizer": opt, "step": 2}, async_save=async_save)
        saved = _full_cpu_state(loom, model)
        step(loom, model, opt, 7)
        after_one_more = _full_cpu_state(loom, model)
        loom._checkpointer.finish_pending_save()  # the write of an asynchronous save is complete

        loom2, model2, opt2 = make()
        state = {"model": model2, "optimizer": opt2, "step": 0}
        loom2.load(path, state)
        loaded = _full_cpu_state(loom2, model2)
        step(loom2, model2, opt2, 7)
        out[(fmt, async_save)] = {
            "step": state["step"],
            "saved": saved,
            "loaded": loaded,
            "after": after_one_more,
            "after_load": _full_cpu_state(loom2, model2),
            "misplaced": _misplaced(model2.forward_module, loom2.device, shards_on_cpu=offload),
        }
    return out


def _checkpoint_cases():
    for flavour in ("fsdp", "fsdp2"):
        yield pytest.param("cpu", flavour, False, id=f"cpu-{flavour}")
        yield pytest.param("cuda", flavour, True, id=f"cuda-{flavour}-offload", marks=_offload_mark(flavour))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("device,flavour,offload", list(_checkpoint_cases()))
def test_full_and_sharded_checkpoints_round_trip_with_offload(device, flavour, offload, tmp_path):
    results = run_ranks(
        _checkpoint_body, _world(device), device, flavour, offload, str(tmp_path), timeout=360
    )
    for rank, r in enumerate(results):
        for case, c in r.items():
            assert c["step"] == 2, case
            assert c["misplaced"] == [], (rank, case, c["misplaced"])
    for case, c in results[0].items():
        assert c["saved"].keys() == c["loaded"].keys() and c["saved"], case
        for name in c["saved"]:
            assert torch.equal(c["saved"][name], c["loaded"][name]), (case, name)
        # The optimizer's state came back too: the next step is the one the original run took.
        for name in c["after"]:
            torch.testing.assert_close(c["after_load"][name], c["after"][name], rtol=1e-5, atol=1e-6)


# ---- the replicated leftovers' gradient sync -----------------------------------------------------------------
def _leftover_sync_body(rank: int, world_size: int, accelerator: str, flavour: str) -> dict:
    loom = Loom(accelerator=accelerator, devices=world_size, strategy=flavour)
    loom.launch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = loom.setup_module(_build(loom, flavour))
    leftovers = analyze(model.forward_module).leftovers
    assert leftovers, "the layout must have replicated leftovers"
    x, y = data()
    out: dict = {"grads": [], "local": []}
    for step in range(2):
        for micro in range(ACCUM):  # accumulation: the sync happens once, after the last micro-batch
            xs = x[step, micro, rank::world_size].to(loom.device)
            ys = y[step, micro, rank::world_size].to(loom.device)
            with loom.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loom.backward(nn.functional.mse_loss(model(xs), ys))
        out["grads"].append({n: p.grad.detach().cpu().clone() for n, p in leftovers})
        model.zero_grad()
        # This rank's own gradient of the same micro-batches, without any sync, for the mean.
        ref = Net().to(loom.device)
        ref.load_state_dict(_gathered_state(model))
        for micro in range(ACCUM):
            xs = x[step, micro, rank::world_size].to(loom.device)
            ys = y[step, micro, rank::world_size].to(loom.device)
            nn.functional.mse_loss(ref(xs), ys).backward()
        params = dict(ref.named_parameters())
        out["local"].append({n: params[n].grad.detach().cpu().clone() for n, _ in leftovers})
    return out


def _gathered_state(model) -> dict[str, torch.Tensor]:
    """Every rank's full parameters (gathered on every rank, unlike `_full_cpu_state`)."""
    state = get_model_state_dict(model.forward_module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
@pytest.mark.parametrize(
    "device",
    [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda(min_devices=2))],
)
def test_leftover_gradient_sync(device, flavour):
    results = run_ranks(_leftover_sync_body, 2, device, flavour, timeout=240)
    for step in range(2):
        names = results[0]["grads"][step].keys()
        for name in names:
            synced = [r["grads"][step][name] for r in results]
            assert torch.equal(synced[0], synced[1]), (step, name)  # identical on every rank
            mean = sum(r["local"][step][name] for r in results) / len(results)
            torch.testing.assert_close(synced[0], mean, rtol=1e-5, atol=1e-6)


# ---- async sharded saves: staging ----------------------------------------------------------------------------
def test_staging_options_pin_memory_only_on_cuda():
    from torchloom.checkpointing.sharded import _staging_options

    cpu = _staging_options(torch.device("cpu"))
    assert not cpu.use_pinned_memory and not cpu.use_non_blocking_copy and not cpu.use_async_staging
    gpu = _staging_options(torch.device("cuda", 0))
    assert gpu.use_pinned_memory and gpu.use_non_blocking_copy
    assert not gpu.use_async_staging  # staged before async_save returns: training may then change the tensors
    assert not gpu.use_shared_memory


@pytest.mark.cuda
def test_cuda_stager_stages_into_pinned_memory():
    from torchloom.checkpointing.sharded import _stager

    state = {"w": torch.randn(64, 64, device="cuda"), "nested": {"b": torch.arange(5, device="cuda")}}
    staged = _stager(torch.device("cuda", 0)).stage(state)
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    assert torch.equal(staged["w"], state["w"].cpu())
    assert torch.equal(staged["nested"]["b"], state["nested"]["b"].cpu())


# ---- the desync report under NCCL ----------------------------------------------------------------------------
@pytest.mark.cuda
def test_a_collective_queued_on_the_gpu_stays_current_until_it_completes():
    from torchloom.diagnostics import CollectiveRecord
    from torchloom.strategies.parallel import _recorded_cuda_event

    record = CollectiveRecord()
    record.device_event = _recorded_cuda_event
    with record("all_reduce", torch.ones(2)):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, queued behind nothing: still running
    snapshot = record.snapshot(None, "answered")
    assert (snapshot["name"], snapshot["inside"], snapshot["queued"]) == ("all_reduce", True, True)
    assert record.overdue(0.0)
    torch.cuda.synchronize()
    snapshot = record.snapshot(None, "answered")
    assert (snapshot["inside"], snapshot["queued"]) == (False, False) and not record.overdue(0.0)


@pytest.mark.timeout(180)
@pytest.mark.cuda(min_devices=2)
def test_nccl_hang_is_reported_before_the_watchdog_aborts(tmp_path):
    """Rank 1 hangs in its data loader while rank 0's all-reduce is queued on the GPU: torchloom's watchdog
    prints the report once the collective has waited for the timeout, before NCCL's own watchdog aborts the rank
    (15 s later), and the job ends non-zero with no process left."""
    import time

    from harness import PYTHON, run_job, wait_no_strays
    from test_desync import SCRIPT, TIMEOUT_S, _line, _report

    from torchloom.diagnostics import NCCL_REPORT_GRACE

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace('accelerator="cpu"', 'accelerator="cuda"'))
    start = time.monotonic()
    result, token = run_job([PYTHON, str(script), "stuck"], timeout=150, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode != 0 and "FINISHED" not in result.stdout, result.stdout
    assert wait_no_strays(token) == []
    report = _report(result.stdout)
    a, c, loader = _line("A"), _line("C"), _line("LOADER")
    assert "queued on the device and not completed" in report
    assert report.splitlines()[-1] == (
        f"culprit: rank 1 never reached all_reduce #7 (train.py:{a}); it is in user code at "
        f"train.py:{loader} in slow_loader (its last collective was barrier #6 at train.py:{c})"
    )
    assert elapsed < TIMEOUT_S + NCCL_REPORT_GRACE.total_seconds() + 40, (elapsed, result.stdout)


# ---- a model built on the CPU, sharded by a policy -----------------------------------------------------------
def _policy_body(rank: int, world_size: int, accelerator: str, flavour: str) -> dict:
    """On CUDA without and with cpu_offload, in one launch of the ranks; on CPU without."""
    from torchloom.strategies import FSDP2Strategy, FSDPStrategy

    out: dict = {}
    one_fsdp1_unit_group = flavour == "fsdp" and world_size == 1  # offload refused there (NO_SHARD)
    for offload in (False,) if accelerator == "cpu" or one_fsdp1_unit_group else (False, True):
        if flavour == "fsdp":
            strategy = FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=offload)
        else:
            strategy = FSDP2Strategy(shard_policy={Block}, cpu_offload=offload)
        loom = Loom(accelerator=accelerator, devices=world_size, strategy=strategy)
        loom.launch()
        torch.manual_seed(rank)  # each rank its own weights: setup must start every rank from rank 0's
        model = _Normed()  # on the CPU, outside init_module: NCCL refuses the broadcast of CPU tensors
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = loom.setup_module(model)
        result = {"misplaced": _misplaced(wrapped.forward_module, loom.device, shards_on_cpu=offload)}
        result["initial"] = _full_cpu_state(loom, wrapped)
        opt = loom.setup_optimizers(torch.optim.SGD(wrapped.parameters(), lr=0.1))
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            loss = wrapped(torch.randn(8, D_IN, generator=g).to(loom.device)).pow(2).mean()
            loom.backward(loss)
            loom.clip_gradients(wrapped, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
        result["finite"] = bool(torch.isfinite(loss).item())
        out[offload] = result
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_model_built_on_the_cpu_and_sharded_by_a_policy(device, flavour):
    results = run_ranks(_policy_body, _world(device), device, flavour, timeout=240)
    torch.manual_seed(0)
    rank0 = {k: v.float() for k, v in _Normed().state_dict().items()}
    for offload in results[0]:
        for rank, r in enumerate(results):
            assert r[offload]["misplaced"] == [], (offload, rank, r[offload]["misplaced"])
            assert r[offload]["finite"], (offload, rank)
        initial = results[0][offload]["initial"]  # gathered from every rank's shards: each holds rank 0's
        assert initial.keys() == rank0.keys(), (offload, sorted(initial), sorted(rank0))
        for name, value in initial.items():
            torch.testing.assert_close(value, rank0[name], rtol=0, atol=0, msg=f"offload={offload} {name}")


# ---- full loads under cpu_offload ----------------------------------------------------------------------------
class _NormedBlock(Block):
    """A unit with buffers of its own: FSDP offloads the parameters, never the buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class _OffloadModel(_Normed):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_NormedBlock() for _ in range(3))


def _offload_load_body(rank: int, world_size: int, flavour: str, tmp: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    from torchloom.strategies import FSDP2Strategy, FSDPStrategy

    cls = FSDPStrategy if flavour == "fsdp" else FSDP2Strategy

    def make(seed: int) -> tuple[Loom, object, object]:
        loom = Loom(
            accelerator="cuda", devices=world_size, strategy=cls(cpu_offload=True, state_dict_type="full")
        )
        loom.launch()
        torch.manual_seed(seed)
        model = _OffloadModel()
        for i, block in enumerate(model.blocks):  # units with the strategy's offload; leftovers on the GPU
            if flavour == "fsdp":
                model.blocks[i] = FSDP(block, **loom.strategy.unit_kwargs())
            else:
                fully_shard(block, **loom.strategy.unit_kwargs())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = loom.setup_module(model)
        return loom, wrapped, loom.setup_optimizers(torch.optim.Adam(wrapped.parameters(), lr=1e-2))

    def step(loom: Loom, model, opt, seed: int) -> None:
        g = torch.Generator().manual_seed(100 * seed + rank)
        loss = model(torch.randn(8, D_IN, generator=g).to(loom.device)).pow(2).mean()
        loom.backward(loss)
        opt.step()
        opt.zero_grad()

    loom, model, opt = make(0)
    for seed in range(2):
        step(loom, model, opt, seed)
    path = Path(tmp) / f"{flavour}.pt"
    loom.save(path, {"model": model, "optimizer": opt})  # the full format: one file
    saved = _full_cpu_state(loom, model)
    plain = _full_cpu_state(loom, model, as_float=False)  # a plain state dict, for load_raw
    if rank == 0:
        torch.save(plain, Path(tmp) / f"{flavour}-plain.pt")
    step(loom, model, opt, 7)
    out: dict = {"saved": saved, "after": _full_cpu_state(loom, model)}

    loom2, model2, opt2 = make(1)
    loom2.load(path, {"model": model2, "optimizer": opt2})  # torch refused this: "Multiple devices found"
    out["loaded"] = _full_cpu_state(loom2, model2)
    out["misplaced"] = _misplaced(model2.forward_module, loom2.device, shards_on_cpu=True)
    step(loom2, model2, opt2, 7)  # the optimizer's state came back, on the devices it lives on
    out["after_load"] = _full_cpu_state(loom2, model2)

    loom2.barrier()  # rank 0 wrote the plain file
    loom3, model3, _ = make(2)
    loom3.load_raw(Path(tmp) / f"{flavour}-plain.pt", model3)
    out["raw"] = _full_cpu_state(loom3, model3)
    out["raw_misplaced"] = _misplaced(model3.forward_module, loom3.device, shards_on_cpu=True)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", [pytest.param(f, marks=_offload_mark(f)) for f in ("fsdp", "fsdp2")])
def test_full_loads_with_offload_and_tensors_left_on_the_gpu(flavour, tmp_path):
    results = run_ranks(_offload_load_body, _world("cuda"), flavour, str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        assert r["misplaced"] == [] and r["raw_misplaced"] == [], (rank, r["misplaced"], r["raw_misplaced"])
    r = results[0]  # on GPUs only rank 0 gathers
    assert r["saved"] and any("norm.running_mean" in k for k in r["saved"]), sorted(r["saved"])
    for name, value in r["saved"].items():
        assert torch.equal(r["loaded"][name], value), name
        assert torch.equal(r["raw"][name], value), name
        torch.testing.assert_close(r["after_load"][name], r["after"][name], rtol=1e-5, atol=1e-6)


# ---- save_raw under cpu_offload ------------------------------------------------------------------------------
def _save_raw_body(
    rank: int, world_size: int, accelerator: str, flavour: str, offload: bool, out: str
) -> dict:
    from torchloom.strategies import FSDP2Strategy, FSDPStrategy

    cls = FSDPStrategy if flavour == "fsdp" else FSDP2Strategy
    loom = Loom(accelerator=accelerator, devices=world_size, strategy=cls(cpu_offload=offload))
    loom.launch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = loom.setup_module(_build(loom, flavour))
    loom.save_raw(out, model)  # gathers every shard: over NCCL, from host memory under offload
    return {"full": _full_cpu_state(loom, model)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "device,offload,flavour",
    [
        *(pytest.param("cpu", False, f, id=f"cpu-{f}") for f in ("fsdp", "fsdp2")),
        *(
            pytest.param("cuda", True, f, id=f"cuda-offload-{f}", marks=_offload_mark(f))
            for f in ("fsdp", "fsdp2")
        ),
    ],
)
def test_save_raw_gathers_every_shard(device, offload, flavour, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    results = run_ranks(_save_raw_body, _world(device), device, flavour, offload, str(out), timeout=240)
    written: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        written.update(load_file(file))
    full = results[0]["full"]
    assert written.keys() == full.keys(), (sorted(written), sorted(full))
    for name, value in full.items():
        assert torch.equal(written[name].float(), value), name


# ---- every rank's own GPU generator --------------------------------------------------------------------------
def _generators_body(rank: int, world_size: int, tmp: str) -> dict:
    from torchloom.checkpointing import META_KEY

    loom = Loom(accelerator="cuda", devices=world_size, strategy="ddp" if world_size > 1 else "auto")
    loom.launch()
    model = loom.setup_module(nn.Linear(4, 2))
    torch.cuda.manual_seed(100 + rank)  # this rank's GPU only
    path = Path(tmp) / "ckpt.pt"
    loom.save(path, {"model": model})
    expected = torch.rand(8, device=loom.device).cpu()
    out: dict = {}
    for case in ("saved", "every_gpu_listed"):
        if case == "every_gpu_listed":
            # As checkpoints written before kept them: every visible GPU's generator, by index, here listing more
            # GPUs than this machine has (restored by position, that crashed with IndexError).
            loom.barrier()  # every rank has read the file
            if rank == 0:
                ckpt = torch.load(path, weights_only=True)
                for r, generators in enumerate(ckpt[META_KEY]["rng"]):
                    other = torch.cuda.get_rng_state(loom.device)
                    listed = [other] * (torch.cuda.device_count() + 3)
                    listed[r] = generators["cuda"]  # rank r ran on GPU r
                    generators["cuda"] = listed
                torch.save(ckpt, path)
            loom.barrier()
        torch.cuda.manual_seed(999)
        loom.load(path, {"model": model}, restore_run_state=True)
        out[case] = torch.rand(8, device=loom.device).cpu()
    out["expected"] = expected
    return out


@pytest.mark.timeout(180)
@pytest.mark.cuda
def test_each_rank_saves_and_restores_its_own_gpus_generator(tmp_path):
    results = run_ranks(_generators_body, _world("cuda"), str(tmp_path), timeout=150)
    for rank, r in enumerate(results):
        assert torch.equal(r["saved"], r["expected"]), rank
        assert torch.equal(r["every_gpu_listed"], r["expected"]), rank
    if len(results) > 1:
        assert not torch.equal(results[0]["expected"], results[1]["expected"])  # two generators, two streams


# ---- FSDP1's offload of unsharded units ----------------------------------------------------------------------
def test_fsdp1_offload_without_sharding_is_refused():
    """On one GPU (FSDP1 turns a shard group of one process into NO_SHARD) or with sharding_strategy="NO_SHARD",
    FSDP1's offload trained wrongly after a checkpoint save or load (seen on an H200: the next step off the
    uninterrupted run's by twice the learning rate, with identical saved and loaded state). The check reads only
    the configuration, so it is exercised here on CPU with the strategy's CPU refusal stepped around."""
    from torchloom import ConfigurationError
    from torchloom.strategies import FSDPStrategy

    for devices, option in ((1, {}), (2, {"sharding_strategy": "NO_SHARD"})):
        loom = Loom(accelerator="cpu", devices=devices, strategy=FSDPStrategy(**option))
        loom.strategy.cpu_offload = True  # as FSDPStrategy(cpu_offload=True) on a GPU
        with pytest.raises(ConfigurationError, match="trains wrongly after a checkpoint") as caught:
            loom.strategy._check_mesh()
        assert "strategy='fsdp2' with cpu_offload=True" in str(caught.value)
    loom = Loom(accelerator="cpu", devices=2, strategy="fsdp")  # sharded over 2: offload allowed
    loom.strategy.cpu_offload = True
    loom.strategy._check_mesh()


@pytest.mark.cuda
def test_fsdp1_offload_on_one_gpu_is_refused():
    from torchloom import ConfigurationError
    from torchloom.strategies import FSDPStrategy

    with pytest.raises(ConfigurationError, match="one process per shard group"):
        Loom(accelerator="cuda", devices=1, strategy=FSDPStrategy(cpu_offload=True))


def _hand_made_offload_body(rank: int, world_size: int, accelerator: str) -> str:
    """A unit made by hand with FSDP1's own CPUOffload, on one process (FSDP1 runs it NO_SHARD): refused at
    setup_module with the reason, before any training."""
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from torchloom import ConfigurationError

    loom = Loom(accelerator=accelerator, devices=world_size, strategy="fsdp")
    loom.launch()
    model = Net()
    if accelerator == "cuda":
        model.blocks[0] = FSDP(
            model.blocks[0], device_id=loom.device, cpu_offload=CPUOffload(offload_params=True)
        )
    else:
        # FSDP1 cannot offload without a GPU (it pins host memory): the check reads only the unit's options.
        model.blocks[0] = FSDP(model.blocks[0], device_id=loom.device)
        model.blocks[0].cpu_offload = CPUOffload(offload_params=True)
    with pytest.raises(ConfigurationError, match="trains wrongly after a checkpoint") as caught:
        loom.setup_module(model)
    return str(caught.value)


@pytest.mark.parametrize("accelerator", DEVICES)
def test_fsdp1_hand_made_offload_without_sharding_is_refused(accelerator):
    [message] = run_ranks(_hand_made_offload_body, 1, accelerator)
    assert "The unit 'blocks.0' offloads its parameters" in message
    assert "strategy='fsdp2' with cpu_offload=True" in message
