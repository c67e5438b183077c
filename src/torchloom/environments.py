"""Cluster environments: where a rank learns its place in the job (torchrun, SLURM, or a plain local run)."""

from __future__ import annotations

import os
import re
import socket

from torchloom.errors import ConfigurationError


class ClusterEnvironment:
    """Where ranks and the rendezvous address come from."""

    #: True when something outside torchloom (torchrun, srun) already started one process per rank.
    creates_processes_externally: bool = True

    @staticmethod
    def detect() -> bool:
        raise NotImplementedError

    @property
    def main_address(self) -> str:
        raise NotImplementedError

    @property
    def main_port(self) -> int:
        raise NotImplementedError

    def world_size(self) -> int:
        raise NotImplementedError

    def global_rank(self) -> int:
        raise NotImplementedError

    def local_rank(self) -> int:
        raise NotImplementedError

    def node_rank(self) -> int:
        raise NotImplementedError

    def local_world_size(self) -> int | None:
        """Processes on this node, where the environment says; None where it does not."""
        return None

    def export(self) -> dict[str, str | None]:
        """Write MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK so `init_process_group(init_method="env://")`
        works. Returns what they were before, for `restore_environment`."""
        values = {
            "MASTER_ADDR": self.main_address,
            "MASTER_PORT": str(self.main_port),
            "RANK": str(self.global_rank()),
            "WORLD_SIZE": str(self.world_size()),
            "LOCAL_RANK": str(self.local_rank()),
        }
        previous = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        return previous

    def __repr__(self) -> str:
        return type(self).__name__


def restore_environment(previous: dict[str, str | None]) -> None:
    """Undo `ClusterEnvironment.export`. A process that ran a one-process sharded job (a notebook, a test) must
    not look like a rank of a torchrun job to the next `Loom` it creates."""
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class TorchElasticEnvironment(ClusterEnvironment):
    """Started by `torchrun` / `torch.distributed.run` (including `torchloom run` and our own re-launch)."""

    @staticmethod
    def detect() -> bool:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            return True
        return all(
            k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        )

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    def global_rank(self) -> int:
        return int(os.environ["RANK"])

    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))

    def local_world_size(self) -> int | None:
        value = os.environ.get("LOCAL_WORLD_SIZE")
        return int(value) if value else None


class SLURMEnvironment(ClusterEnvironment):
    """Started by `srun`: one task per rank. An interactive allocation (`salloc` + bash) is not detected."""

    @staticmethod
    def detect() -> bool:
        return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in (
            "bash",
            "interactive",
        )

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_NODELIST") or "127.0.0.1"
        return _first_slurm_host(nodelist)

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        # Every task of a job must agree without talking: derive the port from the job id.
        job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
        return 10000 + job_id % 20000

    def world_size(self) -> int:
        return int(os.environ["SLURM_NTASKS"])

    def global_rank(self) -> int:
        return int(os.environ["SLURM_PROCID"])

    def local_rank(self) -> int:
        return int(os.environ["SLURM_LOCALID"])

    def node_rank(self) -> int:
        return int(os.environ.get("SLURM_NODEID", 0))

    def local_world_size(self) -> int | None:
        value = os.environ.get("SLURM_NTASKS_PER_NODE")
        return int(value.split("(")[0]) if value else None


class LocalEnvironment(ClusterEnvironment):
    """A plain `python train.py`: torchloom starts the local processes itself (see `torchloom.launcher`).

    For several nodes without torchrun or SLURM, set NODE_RANK, MASTER_ADDR and MASTER_PORT on every node.
    """

    creates_processes_externally = False

    def __init__(self, num_processes: int = 1, num_nodes: int = 1) -> None:
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self._port: int | None = None

    @staticmethod
    def detect() -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        if self.num_nodes > 1:
            raise ConfigurationError(
                "num_nodes > 1 without torchrun or SLURM needs MASTER_ADDR, MASTER_PORT and NODE_RANK set on every "
                "node (or use `torchloom run --num-nodes N --node-rank R --main-address HOST --main-port PORT`)."
            )
        if self._port is None:
            self._port = find_free_port()
        return self._port

    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    def global_rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", 0))

    def local_world_size(self) -> int | None:
        return self.num_processes


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now. Another process can still take it before we bind; callers retry."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _first_slurm_host(nodelist: str) -> str:
    # "node[03-05,07],gpu1" -> "node03"
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    match = re.match(r"^(.*?)\[(\d+)[^\]]*\](.*)$", first)
    if match:
        return f"{match.group(1)}{match.group(2)}{match.group(3)}"
    return first


def detect_environment(num_processes: int, num_nodes: int) -> ClusterEnvironment:
    """The environment this process runs in: torchrun first, then SLURM, else a local run."""
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect():
        return SLURMEnvironment()
    return LocalEnvironment(num_processes, num_nodes)
