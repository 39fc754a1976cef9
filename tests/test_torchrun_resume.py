"""Resume under plain ``torchrun``: the one checkpoint rank 0 writes resumes every rank exactly.

tests/frameworks/torchrun_resume.py runs twice with two ranks (gloo on 127.0.0.1): an
uninterrupted run and a run stopped mid-epoch whose rank 0 saves ``loader.state_dict()``,
then a new job in which both ranks load that file and go on.
"""

from __future__ import annotations

import json

import pytest

from tests.frameworks.launch import LAUNCH_TIMEOUT, torchrun

pytestmark = [pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30), pytest.mark.slow]


def test_rank_zeros_state_resumes_both_ranks_exactly(tmp_path):
    torchrun("torchrun_resume.py", ["first", str(tmp_path)])
    torchrun("torchrun_resume.py", ["rest", str(tmp_path)])
    runs = [{**json.loads((tmp_path / f"first.rank{r}.json").read_text()),
             **json.loads((tmp_path / f"rest.rank{r}.json").read_text())} for r in range(2)]
    for run in runs:
        assert len(run["full"]) == 12 and len(run["first"]) == 7
        assert run["first"] + run["rest"] == run["full"]
    halves = [sorted(i for batch in run["full"][:5] for i in batch) for run in runs]
    assert sorted(halves[0] + halves[1]) == list(range(40))  # the first epoch: disjoint halves
