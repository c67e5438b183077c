"""FLOPs a model needs and a device offers.

- `measure_flops` of a transformer block equals torch's `FlopCounterMode` and Fabric's `measure_flops` exactly,
  and the analytical count (6 x parameters x tokens for the dense part plus the attention's 12 x B x T^2 x d)
  within 1%; on a meta-device model (no memory) it equals the count on the real one.
- `count_flops` tells model FLOPs from hardware FLOPs under activation checkpointing (reentrant or not), and
  divides by the tensor-parallel size: on 2 gloo ranks, each rank's FLOPs on its shards equal the meta count / 2.
- `get_available_flops` gives the dense peak: the same figure as Lightning 2.6.6 for every chip where 2.6.6 is
  right, half of 2.6.6's where 2.6.6 used the sparse figure (H200, H100 NVL), and figures for the H200's and
  B200's real device names, which 2.6.6 does not recognise.
"""

from __future__ import annotations

import copy
import math
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from lightning.fabric.utilities import throughput as fabric_tp
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from torchloom.throughput import count_flops, get_available_flops, measure_flops


class Block(nn.Module):
    """A pre-norm transformer block: attention (scaled_dot_product_attention) and a 4x MLP."""

    def __init__(self, d: int, heads: int, ckpt: str | None = None) -> None:
        super().__init__()
        self.heads, self.ckpt = heads, ckpt
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt is None:
            return x + self._mlp(x + self._attention(x))
        x = x + checkpoint(self._attention, x, use_reentrant=self.ckpt == "reentrant")
        return x + checkpoint(self._mlp, x, use_reentrant=self.ckpt == "reentrant")


B, T, D, H = 4, 64, 128, 4


def _counter_flops(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def test_transformer_block_flops_are_torchs_fabrics_and_the_analytical_count():
    with torch.device("meta"):
        block = Block(D, H)
        x = torch.randn(B, T, D, requires_grad=True)
    forward, loss = (lambda: block(x)), (lambda y: y.sum())
    ours = measure_flops(block, forward, loss)
    assert ours == _counter_flops(lambda: loss(forward()).backward())
    assert ours == fabric_tp.measure_flops(block, forward, loss)
    assert measure_flops(block, forward) == fabric_tp.measure_flops(block, forward)
    params = sum(p.numel() for p in block.parameters())
    analytical = 6 * params * B * T + 12 * B * T * T * D  # dense part + QK^T and AV, forward and backward
    assert ours == pytest.approx(analytical, rel=0.01)
    assert measure_flops(block, forward) == pytest.approx(analytical / 3, rel=0.01)


class MatmulAttentionBlock(Block):
    """The same block with attention written as two matmuls, which torch's counter sees on every device."""

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))


def test_meta_copy_counts_like_the_real_model_without_memory():
    torch.manual_seed(0)
    x = torch.randn(B, T, D)
    meta_x = x.to("meta")
    for cls in (MatmulAttentionBlock, Block):
        real = cls(D, H)
        meta = copy.deepcopy(real).to("meta")
        assert all(p.is_meta for p in meta.parameters())
        on_real = count_flops(real, lambda real=real: real(x), lambda y: y.sum())
        on_meta = count_flops(meta, lambda meta=meta: meta(meta_x), lambda y: y.sum())
        assert on_meta.recomputed == 0
        if cls is MatmulAttentionBlock:
            assert on_meta == on_real
        else:
            # torch's counter has no formula for the CPU flash-attention kernel a real CPU model runs: it misses
            # the attention (12 B T^2 D) there; on the meta device SDPA decomposes into counted matmuls
            assert on_meta.model - on_real.model == 12 * B * T * T * D
    # a model of 40 GB is counted on the meta device in an instant, allocating nothing
    with torch.device("meta"):
        huge = nn.Linear(100_000, 100_000)
        h = torch.randn(8, 100_000)
    assert measure_flops(huge, lambda: huge(h)) == 2 * 8 * 100_000 * 100_000


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointing_counts_recomputation_as_hardware_flops_only(mode):
    with torch.device("meta"):
        plain, ckpt = Block(D, H), Block(D, H, ckpt=mode)
        x = torch.randn(B, T, D, requires_grad=True)
    loss = lambda y: y.sum()  # noqa: E731
    without = count_flops(plain, lambda: plain(x), loss)
    forward_only = measure_flops(plain, lambda: plain(x))
    counted = count_flops(ckpt, lambda: ckpt(x), loss)
    assert counted.model == without.model == without.hardware
    assert counted.hardware == measure_flops(ckpt, lambda: ckpt(x), loss)  # what FlopCounterMode sees
    if mode == "reentrant":
        assert counted.recomputed == forward_only  # the whole forward runs again
    else:
        # non-reentrant recomputation stops once it has the tensors the backward needs: each region's last
        # matmul (proj, down) is not rerun
        last = 2 * B * T * D * D + 2 * B * T * 4 * D * D
        assert counted.recomputed == forward_only - last


