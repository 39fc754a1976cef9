"""Run torchdata's own tests of ``StatefulDataLoader`` against ``aioload.DataLoader``.

    python benchmarks/torchdata_suite.py PATH_TO_torchdata_CHECKOUT [pytest args...]

``PATH`` is a checkout of meta-pytorch/data (a directory holding
``test/stateful_dataloader/test_state_dict.py``). The file is run as it is, unmodified and
uncopied: this script imports it from the checkout with one substitution, the name
``StatefulDataLoader`` it imports from ``torchdata.stateful_dataloader`` bound to
``aioload.DataLoader``, which accepts ``snapshot_every_n_steps`` and needs it not: aioload
captures every worker's state with every batch, so every step is a snapshot. ``Stateful`` is
torchdata's own (the package is in the ``test`` extra), or an equivalent protocol without it.

It prints each test's outcome and, last, ``passed N/M``. The tests that fail by design are
listed in docs/migration.md ("torchdata's StatefulDataLoader"). The file also needs
``parameterized`` and ``expecttest`` (torch's test utilities import it).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

TEST_FILE = Path("test") / "stateful_dataloader" / "test_state_dict.py"


def _stateful_module() -> types.ModuleType:
    """A ``torchdata.stateful_dataloader`` whose ``StatefulDataLoader`` is aioload's."""
    import aioload

    try:
        from torchdata.stateful_dataloader import Stateful
    except ImportError:  # the same protocol: an object with state_dict and load_state_dict
        from typing import Protocol, runtime_checkable

        @runtime_checkable
        class Stateful(Protocol):  # type: ignore[no-redef]
            def state_dict(self) -> dict: ...

            def load_state_dict(self, state_dict: dict) -> None: ...

    module = types.ModuleType("torchdata.stateful_dataloader")
    module.Stateful = Stateful
    # aioload's loader under torchdata's name: it takes snapshot_every_n_steps (every batch
    # carries its workers' states, so the argument changes nothing)
    module.StatefulDataLoader = aioload.DataLoader
    return module


class _Tally:
    """A pytest plugin that counts tests (a test with failing subtests counts as failed once)."""

    def __init__(self):
        self.seen: dict[str, None] = {}
        self.failed: dict[str, None] = {}

    def pytest_runtest_logreport(self, report) -> None:
        self.seen.setdefault(report.nodeid)
        if report.failed:
            self.failed.setdefault(report.nodeid)

    @property
    def passed(self) -> list[str]:
        return [name for name in self.seen if name not in self.failed]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    checkout = Path(argv[0])
    test_file = checkout / TEST_FILE
    if not test_file.is_file():
        print(f"no {TEST_FILE} under {checkout}: pass the path of a checkout of meta-pytorch/data", file=sys.stderr)
        return 2
    import pytest

    sys.modules["torchdata.stateful_dataloader"] = _stateful_module()
    tally = _Tally()
    # The file's own directory as rootdir: no configuration of this project applies to it.
    args = [str(test_file), "-q", "-p", "no:cacheprovider", "--rootdir", str(test_file.parent),
            "-o", "addopts=", "-o", "filterwarnings=", *argv[1:]]
    pytest.main(args, plugins=[tally])
    total = len(tally.seen)
    for name in tally.failed:
        print(f"FAILED {name}")
    print(f"passed {len(tally.passed)}/{total}")
    return 0 if not tally.failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
