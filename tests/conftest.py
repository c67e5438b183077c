import os
import sys
from pathlib import Path

import pytest

# Ranks share 2 cores; keep intra-op threads from oversubscribing them (also inherited by spawned ranks).
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))


def _cuda_devices() -> int:
    """How many GPUs this process sees (0 without CUDA). Asking creates no CUDA context: the ranks that the
    tests start are spawned, never forked, so they may use CUDA whatever the test process did."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_cuda_tests(items)


def _skip_cuda_tests(items: list[pytest.Item]) -> None:
    """Skip the tests marked `cuda` (or `cuda(min_devices=N)`) that this machine cannot run, saying why."""
    marked = [(item, item.get_closest_marker("cuda")) for item in items]
    marked = [(item, marker) for item, marker in marked if marker is not None]
    if not marked:
        return
    import torch

    have = _cuda_devices()
    for item, marker in marked:
        need = int(marker.kwargs.get("min_devices", 1))
        if have == 0:
            reason = f"needs CUDA: torch.cuda.is_available() is False (torch {torch.__version__})"
        elif have < need:
            reason = f"needs {need} GPUs, this machine has {have}"
        else:
            continue
        item.add_marker(pytest.mark.skip(reason=reason))


# The model classes the Hugging Face tests' rank bodies use: their modules take seconds to import in each rank.
_HF_MODULES = ("transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the collected tests import transformers, the fork server that starts `run_ranks`'s ranks imports
    its model modules once (it starts at the first `run_ranks`, after collection)."""
    if "transformers" in sys.modules:
        from torchloom import testing

        testing.preload(*_HF_MODULES)


_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _launch_env() -> list[str]:
    """The variables that tell `Loom()` it is a rank of a launch (`torchloom run`'s options, the agent's marks)."""
    from torchloom import _run_protocol, launcher

    return [
        _run_protocol.RUN_ENV,
        _run_protocol.AFTER_SCRIPT_ENV,
        *_run_protocol.CLI_ENV.values(),
        launcher.LAUNCHED_ENV,
        launcher.AGENT_PID_ENV,
    ]


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test():
    """A test that runs a one-process sharded Loom in the test process (and does not close it) must not leave
    its process group or its exported rank variables to the next test, which would see a torchrun job."""
    before = {key: os.environ.get(key) for key in _GROUP_ENV}
    ours = {key: os.environ[key] for key in _launch_env() if key in os.environ}
    yield
    now = {key: os.environ[key] for key in _launch_env() if key in os.environ}
    if now != ours:
        # `torchloom run` (or a launcher) called in the test process publishes its options here, and every later
        # test in this worker then looked like a rank of that command (seen: 62 tests failed after one).
        for key in now:
            os.environ.pop(key)
        os.environ.update(ours)
        changed = sorted(k for k in {*now, *ours} if now.get(k) != ours.get(k))
        pytest.fail(
            f"the test left torchloom's launch variables changed ({changed}): restore them (monkeypatch)"
        )
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# TORCHLOOM_TEST_CPU=DIR: each pytest process writes DIR/<worker>.json, the CPU and wall seconds each test used
# with every process it started (ranks, launchers, the fork server's ranks); tests/cost_report.py sums them. The suite is CPU-bound on 2 cores, so
# this, not wall time under load, says which tests to make cheaper (docs/testing.md).
_CPU_DIR = os.environ.get("TORCHLOOM_TEST_CPU")
_cpu_used: dict[str, dict[str, float]] = {}


def _cpu_seconds() -> float:
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    # Live children (the fork server) hold the CPU of the ranks they reaped in their own counters.
    tick = os.sysconf("SC_CLK_TCK")
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            total += sum(int(f) for f in fields[11:15]) / tick
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not _CPU_DIR:
        yield
        return
    import time

    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    used = _cpu_used.setdefault(item.nodeid, {"cpu": 0.0, "wall": 0.0})
    used["cpu"] += _cpu_seconds() - cpu
    used["wall"] += time.monotonic() - wall


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _CPU_DIR and _cpu_used:
        import json

        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(_CPU_DIR).mkdir(parents=True, exist_ok=True)
        (Path(_CPU_DIR) / f"{worker}.json").write_text(json.dumps(_cpu_used, indent=0))
