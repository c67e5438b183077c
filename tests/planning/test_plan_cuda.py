"""`torchloom plan` of a script written for CUDA (`Loom(accelerator="cuda")`) on a machine without one: planned as
the CUDA job it is, with the caching allocator simulated on the plan's own allocations (reserved figures that
follow by hand from the allocator's rules), and the script's options that disagree with the plan's command line
named with the plan's own options."""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from torchloom.planning.plan import PlanError, format_plan, plan

MiB = 1 << 20

# Two large tensors held through the steps (8 MiB and 12.5 MiB) and a model of one weight: everything else the
# step makes is far under 1 MiB in all, in the small pool.
_SCRIPT = """
import torch
from torchloom import Loom

loom = Loom(accelerator="cuda"{devices})
# the planned device answers torch's queries (h100: sm90; a device given by its memory alone: sm80)
assert torch.cuda.is_available() and torch.cuda.device_count() == 1, "the planned device is not seen"
assert torch.cuda.get_device_capability() in ((9, 0), (8, 0)), torch.cuda.get_device_capability()
model = torch.nn.Linear(4, 1, bias=False).to("cuda")  # made on the plan's CPU device: no copy
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = loom.setup(model, optimizer)
held = [torch.empty(2 * 2**20, device=loom.device), torch.empty(25 * 2**17, device=loom.device)]
for _ in range(2):
    loss = model(torch.ones(2, 4, device=loom.device)).sum()
    loom.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
"""


def _plan(folder, name, in_script="", **options):
    script = folder / f"{name}.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(devices=in_script)))
    try:
        return plan(str(script), timeout=600, **options)
    except PlanError as error:
        return error


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda-plans")
    calls = {
        "default": dict(device_memory=80 << 30, alloc_conf=""),
        "expandable": dict(device="h100", alloc_conf="expandable_segments:True"),
        "devices": dict(devices=1, alloc_conf="", devices_in_script=", devices=2"),
    }
    with ThreadPoolExecutor(len(calls) + 3) as pool:
        futures = {
            name: pool.submit(_plan, folder, name, options.pop("devices_in_script", ""), **options)
            for name, options in calls.items()
        }
        futures["llama"] = pool.submit(_plan_llama)
        futures["offload"] = pool.submit(_plan_offload, folder)
        futures["offload_fsdp1"] = pool.submit(_plan_offload, folder, "FSDPStrategy")
        return {name: future.result() for name, future in futures.items()}


_OFFLOAD = """
import torch
from torchloom import Loom
from torchloom.strategies import FSDP2Strategy

loom = Loom(accelerator="cuda", devices=2, strategy=FSDP2Strategy(cpu_offload=True))
loom.launch()
with loom.init_module(empty_init=True):
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512, bias=False) for _ in range(4)))
model = loom.setup_module(model)
optimizer = loom.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
for _ in range(2):
    loss = model(torch.randn(64, 512, device=loom.device)).sum()
    loom.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
"""


def _plan_offload(folder, strategy="FSDP2Strategy"):
    script = folder / f"offload_{strategy}.py"
    script.write_text(_OFFLOAD.replace("FSDP2Strategy", strategy))
    try:
        return plan(str(script), devices=2, device="h100", alloc_conf="", timeout=600)
    except PlanError as error:
        return error


def _plan_llama():
    """The Llama benchmark's recipe (torchtitan's: per-block units, selective AC keyed on CUDA's attention op,
    bf16 parameters, fp32 reduction) on a small Llama, at 2 ranks on an H100."""
    try:
        return plan(
            str(Path(__file__).parents[2] / "benchmarks" / "llama3_8b_plan.py"),
            ["--tiny", "--layers", "2", "--seq", "64", "--steps", "2"],
            devices=2,
            device="h100",
            alloc_conf="",
            timeout=600,
        )
    except PlanError as error:
        return error


def test_cuda_script_planned_with_the_allocator_simulated(plans):
    result = plans["default"]
    assert not isinstance(result, PlanError), str(result)
    (rank,) = result["ranks"]
    # 8 MiB: a 20 MiB segment, split (12 MiB left); 12.5 MiB (>= 10 MiB): a segment of its own rounded up to
    # 2 MiB, 14 MiB; everything else: one 2 MiB segment of the small pool. Then cuBLAS's workspaces (sm80:
    # 8 MiB + 128 KiB), one at the forward's first matmul (from the 12 MiB left, split: 3.875 MiB left) and one at
    # the backward's (autograd's thread): a new 20 MiB segment. 20 + 14 + 2 + 20 = 56 MiB.
    assert rank["allocator"]["reserved_peak"] == 56 * MiB
    workspace = 8 * MiB + 128 * 1024
    assert rank["cublas"]["bytes"] == 2 * workspace
    # allocated: the tracked bytes rounded up to 512 B each and the two workspaces
    allocated = rank["allocator"]["allocated_peak"] - 2 * workspace
    assert rank["peak_bytes"] <= allocated < rank["peak_bytes"] + MiB
    assert result["reserved_peak_bytes"] == 56 * MiB
    text = format_plan(result)
    assert "as a CUDA job on a device of 80.00 GiB" in text
    assert "max_memory_reserved 56.00 MiB of the device's 80.00 GiB" in text
    assert "cuBLAS workspaces" in text and "autograd's device thread (backward), default stream" in text
    # one rank: no communicator; the CUDA context's allowance (512 MiB) beside the 56 MiB reserved
    fit = result["device_fit"]
    assert (fit["needed"], fit["nccl"], fit["fits"]) == (56 * MiB + 512 * MiB, 0, True)
    assert "568.00 MiB of 80.00 GiB: fits" in text


