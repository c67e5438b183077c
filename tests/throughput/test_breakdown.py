"""`TimeBreakdown` on real CPU ranks: the parts sum to the measured step time within 5% (1 process and 2 gloo ranks
with DDP and gradient accumulation), communication is exactly 0 on one process and seen on two, each step is
logged under `time/<part>`, `close()` gathers every rank's steps and removes every hook, and the summary draws as
HTML and PNG."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from torchloom import Loom
from torchloom.errors import MisuseError
from torchloom.loggers import Logger
from torchloom.throughput.breakdown import PARTS, TimeBreakdown

STEPS, ACCUMULATE = 6, 2


class _Capture(Logger):
    def __init__(self) -> None:
        self.rows: list[tuple[int | None, dict]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


class _Net(torch.nn.Module):
    """Heavy enough (a few ms a step) that the loop's own Python is small next to it; the loss is computed inside
    the forward, so nothing but the calls being timed runs between them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).square().mean()


def _breakdown_body(rank: int, world_size: int, out_dir: str) -> dict:
    torch.manual_seed(0)
    logger = _Capture()
    loom = Loom(
        accelerator="cpu", devices=world_size, strategy="ddp" if world_size > 1 else "auto", loggers=logger
    )
    loom.launch()
    net = _Net()
    model, optimizer = loom.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    batches = [torch.randn(128, 256) for _ in range(STEPS * ACCUMULATE)]
    breakdown = TimeBreakdown(loom, model, optimizer)
    with pytest.raises(MisuseError, match="already timed"):
        TimeBreakdown(loom, model, optimizer)
    for index, x in enumerate(breakdown.loader(batches)):
        last = index % ACCUMULATE == ACCUMULATE - 1
        with loom.no_backward_sync(model, enabled=not last):
            loom.backward(model(x))
        if last:
            optimizer.step()
            optimizer.zero_grad()
    summary = breakdown.close(print_table=False)
    removed = (
        "backward" not in vars(loom)
        and "backward" not in vars(loom.strategy)
        and "step" not in vars(optimizer)
    )
    hooks_left = len(model._forward_hooks) + len(model.forward_module._forward_hooks)
    files = []
    if rank == 0:
        files = [
            summary.write_html(f"{out_dir}/breakdown.html"),
            summary.write_png(f"{out_dir}/breakdown.png"),
        ]
    loom.close()
    return {
        "per_rank": summary.per_rank,
        "rows": logger.rows,
        "removed": removed,
        "hooks_left": hooks_left,
        "files": files,
        "table": summary.table(),
    }


def _check(results: list[dict], world_size: int) -> None:
    zero = results[0]
    per_rank = zero["per_rank"]
    assert len(per_rank) == world_size and all(len(steps) == STEPS for steps in per_rank)
    for other in results[1:]:
        assert other["per_rank"] == per_rank and other["rows"] == []  # gathered everywhere, logged on rank 0
    assert [step for step, _ in zero["rows"]] == list(range(1, STEPS + 1))  # step k at k, as the monitor
    assert set(zero["rows"][0][1]) == {f"time/{p}" for p in PARTS} | {"time/step"}
    assert zero["rows"][-1][1]["time/step"] == per_rank[0][-1]["step"]
    for steps in per_rank:
        # the parts measured (all but `other`, the user's code in between) make up a step within 5%. A part left
        # untimed would be in `other` in every step; a loaded machine descheduling the process between two calls
        # puts time there in some steps only (a median of 5 steps reached 6% under CI's load). So the least share
        # over the steps after the first (which pays for lazy initialisation) decides.
        unaccounted = min(s["other"] / s["step"] for s in steps[1:])
        assert unaccounted < 0.05, [s["other"] / s["step"] for s in steps]
        for s in steps:
            assert s["forward"] > 0 and s["backward"] > 0 and s["optimizer"] > 0 and s["data"] > 0
            assert sum(s[p] for p in PARTS) == pytest.approx(s["step"], rel=1e-9)
            if world_size == 1:
                assert s["communication"] == 0.0
    if world_size > 1:
        # the last micro-batch's backward waits for DDP's all-reduce after its last gradient
        assert any(s["communication"] > 0 for steps in per_rank for s in steps)
    assert all(r["removed"] and r["hooks_left"] == 0 for r in results)
    html, png = zero["files"]
    page = open(html).read()
    assert (
        page.count("<svg") == world_size
        and "<script" not in page
        and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    )
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "communication" in zero["table"]


def test_breakdown_on_one_process(tmp_path):
    _check([_breakdown_body(0, 1, str(tmp_path))], 1)


def test_breakdown_on_two_ranks(tmp_path):
    _check(run_ranks(_breakdown_body, 2, str(tmp_path), timeout=120), 2)
