"""Every module aioload imports is installed by ``pip install -e .`` or guarded behind an extra.

The test extra installs far more than the package needs (trio brings sniffio, s3fs brings
fsspec), so an import of an undeclared module passes every other test and breaks the first
user who installed aioload alone. Two checks catch that: one reads every import under
``aioload/`` and looks its distribution up in ``pyproject.toml``; the other runs the README's
``async for`` example with every module that ``pip install -e .`` would not install hidden.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

OWN_FRAMEWORK = "aioload/integrations/"
"""``aioload/integrations/NAME.py`` imports the framework NAME: whoever imports the module uses it."""

WHOLE_MODULE_OPTIONAL = {"aioload/_engine/daskplugin.py": "dask"}
"""Modules imported only where their extra is in use (the Dask plugin: only by a loader given
Dask's executor), so they may import the extra's package at their top."""


def _name(requirement: str) -> str:
    return _normal(re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group())


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _required() -> set[str]:
    return {_name(r) for r in PROJECT["dependencies"]}


def _extras() -> dict[str, str]:
    """Each distribution an optional extra (not the test extra) names, and the extra."""
    return {_name(r): extra for extra, reqs in PROJECT["optional-dependencies"].items() if extra != "test"
            for r in reqs}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an import runs only on use: inside a function, or in a ``try`` that catches ImportError."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
        if isinstance(node, ast.Try) and child in node.body:
            caught = [h.type for h in node.handlers]
            names = {n.id for t in caught if t is not None
                     for n in ast.walk(t) if isinstance(n, ast.Name)}
            if names & {"ImportError", "ModuleNotFoundError", "Exception"} or None in caught:
                return True
    return False


def _imports():
    """(file, line, top-level module, guarded) for every absolute import under aioload/."""
    for path in sorted((ROOT / "aioload").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top != "aioload" and top != "__future__":
                    yield path.relative_to(ROOT).as_posix(), node.lineno, top, _guarded(node, parents)


@functools.cache
def _modules() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    return {_normal(d) for d in _modules().get(module, [])}


@pytest.mark.unit
def test_every_imported_module_is_a_declared_dependency_or_a_guarded_extra():
    required, extras = _required(), _extras()
    wrong = []
    for where, line, module, guarded in _imports():
        dists = _distributions(module)
        if dists & required:
            continue
        if where.startswith(OWN_FRAMEWORK) and Path(where).stem == module:
            continue
        extra = next((extras[d] for d in dists if d in extras), None)
        if extra is None:
            wrong.append(f"{where}:{line} imports {module} ({', '.join(sorted(dists)) or 'not installed'}), "
                         "which pyproject.toml declares neither in dependencies nor in an extra: declare it "
                         "(or stop importing it)")
        elif not guarded and WHOLE_MODULE_OPTIONAL.get(where) != extra:
            wrong.append(f"{where}:{line} imports {module} (the {extra!r} extra) at import time: import it "
                         f"where it is used, or in a try that turns ImportError into a message naming the extra")
    assert not wrong, "\n".join(wrong)


def _installed_by_dependencies() -> set[str]:
    """The distributions ``pip install -e .`` installs: the dependencies and theirs, no extras."""
    seen: set[str] = set()
    todo = sorted(_required())
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra" not in r.partition(";")[2]]
    return seen


HIDE = """
import runpy, sys
hidden = set(sys.argv[1].split(","))

class Hide:  # every finder finds nothing for a hidden module, as where it is not installed
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in hidden:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)

sys.meta_path[:] = [Hide(finder) for finder in sys.meta_path]
if sys.argv[2] == "-m":  # a module run as python -m runs it
    sys.argv = sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _not_installed_by_dependencies() -> list[str]:
    """The importable modules ``pip install -e .`` would not install (the test extra's, the
    optional extras'), to be hidden."""
    installed = _installed_by_dependencies()
    hidden = sorted(module for module, dists in _modules().items()
                    if module.isidentifier() and not {_normal(d) for d in dists} & installed
                    and module != "aioload")
    # the test extra's trio (and what it brings, sniffio) is hidden; torch and what it needs is not
    assert "trio" in hidden and ("sniffio" in hidden or not _distributions("sniffio")) and "torch" not in hidden
    return hidden


def _run_hidden(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", HIDE, ",".join(_not_installed_by_dependencies()), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_async_example_runs_with_only_the_declared_dependencies(tmp_path):
    done = _run_hidden(tmp_path, str(ROOT / "examples/train_async.py"), "--steps", "6", "--workers", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done: 6 steps in 1 epoch" in done.stdout


@pytest.mark.slow
def test_the_main_job_runs_with_only_the_declared_dependencies(tmp_path):
    # README's first command installs aioload alone (no extra: no torchcodec, no FFmpeg) and
    # runs aioload bench: its JPEGs must decode, with torchvision's decoder
    assert "torchcodec" in _not_installed_by_dependencies()
    done = _run_hidden(tmp_path, "-m", "aioload", "bench", "--images", "64", "--batch-size", "16", "--rounds", "1",
                       "--workers", "1", "--scenarios", "local")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "summary: aioload delivered" in done.stdout and "Traceback" not in done.stderr, done.stdout + done.stderr


def _readme_commands() -> tuple[str, str]:
    """README's first two commands: the main job's, the tests'."""
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, f"README.md must start with two commands, the main job's and the tests': {commands}"
    return commands[0], commands[1]


def _steps(command: str) -> list[str]:
    """A command's steps, ``pip`` spelled as ``python -m pip`` (as in .ci/run)."""
    steps = [step.strip() for step in command.split("&&")]
    return [re.sub(r"^pip ", "python -m pip ", step) for step in steps]


@pytest.mark.unit
def test_readmes_main_job_needs_no_root_no_ffmpeg_and_no_extra():
    main, _ = _readme_commands()
    steps = _steps(main)
    assert not any(s.startswith(("apt-get", "sudo")) for s in steps), steps
    assert "python -m pip install -e ." in steps and steps[-1] == "aioload bench", steps


@pytest.mark.unit
def test_ci_runs_readmes_test_command():
    _, tests = _readme_commands()
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert _steps(tests) == ci, (_steps(tests), ci)
