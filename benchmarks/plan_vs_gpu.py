"""The planner against a real GPU: `torchloom plan` of the Llama benchmark's recipe at a size one GPU holds (Llama
3.1 8B with 1 transformer block: 1.3e9 parameters, the full vocabulary and sequence), then the same script run
for real on the GPU, and the two sets of figures side by side: `max_memory_allocated()` (goal: within 5%) and
`max_memory_reserved()` (goal: within 10%).

    python benchmarks/plan_vs_gpu.py [--layers 1] [--steps 3] [--out DIR]     # part of `make gpu-check`

Needs a CUDA GPU (exit 2 with the reason otherwise: it never reports a CPU run as a GPU figure). The plan is told
the GPU's own memory and, for the devices `torchloom plan --device` knows, its name (its capability picks the
attention kernel). Exit 1 when a figure misses its goal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = str(Path(__file__).with_name("llama3_8b_plan.py"))
GOALS = {"max_memory_allocated": 0.05, "max_memory_reserved": 0.10}


def _device_name(name: str) -> str | None:
    """The `torchloom plan --device` name of this GPU, when the plan knows it."""
    lowered = name.lower()
    for known in ("h200", "h100", "l4"):
        if known in lowered:
            return known
    if "a100" in lowered:
        return "a100-40gb" if "40gb" in lowered.replace(" ", "") else "a100"
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="gpu-check-results")
    args = parser.parse_args()
    if torch.version.cuda is None or not torch.cuda.is_available():
        print("plan_vs_gpu: needs a CUDA GPU and a CUDA build of torch; nothing was run", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    properties = torch.cuda.get_device_properties(0)
    script_args = ["--layers", str(args.layers), "--steps", str(args.steps)]
    planned_json = os.path.join(args.out, "plan_vs_gpu_plan.json")
    measured_json = os.path.join(args.out, "plan_vs_gpu_measured.json")
    device = ["--device", name] if (name := _device_name(properties.name)) else []
    plan = [sys.executable, "-m", "torchloom.cli", "plan", "--devices", "1", "--steps", str(args.steps)]
    plan += [*device, "--device-memory", f"{properties.total_memory}B", "--json", planned_json, SCRIPT]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    print("plan_vs_gpu:", " ".join(plan + script_args), flush=True)
    subprocess.run(plan + script_args, check=True, env=env)
    run = [sys.executable, SCRIPT, *script_args, "--out", measured_json]
    print("plan_vs_gpu:", " ".join(run), flush=True)
    subprocess.run(run, check=True, env=env)
    with open(planned_json) as f:
        planned = json.load(f)["ranks"][0]["allocator"]
    with open(measured_json) as f:
        measured = json.load(f)
    print(
        f"plan_vs_gpu: {measured['device']}, Llama 3.1 8B recipe with {args.layers} block(s), {args.steps} steps"
    )
    missed = False
    for key, field in (("max_memory_allocated", "allocated_peak"), ("max_memory_reserved", "reserved_peak")):
        ratio = planned[field] / measured[key]
        ok = abs(ratio - 1) <= GOALS[key]
        missed |= not ok
        print(
            f"ratio  {key}  planned {planned[field] / 2**30:.3f} GiB  measured {measured[key] / 2**30:.3f} GiB  "
            f"planned/measured {ratio:.3f}  (goal within {GOALS[key]:.0%}: {'met' if ok else 'MISSED'})"
        )
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
