"""The public surface type-checks: mypy over the files named in pyproject.toml's [tool.mypy]."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_public_surface_type_checks(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=580,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout
