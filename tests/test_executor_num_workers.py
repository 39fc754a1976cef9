"""With executor=, num_workers counts batches in flight, not processes on this machine: torch's
warning about more worker processes than CPUs does not apply."""

from __future__ import annotations

import concurrent.futures
import os
import warnings

import aioload
from tests.executor_data import Augmented


def test_more_batches_in_flight_than_cpus_is_not_a_worker_count_warning():
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(2) as pool, warnings.catch_warnings():
        warnings.simplefilter("error")
        with aioload.DataLoader(Augmented(24), batch_size=4, num_workers=cpus + 2, executor=pool) as loader:
            batches = list(loader)
    assert [b[1].tolist() for b in batches] == [list(range(i, i + 4)) for i in range(0, 24, 4)]
