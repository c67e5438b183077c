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
