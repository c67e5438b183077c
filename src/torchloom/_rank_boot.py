"""The first code a rank started by torchloom's launcher runs: arrange to die with the launcher, then become
the rank's real command (same process, same pid).

A rank used to ask for this only when it reached `loom.launch()`, seconds after it started (importing torch
alone takes a second or more), so a launcher killed with SIGKILL in that window left its ranks running. Run as
`python -S _rank_boot.py COMMAND...` with TORCHLOOM_AGENT_PID set: it imports nothing of torch or torchloom,
so it costs one bare interpreter start (about 15 ms). The parent-death signal survives `exec`.
"""

import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main() -> None:
    command = sys.argv[1:]
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        agent = os.environ.get("TORCHLOOM_AGENT_PID")
        if agent and os.getppid() != int(agent):
            # The launcher died before the request above took effect: nobody will watch this rank.
            os._exit(1)
    if os.environ.get("TORCHLOOM_FABRIC_COMPAT") and "-c" in command[:-1]:
        # A spawned rank (`python [flags] -c CODE`) of a program under torchloom's Fabric switch: switch before
        # multiprocessing imports the program's main module, which binds Lightning's names (lightning_compat).
        at = command.index("-c") + 1
        install = "import torchloom.lightning_compat as _c; _c.install_from_environment(); del _c\n"
        command = [*command[:at], install + command[at], *command[at + 1 :]]
    os.execv(sys.executable, [sys.executable, *command])


if __name__ == "__main__":
    main()