def test_the_device_fit_counts_what_is_outside_the_allocator():
    from torchloom.planning.plan import CUDA_CONTEXT, DEVICES, device_fit, planned_device

    entries = [
        {"rank": 0, "allocator": {"reserved_peak": 600 * MiB}, "nccl": {"bytes": 256 * MiB}},
        {"rank": 3, "allocator": {"reserved_peak": 500 * MiB}, "nccl": {"bytes": 256 * MiB}},
    ]
    # the largest rank: 600 + 256 + 512 = 1368 MiB, over a 1 GiB device and within a 2 GiB one
    assert device_fit(entries, {"memory": 1 << 30})["fits"] is False
    fit = device_fit(entries, {"memory": 2 << 30})
    assert (fit["rank"], fit["needed"], fit["fits"]) == (0, 600 * MiB + 256 * MiB + CUDA_CONTEXT, True)
    assert device_fit(entries, {"memory": None})["fits"] is None
    # the table: what nvidia-smi reports, in MiB, and NVIDIA's capabilities (L4 and L40S: Ada, 8.9; B200: 10.0)
    assert DEVICES["h100"] == (81559 * MiB, (9, 0)) and DEVICES["l40s"][1] == (8, 9)
    assert planned_device("B200", None)["capability"] == [10, 0]


def test_expandable_segments_from_the_alloc_conf(plans):
    result = plans["expandable"]
    assert not isinstance(result, PlanError), str(result)
    # 8 MiB: one 20 MiB page of the large pool's segment (12 MiB free at its end); 12.5 MiB: those 12 MiB and
    # one more page, 40 MiB (19.5 MiB free at its end); the small pool: one 2 MiB page. cuBLAS's workspaces on
    # an H100 (sm90): 32 MiB, the forward's (the 19.5 MiB and one page: 60 MiB, 7.5 free) and the backward's
    # (the 7.5 MiB and two pages: 100 MiB). 100 + 2 = 102 MiB.
    assert result["ranks"][0]["allocator"]["reserved_peak"] == 102 * MiB
    assert result["ranks"][0]["cublas"]["bytes"] == 64 * MiB
    assert result["device"]["name"] == "h100" and result["device"]["capability"] == [9, 0]
    assert "expandable segments" in format_plan(result)


def test_devices_in_the_script_named_with_the_plans_option(plans):
    error = plans["devices"]
    assert isinstance(error, PlanError)
    assert "torchloom plan --devices 2" in str(error)
    assert "torchloom run" not in str(error) and "--accelerator" not in str(error)


def test_a_llama_with_torchtitans_recipe_planned_with_cudas_streams_and_kernels(plans):
    result = plans["llama"]
    assert not isinstance(result, PlanError), str(result)
    for rank in result["ranks"]:
        # 2 blocks x 2 steps, each forward and its recomputation: CUDA's flash kernel on an H100 in bf16
        assert set(rank["attention"]) == {"flash"} and rank["attention"]["flash"]["calls"] == 8
        pools = {(p["stream"], p["pool"]): p["bytes"] for p in rank["allocator"]["reserved_at_peak"]}
        # FSDP2's gathers and reduce-scatters reserve segments of their own streams, apart from the default one
        assert {"default stream", "all_gather_copy_in_stream", "reduce_scatter_stream"} <= {
            s for s, _ in pools
        }
        assert sum(pools.values()) == rank["allocator"]["reserved_peak"]
        assert rank["nccl"]["communicators"] >= 1
    text = format_plan(result)
    assert "planned as CUDA's flash kernel (aten._scaled_dot_product_flash_attention)" in text
    assert "reduce_scatter_stream large pool" in text and "outside the allocator" in text


def test_cpu_offload_plans_the_host_apart_from_the_device(plans):
    result = plans["offload"]
    assert not isinstance(result, PlanError), str(result)
    shard = 512 * 512 * 4 // 2  # each weight's fp32 shard on each of the 2 ranks: 512 KiB
    for rank in result["ranks"]:
        host = rank["host"]["breakdown"]
        # in the host's memory: the 4 shards of the parameters, their gradients (copied from the device after
        # the reduce-scatter) and AdamW's two moments; its step runs there, one parameter at a time (the CPU has
        # no foreach kernels): at most 3 shards of temporaries (the sqrt and the division of one parameter, and
        # the previous parameter's denominator, still held by the loop's variable)
        assert (host["parameters"], host["gradients"], host["optimizer state"]) == (
            4 * shard,
            4 * shard,
            8 * shard,
        )
        assert (
            rank["host"]["peak_bytes"] == 16 * shard + host["temporaries"]
            and host["temporaries"] <= 3 * shard
        )
        # on the device: none of it (the step counters aside, 4 B each); the all-gathers' host-to-device copies
        device = rank["breakdown"]
        assert device["parameters"] == device["gradients"] == 0 and device["optimizer state"] <= 16
        assert rank["peak_bytes"] < 5 * 4 * shard  # the gathered model (4 MiB) and the activations
    assert result["host_peak_bytes"] == max(r["host"]["peak_bytes"] for r in result["ranks"])
    assert "host memory (CPU offload" in format_plan(result)


def test_cpu_offload_under_fsdp1_is_refused_with_the_plans_words(plans):
    error = plans["offload_fsdp1"]
    assert isinstance(error, PlanError)
    assert "strategy='fsdp2' (FSDP2Strategy(cpu_offload=True)) only" in str(error)
