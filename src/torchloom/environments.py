"""Cluster environments: where a rank learns its place in the job (torchrun, SLURM, or a plain local run)."""

from __future__ import annotations

import os
import random
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

    def num_nodes(self) -> int | None:
        """Nodes in the job, where the environment says; None where it does not."""
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
        if all(value is None for value in previous.values()):
            _OWN_EXPORT.clear()
            _OWN_EXPORT.update(values)
        return previous

    def __repr__(self) -> str:
        return type(self).__name__


# The rank variables this process set itself, where nothing had set them before (a one-process DDP or FSDP
# run): a later Loom in the same process (a notebook cell) must not take them for a launcher's.
_OWN_EXPORT: dict[str, str] = {}


def _set_by_this_process() -> bool:
    return bool(_OWN_EXPORT) and all(os.environ.get(key) == value for key, value in _OWN_EXPORT.items())


def restore_environment(previous: dict[str, str | None]) -> None:
    """Undo `ClusterEnvironment.export`. A process that ran a one-process sharded job (a notebook, a test) must
    not look like a rank of a torchrun job to the next `Loom` it creates."""
    _OWN_EXPORT.clear()
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
        if _set_by_this_process():
            return False
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

    def num_nodes(self) -> int | None:
        # The agents of this attempt: an elastic job has as many as joined the rendezvous, known only now.
        if os.environ.get("GROUP_WORLD_SIZE"):
            return int(os.environ["GROUP_WORLD_SIZE"])
        local = self.local_world_size()
        if local and self.world_size() % local == 0:
            return self.world_size() // local
        return None


