"""The collective record and the desync report: when ranks stop agreeing, say which rank is at fault and where.

Every collective a rank enters through `Loom` is recorded (name, sequence number, tensor shapes and dtypes, and
the user's call site): a few attribute writes and set look-ups, always on. When a collective fails (it timed
out, or a peer died in it), the failing rank asks every rank, through the job's TCP store (which outlives a
wedged process group), for its last collective and its main thread's Python stack. A watchdog thread per rank
answers, so a rank stuck in user code or in another collective answers too. The first rank to ask prints one
report, `torchloom desync report`, ending in a `culprit:` line, which its exception repeats.

A rank can also die in a mismatched collective before it can answer (gloo aborts a rank that receives more bytes
than it expects). So the first time a rank takes a new path through its collectives (a call site after another
it never followed, or new shapes at a call site), it writes that record to the store before entering: rare
after the first step, and enough for the report to name the shapes a dead rank passed.

On NCCL a collective returns as soon as it is queued on the GPU, and the process group's own watchdog aborts the
process when one does not complete in time, before any Python exception could ask for a report. There the
record follows each collective with a CUDA event, and the rank's watchdog thread starts the report itself once a
collective has been pending for the job's timeout; the process group's timeout is set a little longer
(`NCCL_REPORT_GRACE`), so the report is out before NCCL aborts the rank.

The package's modules: `record` (the collective record, `RECORD`), `watchdog` (each rank's watchdog thread,
`start` and `stop`), `report` (the desync report and its culprit, `explain`) and `meeting` (`meet`, calls every
rank must make together, and `skipped_call`).
"""

from torchloom.diagnostics.meeting import PeersElsewhere, PeersLate, meet, skipped_call
from torchloom.diagnostics.record import RECORD, CollectiveRecord
from torchloom.diagnostics.report import explain
from torchloom.diagnostics.watchdog import NCCL_REPORT_GRACE, start, stop

__all__ = [
    "NCCL_REPORT_GRACE",
    "RECORD",
    "CollectiveRecord",
    "PeersElsewhere",
    "PeersLate",
    "explain",
    "meet",
    "skipped_call",
    "start",
    "stop",
]
