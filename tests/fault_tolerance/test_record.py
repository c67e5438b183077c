"""The record's proof that no step averaged partial gradients, and the replay's per-step checks, on records
written in one process by a simulated run (each group's gradient computed, summed and averaged as the groups do),
including runs that were wrong on purpose: a partial average, a group counted with zeros, a wrong batch. And
`torchloom replay` as a user runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchloom.cli import main
from torchloom.errors import TorchloomError
from torchloom.fault_tolerance import read_record, record, replay

_SPEC = """
import torch
from torch import nn

torch.manual_seed(0)
DATA = torch.randn(64, 4), torch.randn(64, 1)


def model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def batch(group, epoch, index):
    rows = [(index * 2 + group) * 4 + i for i in range(4)]
    return DATA[0][rows], DATA[1][rows]


def loss(model, xy):
    return nn.functional.mse_loss(model(xy[0]), xy[1])
"""


# The optional parts of a spec: the script clipped between loom.backward and optimizer.step(), and stepped a
# scheduler after each step.
_AROUND_THE_STEP = """

def before_step(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
"""


def _spec(tmp_path: Path, around: bool = False) -> dict:
    path = tmp_path / "spec.py"
    path.write_text(_SPEC + (_AROUND_THE_STEP if around else ""))
    import runpy

    return runpy.run_path(str(path))


def _simulate(
    path: Path,
    spec: dict,
    *,
    steps: int = 4,
    zeros: tuple[int, int] | None = None,
    partial_at: int | None = None,
) -> dict[str, torch.Tensor]:
    """A run of 2 groups written to the record at `path`: group g's gradient on its batch, the sums of the
    groups' slots, the average applied. `zeros`: (step, group) that sends zeros while counted; `partial_at`: a
    step whose applied average misses group 1's gradient."""
    net, groups, chain = spec["model"](), 2, ""
    opt = spec["optimizer"](net)
    sched = spec["scheduler"](opt) if "scheduler" in spec else None
    params = list(net.parameters())
    for step in range(steps):
        sent, sums = [], torch.zeros(record.SLOTS * groups, dtype=torch.float64)
        for group in range(groups):
            opt.zero_grad()
            spec["loss"](net, spec["batch"](group, 0, step)).backward()
            flats = record.flats([p.grad for p in params])
            if zeros == (step, group):
                flats = [torch.zeros_like(f) for f in flats]
            sums += record.sources(groups, group, 0, step, flats)
            sent.append(flats)
        used = sent[:1] if step == partial_at else sent
        mean = [sum(parts) / groups for parts in zip(*used, strict=True)]
        offset = 0
        for p in params:
            p.grad = mean[0][offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        if "before_step" in spec:
            spec["before_step"](net)
        opt.step()
        if sched is not None:
            sched.step()
        chain = record.append(str(path), step, sums, groups, chain, record.fingerprint(mean)[0])
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _replay(path: Path, spec: dict, batch=None) -> nn.Module:
    net = spec["model"]()
    replay(path, net, spec["optimizer"](net), batch or spec["batch"], spec["loss"])
    return net


def test_a_whole_run_replays_exactly_and_no_step_is_partial(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    run = _simulate(tmp_path / "r.jsonl", spec)
    assert record.partial_steps(read_record(tmp_path / "r.jsonl")) == []
    for key, value in _replay(tmp_path / "r.jsonl", spec).state_dict().items():
        torch.testing.assert_close(value, run[key], rtol=0, atol=1e-6)


def test_a_partial_average_is_found_in_the_record(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    _simulate(tmp_path / "r.jsonl", spec, partial_at=2)
    assert record.partial_steps(read_record(tmp_path / "r.jsonl")) == [2]
    with pytest.raises(TorchloomError, match=r"not the whole average .*\[2\]"):
        _replay(tmp_path / "r.jsonl", spec)


def test_a_group_counted_with_a_gradient_it_did_not_compute_is_found_by_the_replay(tmp_path: Path) -> None:
    """Zeros sent while counted: the sums agree with themselves (so `partial_steps` cannot see it), but the
    gradient recomputed on that group's batch does not match what it sent."""
    spec = _spec(tmp_path)
    _simulate(tmp_path / "r.jsonl", spec, zeros=(1, 1))
    assert record.partial_steps(read_record(tmp_path / "r.jsonl")) == []
    with pytest.raises(TorchloomError, match="at step 1, group 1's gradient on its batch 1"):
        _replay(tmp_path / "r.jsonl", spec)


def test_a_wrong_batch_function_is_named_at_the_first_step(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    _simulate(tmp_path / "r.jsonl", spec)
    shifted = lambda group, epoch, index: spec["batch"](group, epoch, index + 1)  # noqa: E731
    with pytest.raises(TorchloomError, match="at step 0, group 0's gradient"):
        _replay(tmp_path / "r.jsonl", spec, shifted)


@pytest.mark.parametrize("around", [False, True], ids=["plain", "clipped_and_scheduled"])
def test_torchloom_replay_compares_with_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], around: bool
) -> None:
    """`around`: the spec also defines `before_step` (clipping) and `scheduler`; a replay without them would
    differ from the run (checked below)."""
    spec = _spec(tmp_path, around)
    run = _simulate(tmp_path / "r.jsonl", spec)
    torch.save(run, tmp_path / "run.pt")
    args = [
        "replay",
        str(tmp_path / "r.jsonl"),
        str(tmp_path / "spec.py"),
        "--compare",
        str(tmp_path / "run.pt"),
    ]
    assert main([*args, "--out", str(tmp_path / "replayed.pt")]) == 0
    out = capsys.readouterr().out
    assert "replayed 4 committed steps" in out and "equal within 1e-05" in out
    torch.testing.assert_close(
        torch.load(tmp_path / "replayed.pt")["0.weight"], run["0.weight"], atol=1e-6, rtol=0
    )
    if around:  # the same record replayed without them: its check stops at the first step that differs
        (tmp_path / "spec.py").write_text(_SPEC)
        assert main(args) == 2
        assert "is not the gradient it sent" in capsys.readouterr().err
        (tmp_path / "spec.py").write_text(_SPEC + _AROUND_THE_STEP)
    run["0.weight"] += 1e-3
    torch.save(run, tmp_path / "run.pt")
    assert main(args) == 1
    assert "DIFFERENT beyond 1e-05" in capsys.readouterr().out


def test_torchloom_replay_names_what_the_spec_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "spec.py").write_text("def model():\n    pass\n")
    (tmp_path / "r.jsonl").write_text("")
    assert main(["replay", str(tmp_path / "r.jsonl"), str(tmp_path / "spec.py")]) == 2
    assert "does not define optimizer, batch, loss" in capsys.readouterr().err


def test_the_fingerprint_of_the_per_parameter_gradients_is_that_of_their_flats() -> None:
    """The groups take the fingerprint part by part (each chunk before its sum overwrites it), the replay of the
    per-parameter gradients, the record's checks of one flat tensor per dtype: the same number."""
    torch.manual_seed(0)
    shapes = [(3, 7), (5000,), (700, 30), (13,), (1,)]
    grads = [torch.randn(s) for s in shapes] + [torch.randn(100, dtype=torch.float64)]
    flat = record.fingerprint(record.flats(grads))
    assert record.fingerprint(grads) == pytest.approx(flat, rel=1e-12)
    # Part by part, in any order of the parts (the chunks run in reverse parameter order).
    terms = [record.fingerprint_part(g, probe) for g, probe in zip(grads, record.probes(grads), strict=True)]
    value = sum(float(t[0]) for t in reversed(terms))
    scale = sum(float(t[1]) for t in reversed(terms))
    assert (value, scale) == pytest.approx(flat, rel=1e-12)


def test_a_job_that_started_over_replays_the_history_it_holds(tmp_path: Path) -> None:
    """Every group lost without a checkpoint: the job starts over from step 0 and appends a second history to the
    same record, shorter than the first. The replay follows the history written last (the state the job ends
    with), not the longest; a history's dead end written before its later steps (a group that committed a step
    its peers then retried without it) is passed over."""
    spec = _spec(tmp_path)
    path = tmp_path / "r.jsonl"
    _simulate(path, spec, steps=4)  # the history lost with every group
    net = spec["model"]()
    opt = spec["optimizer"](net)
    params, chain = list(net.parameters()), ""
    for step in range(2):  # the job started over: group 0 alone for 2 steps
        opt.zero_grad()
        spec["loss"](net, spec["batch"](0, 0, step)).backward()
        flats = record.flats([p.grad for p in params])
        opt.step()
        chain = record.append(
            str(path), step, record.sources(2, 0, 0, step, flats), 2, chain, record.fingerprint(flats)[0]
        )
    steps = read_record(path)
    assert [(s.step, [p.group for p in s.participants]) for s in steps] == [(0, [0]), (1, [0])]
    for key, value in _replay(path, spec).state_dict().items():
        torch.testing.assert_close(value, net.state_dict()[key], rtol=0, atol=1e-6)


def test_a_line_being_written_is_not_read_until_its_newline(tmp_path: Path) -> None:
    """A record read during the run (`torchloom replay` beside a live job) can end in part of a line another
    group is writing: that step is left out until the line is whole, instead of failing the read."""
    spec = _spec(tmp_path)
    path = tmp_path / "r.jsonl"
    _simulate(path, spec, steps=3)
    whole = path.read_text()
    last = whole[:-1].rfind("\n") + 1
    path.write_text(whole[: last + 40])  # the third step's line, cut
    assert [s.step for s in read_record(path)] == [0, 1]
    path.write_text(whole)
    assert [s.step for s in read_record(path)] == [0, 1, 2]


def test_the_weights_fingerprint_tells_parted_weights_apart() -> None:
    """The number each group sends for the weights its gradient was computed on (`replica._weights_agree`
    compares them): equal bit for bit for equal weights, different after any change to an element it reads (one
    step of an optimizer, or 1e-6 on one element of a small model, which it reads whole), and carried in the
    group's own slot of the sums."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.LayerNorm(1))
    twin = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.LayerNorm(1))
    twin.load_state_dict(net.state_dict())
    params, twins = list(net.parameters()), list(twin.parameters())
    value = record.weights_fingerprint(params)
    assert value == record.weights_fingerprint(twins)
    assert value == record.weights_fingerprint(params)  # the kept layout gives the same
    for k, p in enumerate(twins):
        for index in (0, p.numel() - 1):
            kept = p.view(-1)[index].item()
            with torch.no_grad():
                p.view(-1)[index] += 1e-6
            assert record.weights_fingerprint(twins) != value, (k, index)
            with torch.no_grad():
                p.view(-1)[index] = kept
            assert record.weights_fingerprint(twins) == value
    # A layout of the same sizes in another order reads other elements with other weights.
    assert record.weights_fingerprint(params[::-1]) != value
    # Larger than the probes (8,000 elements: every second one read, in every parameter): a change to an element
    # read shows, one between the probes does not (the limit the docs state).
    big = [torch.randn(3000), torch.randn(5000)]
    before = record.weights_fingerprint(big)
    with torch.no_grad():
        big[1][-1] += 1.0  # element 7,999 of the layout
    assert record.weights_fingerprint(big) == before
    with torch.no_grad():
        big[1][-2] += 1.0  # element 7,998
    assert record.weights_fingerprint(big) != before
    sums = sum(record.sources(3, g, 0, 5, params, weights=w) for g, w in ((1, value), (2, -2.5)))
    assert record.weights_of(sums, 3) == [0.0, value, -2.5]