def test_checkpoint_wrapper_of_fsdp_users_is_counted_too():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    with torch.device("meta"):
        model = nn.Sequential(Block(D, H), Block(D, H))
        x = torch.randn(B, T, D)
    before = count_flops(model, lambda: model(x), lambda y: y.sum())
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    after = count_flops(model, lambda: model(x), lambda y: y.sum())
    assert after.model == before.model and after.recomputed > 0


def test_count_flops_refuses_a_bad_tensor_parallel_size():
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        count_flops(nn.Linear(2, 2), lambda: torch.ones(1), tensor_parallel_size=0)


def _tp_body(rank: int, world_size: int) -> tuple[int, int, int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32))
        meta = copy.deepcopy(model).to("meta")
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(4, 32)
        sees_global_shapes = _counter_flops(lambda: model(x).sum().backward())
        # what this device runs: the same layers on its local shards (rowwise output summed by an all-reduce)
        local = nn.Sequential(nn.Linear(32, 128 // world_size), nn.ReLU(), nn.Linear(128 // world_size, 32))
        with torch.no_grad():
            for mine, sharded in zip(local.parameters(), model.parameters(), strict=True):
                mine.copy_(sharded.to_local())
        on_device = _counter_flops(lambda: local(x).sum().backward())
        x_meta = x.to("meta")
        per_device = count_flops(
            meta, lambda: meta(x_meta), lambda y: y.sum(), tensor_parallel_size=world_size
        )
        whole = count_flops(meta, lambda: meta(x_meta), lambda y: y.sum())
        assert sees_global_shapes == whole.model  # torch's counter reads a DTensor's global shape
        return on_device, per_device.model, whole.model
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_flops_are_counted_per_device():
    results = run_ranks(_tp_body, 2, timeout=60)
    for on_device, per_device, whole in results:
        assert per_device == whole // 2
        assert on_device == per_device, (on_device, per_device, whole)


# ------------------------------------------------------------------------------------------------ peak FLOPs
# Device names as torch.cuda.get_device_name() reports them (and those Lightning's own test uses)
SAME_AS_2_6_6 = [
    "NVIDIA H100 PCIe",
    "h100-hbm2e",
    "h100-hbm3",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA GeForce RTX 4080",
    "NVIDIA GeForce RTX 4080 SUPER",
    "Tesla L40",
    "NVIDIA L4",
    "NVIDIA A100 80GB PCIe",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA GeForce RTX 3090",
    "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce RTX 3080",
    "NVIDIA GeForce RTX 3080 Ti",
    "NVIDIA GeForce RTX 3070",
    "NVIDIA A6000",
    "NVIDIA A10G",
    "NVIDIA GeForce RTX 2080 SUPER",
    "NVIDIA GeForce RTX 2080 Ti",
    "NVIDIA GeForce RTX 2080",
    "NVIDIA GeForce RTX 2070 Super",
    "Quadro RTX 5000 with Max-Q Design",
    "Tesla T4",
    "TITAN RTX",
    "Tesla V100-SXm2-32GB",
    "Tesla V100-PCIE-32GB",
    "Tesla V100S-PCIE-32GB",
]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8, "int4"]


def _peaks(name: str, ampere: bool, fn) -> dict:
    capability = (9, 0) if ampere else (7, 0)
    with (
        mock.patch("torch.cuda.get_device_name", return_value=name),
        mock.patch("torch.cuda.get_device_capability", return_value=capability),
        mock.patch("lightning.fabric.accelerators.cuda._is_ampere_or_later", return_value=ampere),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        return {dtype: fn(torch.device("cuda", 0), dtype) for dtype in DTYPES}


@pytest.mark.parametrize("ampere", [False, True])
def test_peaks_equal_lightning_2_6_6_where_it_is_dense(ampere):
    for name in SAME_AS_2_6_6:
        ours, theirs = (
            _peaks(name, ampere, get_available_flops),
            _peaks(name, ampere, fabric_tp.get_available_flops),
        )
        for dtype in DTYPES:
            if theirs[dtype] is None:
                assert ours[dtype] is None, (name, dtype)
            else:  # 2.6.6 writes some figures rounded differently (989.4e12 for 989.5e12, fp64 33.5e12 for 34e12)
                assert ours[dtype] == pytest.approx(theirs[dtype], rel=0.02), (name, dtype)
    # the A40 is the one chip 2.6.6 had wrong the other way: bf16 at its fp32 figure (master fixed it too)
    assert _peaks("NVIDIA A40", False, get_available_flops)[torch.bfloat16] == 149.7e12
    assert _peaks("NVIDIA A40", False, fabric_tp.get_available_flops)[torch.bfloat16] == 37.4e12


def test_h200_and_h100_nvl_are_dense_where_2_6_6_was_sparse():
    for name in ("NVIDIA H200 SXM1", "NVIDIA H200 NVL1", "h100-nvl"):
        ours, theirs = (
            _peaks(name, False, get_available_flops),
            _peaks(name, False, fabric_tp.get_available_flops),
        )
        for dtype in (torch.bfloat16, torch.float16, torch.int8):
            # 2.6.6 used the with-sparsity figure: twice the dense one (H100 NVL: the SXM part's sparse figure)
            assert theirs[dtype] >= 2 * ours[dtype] * 0.98, (name, dtype, ours[dtype], theirs[dtype])
    assert _peaks("NVIDIA H200 SXM1", False, get_available_flops)[torch.bfloat16] == 989.5e12
    assert _peaks("NVIDIA H200 NVL1", False, get_available_flops)[torch.bfloat16] == 835.5e12
    # the MFU of one step doubles with the fix: 2.6.6 would report half the utilisation
    step_flops = 6 * 8e9 * 4096  # an 8B model, 4096 tokens a step, 1 s a step
    ours = _peaks("NVIDIA H200 SXM1", False, get_available_flops)[torch.bfloat16]
    theirs = _peaks("NVIDIA H200 SXM1", False, fabric_tp.get_available_flops)[torch.bfloat16]
    assert (step_flops / ours) / (step_flops / theirs) == pytest.approx(2.0, rel=0.02)


def test_real_device_names_of_current_data_centre_gpus():
    expected = {
        "NVIDIA H200": 989.5e12,
        "NVIDIA H200 NVL": 835.5e12,
        "NVIDIA GH200 480GB": 989.5e12,
        "NVIDIA H100 NVL": 835.5e12,
        "NVIDIA B200": 2.25e15,
        "NVIDIA GB200": 2.5e15,
        "NVIDIA L40S": 366e12,
    }
    for name, bf16 in expected.items():
        assert _peaks(name, True, get_available_flops)[torch.bfloat16] == bf16, name
    # what torch reports on an H200 and a B200: 2.6.6 knows neither (no MFU at all)
    for name in ("NVIDIA H200", "NVIDIA B200"):
        assert _peaks(name, True, fabric_tp.get_available_flops)[torch.bfloat16] is None


def test_tf32_and_unknown_devices():
    with (
        mock.patch("torch.cuda.get_device_name", return_value="NVIDIA H100 80GB HBM3"),
        mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
    ):
        previous = torch.get_float32_matmul_precision()
        try:
            torch.set_float32_matmul_precision("highest")
            assert get_available_flops(torch.device("cuda"), torch.float32) == 67e12
            torch.set_float32_matmul_precision("high")
            assert get_available_flops(torch.device("cuda"), torch.float32) == 494.5e12
        finally:
            torch.set_float32_matmul_precision(previous)
    with (
        mock.patch("torch.cuda.get_device_name", return_value="CocoNut 9000"),
        pytest.warns(UserWarning, match="FLOPs not found for 'CocoNut 9000'.*available_flops="),
    ):
        assert get_available_flops(torch.device("cuda"), torch.bfloat16) is None
    with (
        mock.patch("torch.cuda.get_device_name", return_value="Tesla T4"),
        pytest.warns(UserWarning, match="does not support torch.bfloat16"),
    ):
        assert get_available_flops(torch.device("cuda"), torch.bfloat16) is None
    with pytest.warns(UserWarning, match="No peak FLOPs are known for a 'cpu' device.*available_flops="):
        assert get_available_flops(torch.device("cpu"), torch.float32) is None


def test_the_private_flop_counter_hook_is_checked(monkeypatch):
    from torchloom._torch_compat import TorchAPIMissing

    monkeypatch.delattr(FlopCounterMode, "_count_flops")
    with pytest.raises(TorchAPIMissing, match="FlopCounterMode._count_flops"):
        count_flops(nn.Linear(2, 2), lambda: torch.ones(1))
