"""Accelerators: which hardware a rank runs on, and how `devices=` maps onto it."""

from __future__ import annotations

import torch

from torchloom.errors import ConfigurationError

ACCELERATORS = ("auto", "cpu", "cuda", "mps")


class Accelerator:
    """One kind of hardware. `parse_devices` turns the user's `devices=` into the per-node device list."""

    name: str = ""
    #: The process-group backend that this hardware talks over.
    backend: str = "gloo"

    @staticmethod
    def is_available() -> bool:
        raise NotImplementedError

    def device_count(self) -> int:
        raise NotImplementedError

    def parse_devices(self, devices: int | str | list[int]) -> list[torch.device]:
        raise NotImplementedError

    def setup_device(self, device: torch.device) -> None:
        """Make `device` the current one for this process (a no-op on CPU)."""


class CPUAccelerator(Accelerator):
    name = "cpu"
    backend = "gloo"

    @staticmethod
    def is_available() -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def parse_devices(self, devices: int | str | list[int]) -> list[torch.device]:
        # On CPU, `devices=N` means N processes, all on the one CPU device. More processes than cores is allowed:
        # it is slow, not wrong, and tests rely on it.
        if devices == "auto":
            n = 1
        elif isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
            n = devices
        elif isinstance(devices, str) and devices.isdigit() and int(devices) >= 1:
            n = int(devices)
        else:
            raise ConfigurationError(
                f"devices={devices!r} is not valid on CPU. On CPU, devices is the number of processes: "
                "pass a positive int (e.g. devices=2) or 'auto' (one process)."
            )
        return [torch.device("cpu")] * n


class CUDAAccelerator(Accelerator):
    name = "cuda"
    backend = "nccl"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def parse_devices(self, devices: int | str | list[int]) -> list[torch.device]:
        count = self.device_count()
        if devices == "auto" or devices == -1 or devices == "-1":
            indices = list(range(count))
        elif isinstance(devices, str) and devices.isdigit():
            indices = list(range(int(devices)))
        elif isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
            indices = list(range(devices))
        elif isinstance(devices, (list, tuple)) and devices and all(isinstance(i, int) for i in devices):
            indices = list(devices)
        else:
            raise ConfigurationError(
                f"devices={devices!r} is not valid for CUDA: pass a positive int, a list of GPU indices, "
                "-1 or 'auto' (all visible GPUs)."
            )
        if len(set(indices)) != len(indices):
            raise ConfigurationError(f"devices={devices!r} names a GPU twice; list each GPU index once.")
        missing = [i for i in indices if not 0 <= i < count]
        if not indices or missing:
            raise ConfigurationError(
                f"devices={devices!r} asks for GPU(s) {missing or indices} but this machine has {count} visible "
                f"GPU(s) (indices 0..{count - 1}). Ask for at most {count}, or check CUDA_VISIBLE_DEVICES."
            )
        return [torch.device("cuda", i) for i in indices]

    def setup_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)


class MPSAccelerator(Accelerator):
    name = "mps"
    backend = "gloo"

    @staticmethod
    def is_available() -> bool:
        return torch.backends.mps.is_available()

    def device_count(self) -> int:
        return 1

    def parse_devices(self, devices: int | str | list[int]) -> list[torch.device]:
        if devices in ("auto", 1, "1", [0]):
            return [torch.device("mps", 0)]
        raise ConfigurationError(
            f"devices={devices!r} is not valid for MPS: there is one MPS device, pass devices=1."
        )


_REGISTRY: dict[str, type[Accelerator]] = {
    "cpu": CPUAccelerator,
    "cuda": CUDAAccelerator,
    "mps": MPSAccelerator,
}


def select_accelerator(name: str | Accelerator) -> Accelerator:
    """Turn `accelerator=` into an instance; "auto" prefers CUDA, then MPS, then CPU; "gpu" is CUDA, else MPS."""
    if isinstance(name, Accelerator):
        return name
    given = name  # messages echo what the user wrote ('gpu', not the 'cuda' it stands for)
    if isinstance(name, str) and name.lower() == "gpu":
        # Lightning Fabric's "gpu": CUDA, or Apple's MPS where there is no CUDA.
        name = "mps" if not _REGISTRY["cuda"].is_available() and _REGISTRY["mps"].is_available() else "cuda"
    if not isinstance(name, str) or name.lower() not in ACCELERATORS:
        raise ConfigurationError(
            f"Unknown accelerator {name!r}. Valid accelerators: {', '.join(repr(a) for a in ACCELERATORS)}."
        )
    name = name.lower()
    if name == "auto":
        for candidate in ("cuda", "mps"):
            if _REGISTRY[candidate].is_available():
                return _REGISTRY[candidate]()
        return CPUAccelerator()
    cls = _REGISTRY[name]
    if not cls.is_available():
        raise ConfigurationError(
            f"accelerator={given!r}{' (CUDA, or MPS on a Mac)' if given != name else ''} was requested but is not available on this machine "
            f"(torch {torch.__version__}). Use accelerator='cpu' or 'auto'."
        )
    return cls()
