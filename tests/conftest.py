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


# `make test` runs the suite on 3 pytest-xdist workers (`-n 3 --dist loadgroup --no-loadscope-reorder`): most of
# its time is waiting (process start-up, rendezvous, the timeouts tests provoke), not computing. A file is one unit
# of work, so its module-scoped fixtures (rank groups shared by its tests) start once per run; a test marked
# `own_processes` starts its own processes and shares nothing, so it is a unit of its own that any worker may take.
#
# The longest files start first (measured 2026-12-02: 190 s down to 30 s each under 3 workers), then the tests of
# their own (5-40 s each), then the rest (under 30 s each), so that no long unit starts last while the other
# workers idle.
_LONGEST_FIRST = (
    "test_example_lm.py",
    "test_soak.py",
    "test_atomic.py",
    "test_misuse.py",
    "test_data.py",
    "test_fsdp_options.py",
    "test_fabric_compat.py",
    "test_resharding.py",
    "test_model_parallel_checkpoints.py",
    "test_scenarios.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the `xdist_group` marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _schedule_for_xdist(items)
    _skip_cuda_tests(items)


def _schedule_for_xdist(items: list[pytest.Item]) -> None:
    """Under a pytest-xdist worker: one `xdist_group` per file for the tests not marked `own_processes`, and the
    order in which the workers take the units (every worker collects the same order). A serial run is left as
    it is."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def alone(item: pytest.Item) -> bool:
        return item.get_closest_marker("own_processes") is not None

    for item in items:
        if not alone(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        if name in _LONGEST_FIRST and not alone(item):
            return _LONGEST_FIRST.index(name)
        return len(_LONGEST_FIRST) + (0 if alone(item) else 1)

    items.sort(key=rank)  # stable: the tests of a file keep their order


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


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test():
    """A test that runs a one-process sharded Loom in the test process (and does not close it) must not leave
    its process group or its exported rank variables to the next test, which would see a torchrun job."""
    before = {key: os.environ.get(key) for key in _GROUP_ENV}
    yield
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
