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


def pytest_configure(config: pytest.Config) -> None:
    # xdist's `--dist loadfile` hands out the files with the most tests first by default, which leaves the files
    # of a few long tests (the soak, the docs' scripts, the benchmarks) to the end, where one worker runs them
    # while the others are done. `_heaviest_files_first` orders the files by their cost instead.
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_cuda_tests(items)
    if hasattr(config, "workerinput"):  # an xdist worker: the controller hands out the files in this order
        _heaviest_files_first(items)


# Seconds each file took in a full `make test` (3 workers on 2 cores, load ~10; `--durations=0`), for the files
# whose tests start jobs of their own. A file not named here is estimated at _SECONDS_PER_TEST a test. Only the
# order of the files follows from these numbers: a stale one costs balance, never a result.
_FILE_SECONDS = {
    "tests/test_elastic.py": 435,
    "tests/planning/test_plan.py": 268,
    "tests/test_benchmarks.py": 253,
    "tests/test_example_lm.py": 240,
    "tests/test_scenarios.py": 200,
    "tests/test_docs.py": 141,
    "tests/checkpointing/test_soak.py": 116,
    "tests/test_launcher.py": 113,
    "tests/checkpointing/test_atomic.py": 112,
    "tests/test_fabric_checklist.py": 111,
    "tests/test_run.py": 95,
    "tests/test_example.py": 72,
    "tests/test_exit.py": 69,
    "tests/test_desync.py": 53,
    "tests/strategies/test_model_parallel.py": 51,
    "tests/test_lightning_compat.py": 37,
    "tests/checkpointing/test_resharding.py": 30,
    "tests/strategies/test_model_parallel_checkpoints.py": 28,
    "tests/test_reliability.py": 25,
    "tests/test_compile.py": 22,
}
_SECONDS_PER_TEST = 1.5


def _heaviest_files_first(items: list[pytest.Item]) -> None:
    """Reorder `items` (stably) so that the files run longest first: the last files handed out are short ones."""
    root = Path(__file__).parent.parent
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(Path(os.path.relpath(item.path, root)).as_posix(), []).append(item)

    def cost(name: str) -> float:
        return _FILE_SECONDS.get(name, _SECONDS_PER_TEST * len(by_file[name]))

    items[:] = [item for name in sorted(by_file, key=cost, reverse=True) for item in by_file[name]]


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
