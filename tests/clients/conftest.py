"""tests/clients run real programs built on Lightning Fabric (litgpt) through torchloom's Fabric switch. They are
heavy (minutes) and need the `clients` extra, so `make test` leaves them out: they run under `-m clients`
(`make clients`, which .ci/run also runs)."""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "clients" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(
        reason="a client program's test: run with `make clients` (pytest -m clients tests/clients)"
    )
    for item in items:
        if item.get_closest_marker("clients") is not None:
            item.add_marker(skip)
