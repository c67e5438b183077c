"""Fault tolerance without restart, through torchft (the `ft` extra): `torchloom run --replica-groups N` splits
the job into replica groups; a group that dies is restarted and heals from a live peer while the others keep
stepping (see docs/fault_tolerance.md).

Exports: `current()` (this process's `ReplicaGroup`, None outside replica groups), `read_record` and `replay`
(the job's record of committed steps, and its one-process replay: the oracle of a run)."""

from torchloom.fault_tolerance.record import Participant, Step
from torchloom.fault_tolerance.record import read as read_record
from torchloom.fault_tolerance.replay import replay
from torchloom.fault_tolerance.replica import ReplicaGroup, current

__all__ = ["Participant", "ReplicaGroup", "Step", "current", "read_record", "replay"]
