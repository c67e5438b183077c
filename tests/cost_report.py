"""What the suite spends, per file and per test, from a run with TORCHLOOM_TEST_CPU=DIR (tests/conftest.py).

    TORCHLOOM_TEST_CPU=/tmp/costs make test && python tests/cost_report.py /tmp/costs

CPU seconds count every process a test started (ranks, launchers, jobs); `make test` is CPU-bound on 2 cores, so
they, not wall times under load, say which tests to make cheaper.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(folder: str, top: int = 30) -> None:
    tests: dict[str, dict[str, float]] = {}
    for part in Path(folder).glob("*.json"):
        tests.update(json.loads(part.read_text()))
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for nodeid, used in tests.items():
        files[nodeid.split("::")[0]][0] += used["cpu"]
        files[nodeid.split("::")[0]][1] += used["wall"]
    cpu = sum(used["cpu"] for used in tests.values())
    print(f"{len(files)} files, {len(tests)} tests, {cpu:.0f} CPU-s in all")
    print("costliest files (CPU-s, wall s):")
    for name, (c, w) in sorted(files.items(), key=lambda x: -x[1][0])[:top]:
        print(f"{c:8.1f} {w:8.1f}  {name}")
    print("costliest tests (CPU-s, wall s):")
    for nodeid, used in sorted(tests.items(), key=lambda x: -x[1]["cpu"])[:top]:
        print(f"{used['cpu']:8.1f} {used['wall']:8.1f}  {nodeid}")


if __name__ == "__main__":
    main(sys.argv[1])