class SLURMEnvironment(ClusterEnvironment):
    """Started by `srun`: one task per rank, the tasks of one job step making one job.

    Detected inside an srun step (SLURM_STEP_ID) of more than one task, whatever the job's name: `srun python
    train.py` in an allocation named "bash" or "interactive" (salloc) starts tasks that must train together, not
    one job each writing the same checkpoints. Not detected where srun did not start this process (a batch script
    or an salloc shell running `python train.py`: there Loom starts its own processes, see `detect_environment`),
    nor in a step of one task (`srun --pty bash`, `srun -n1 python ...`), where Loom(devices=N) starts N."""

    @staticmethod
    def detect() -> bool:
        return (
            _slurm_step_id() is not None and _slurm_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=1) > 1
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
        # Every task of a step must agree without talking, and two steps of one job running at once (`srun ... &`
        # twice in a batch script) must not meet in one store: derive the port from the job and step ids.
        job_id = _slurm_int("SLURM_JOB_ID", default=0)
        return 10000 + (job_id * 101 + (_slurm_step_id() or 0)) % 20000

    def world_size(self) -> int:
        return _slurm_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=1)

    def global_rank(self) -> int:
        return int(os.environ["SLURM_PROCID"])

    def local_rank(self) -> int:
        return int(os.environ["SLURM_LOCALID"])

    def node_rank(self) -> int:
        return int(os.environ.get("SLURM_NODEID", 0))

    def local_world_size(self) -> int | None:
        # The step's tasks on this node: SLURM_STEP_TASKS_PER_NODE ("2(x3),1": per node of the step, in node
        # order). SLURM_NTASKS_PER_NODE is what the job asked for, which a step (`srun -n 2`) may not use.
        counts = _expand_slurm_counts(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
        node = self.node_rank()
        return counts[node] if node < len(counts) else None

    def num_nodes(self) -> int | None:
        counts = _expand_slurm_counts(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
        return _slurm_int("SLURM_STEP_NUM_NODES", default=len(counts) or None)


def _slurm_step_id() -> int | None:
    """The srun step this process is a task of; None outside one (a batch script, an salloc shell). The batch
    and extern steps (ids from 0xFFFFFFF0 up, or their names) are not srun's."""
    value = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID"))
    if value is None or not value.isdigit() or int(value) >= 0xFFFFFFF0:
        return None
    return int(value)


def _slurm_int(*names: str, default: int | None = None) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def _expand_slurm_counts(value: str) -> list[int]:
    """SLURM's per-node counts, "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, value.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def warn_if_srun_was_forgotten() -> None:
    """A batch script or salloc shell that runs `python train.py` where SLURM allocated several tasks: only srun
    starts them, so this process is alone (before, it waited for peers that never came)."""
    tasks = _slurm_int("SLURM_NTASKS", default=1)
    if _slurm_step_id() is None and tasks is not None and tasks > 1:
        from torchloom.errors import warn_user

        warn_user(
            f"SLURM allocated {tasks} tasks, but srun did not start this process (no SLURM_STEP_ID): torchloom runs "
            "it as a job of its own on this node, with the processes Loom(devices=...) asks for. To run one rank "
            "per SLURM task, start the script with `srun python train.py`."
        )


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

    @property
    def drew_port(self) -> bool:
        """Whether `main_port` is this environment's own draw (no MASTER_PORT set), which may be drawn again."""
        return "MASTER_PORT" not in os.environ and self._port is not None

    def draw_port_again(self) -> int:
        """A new `main_port`, where the one drawn was taken before the launcher's agent could bind it."""
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
    """A TCP port on `host` that was free a moment ago, for a job that binds it itself (the rendezvous store).

    Drawn at random below the kernel's ephemeral range: a port the kernel hands out for a bind to port 0 is
    handed out again to the next outgoing connection, and beside other jobs' gloo ranks (which open connections
    by the dozen) one of them took it before the agent bound it (EADDRINUSE: the launch failed before any rank
    started). Another process can still draw the same port in between; `launcher.on_a_free_port` retries then."""
    low = _ephemeral_low()
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every draw taken: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768, its default, elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list: the step's main address."""
    return expand_slurm_hostlist(nodelist)[0]


def expand_slurm_hostlist(hostlist: str) -> list[str]:
    """Every host of a SLURM host list, in SLURM's order (what `scontrol show hostnames` prints).

    The grammar: entries separated by commas outside brackets (`a[1-2],b3`); an entry is text with any number of
    bracket groups (`rack[1-2]-node[01-04]`: every combination, the last group varying fastest); a group holds
    numbers and ranges separated by commas (`[1,3,5-7]`), each range padded with zeros to the width of its lower
    bound as written (`[08-10]`: 08, 09, 10)."""
    hosts: list[str] = []
    for entry in _split_outside_brackets(hostlist):
        hosts += _expand_hostlist_entry(entry, hostlist)
    if not hosts:
        raise ConfigurationError(f"The SLURM host list {hostlist!r} names no host.")
    return hosts


def _split_outside_brackets(hostlist: str) -> list[str]:
    entries, depth, current = [], 0, ""
    for char in hostlist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ConfigurationError(
                f"The SLURM host list {hostlist!r} has {'nested' if depth > 1 else 'unmatched'} brackets: expected "
                "entries such as node[01-04] or rack[1-2]-node[1,3]."
            )
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ConfigurationError(f"The SLURM host list {hostlist!r} has an unclosed '['.")
    return [e.strip() for e in [*entries, current] if e.strip()]


def _expand_hostlist_entry(entry: str, hostlist: str) -> list[str]:
    hosts = [""]
    for part in re.split(r"(\[[^\]]*\])", entry):
        if part.startswith("["):
            choices = _expand_bracket(part[1:-1], hostlist)
        else:
            choices = [part]
        hosts = [host + choice for host in hosts for choice in choices]
    return hosts


def _expand_bracket(group: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for item in group.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if match is None or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ConfigurationError(
                f"The SLURM host list {hostlist!r} has {item!r} in brackets: expected numbers or increasing ranges "
                "separated by commas, such as [1,3,5-7] or [01-04]."
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def detect_environment(num_processes: int, num_nodes: int) -> ClusterEnvironment:
    """The environment this process runs in: torchrun first, then SLURM, else a local run."""
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect():
        return SLURMEnvironment()
    return LocalEnvironment(num_processes, num_nodes)
