"""``aioload bench`` (both scenarios, the plot, the HTTP server's lifetime), its help, and
``aioload make-data`` / ``aioload.make_data``.

The bench runs for real on a few images and one round: a real HTTP server on 127.0.0.1, both
loaders, real worker processes. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import fcntl
import inspect
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

import aioload
from aioload._front.loader import default_queue_depth
from aioload._tools import cli as _cli
from aioload._data.synth import default_root

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--images", "32", "--batch-size", "8", "--workers", "1", "--rounds", "1"]


def bench_env(cache: Path, path: str = str(ROOT)) -> dict:
    return dict(os.environ, AIOLOAD_CACHE=str(cache), PYTHONPATH=path)


def run_bench(args: list[str], cache: Path, timeout: float = 300, path: str = str(ROOT)) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "aioload", "bench", *args], cwd=cache.parent,
                          env=bench_env(cache, path), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def servers_for(root: Path) -> list[int]:
    """Pids of live bench servers serving ``root`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and any(a.endswith(b"/_tools/benchserver.py") for a in argv) and os.fsencode(root) in argv:
            found.append(int(entry))
    return found


@pytest.mark.serial  # the bench's /dev/shm figure is the machine's
def test_bench_runs_both_scenarios_and_draws_a_png(tmp_path):
    cache = tmp_path / "cache"
    # without the http extra: an aiohttp that cannot be imported comes first on the path
    blocked = tmp_path / "no-extras" / "aiohttp"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('aiohttp is not installed here')\n")
    done = run_bench([*SMALL, "--plot", str(tmp_path / "bench.png")], cache,
                     path=os.pathsep.join([str(blocked.parent), str(ROOT)]))
    out, err = done.stdout, done.stderr
    # how it was run comes first, stamped with the time it started; the line under the table
    # repeats it with how long it took
    first, header = out.splitlines()[:2]
    assert re.fullmatch(r"run: python .*, \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", first), first
    assert re.search(rf"\n{re.escape(first)}, took \d+ s\n", out), out
    assert header.endswith(", 1 interleaved round per scenario"), header
    assert f"generating 32 synthetic ImageNet-like JPEGs in {cache}" in err
    assert "made earlier" not in err
    table = out.split("aioload pipeline")[0]
    local, http = table.split("\nlocal folder\n")[1].split("\nHTTP, 20 ms round trip\n")
    for block in (local, http):
        for label, _, _, _ in _cli.ROWS:
            assert f"  {label} " in block
        # no training step ran: the share of time waited (about 100 % for any loader) is not shown
        assert _cli.STEP_ROW[0] not in block and "% of the time" not in block
        # aioload's batches never touch /dev/shm: no ratio against zero
        assert re.search(r"  /dev/shm MB \(peak\) +[\d.]+ +none\n", block), block
    assert "ceiling img/s (decode alone)" in local and "aioload img/s / local ceiling" in http
    # it ends with a summary that agrees with the table, and the next step
    *_, summary, next_step = out.splitlines()
    said = re.fullmatch(r"summary: aioload delivered ([\d.]+)x torch's img/s on local files \(\d+% of the ceiling\) "
                        r"and ([\d.]+)x behind 20 ms of HTTP latency \(\d+% of the local ceiling\), with 1 worker each",
                        summary)
    assert said, summary
    for ratio, block in zip(said.groups(), (local, http)):
        torch_rate, aioload_rate = map(float, re.search(r"img/s after the first batch +([\d.]+) +([\d.]+)", block).groups())
        # the table's rates are rounded to 0.05 either way, the ratio to 0.005: what that allows
        slack = aioload_rate / torch_rate * (0.05 / torch_rate + 0.05 / aioload_rate) + 0.005
        assert abs(float(ratio) - aioload_rate / torch_rate) <= slack + 1e-9, (ratio, block)
    assert next_step.startswith("next: aioload bench --data DIR measures your own images")
    # aioload's own statistics: local files are opened by the workers (no read counted, and no
    # row of zeros for it), every image of the HTTP scenario is read on the event loop
    stats = out.split("aioload pipeline, HTTP, 20 ms round trip")[1]
    reads = re.search(r"reads\s+(\d+) \(([\d.]+) (B|KB|MB) on the event loop\)", stats)
    assert reads and int(reads.group(1)) == 32 and reads.group(3) != "B"
    local_stats = out.split("aioload pipeline, local folder")[1].split("aioload pipeline, HTTP")[0]
    assert "\nreads            none: each sample was loaded by the worker that decoded it" in local_stats
    assert "verdict          [" in stats
    # stderr is a pipe here: no bars, only each round's line
    assert "\r" not in err and "batch/s" not in err
    for name in ("local torch DataLoader", "local aioload DataLoader", "http  torch DataLoader",
                 "http  aioload DataLoader"):
        assert re.search(f"round 1/1 {name} +[\\d.]+ img/s after the first batch", err)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert servers_for(cache / "imagenet-like-32-8-s0") == []


def run_bench_on_a_terminal(args: list[str], cache: Path, timeout: float = 300) -> tuple[str, str]:
    """The bench with its stderr on a pseudo-terminal (as when run by hand) and its stdout
    piped: ``(stdout, what the terminal got)``."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    written = bytearray()

    def drain() -> None:
        while True:
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: the bench and its children have closed the terminal
                return
            if not data:
                return
            written.extend(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        done = subprocess.run([sys.executable, "-m", "aioload", "bench", *args], cwd=cache.parent,
                              env=bench_env(cache), stdout=subprocess.PIPE, stderr=terminal, text=True,
                              timeout=timeout)
    finally:
        os.close(terminal)
        reader.join(30)
        os.close(controller)
    terminal_text = written.decode(errors="replace")
    assert done.returncode == 0, done.stdout + terminal_text
    return done.stdout, terminal_text


def test_bench_reuses_its_data_and_draws_an_svg(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("AIOLOAD_CACHE", str(cache))
    made = aioload.make_data(n=32)
    assert made == cache / "imagenet-like-32-8-s0" == default_root(32)
    out, err = run_bench_on_a_terminal([*SMALL, "--scenarios", "local", "--step-ms", "1",
                                        "--plot", str(tmp_path / "bench.svg")], cache)
    assert f"using the 32 synthetic JPEGs made earlier in {made}" in err
    assert "generating" not in err
    assert "\nlocal folder\n" in out and "HTTP" not in out
    # a training step ran: the table says what share of the time it stood waiting for data
    assert re.search(rf"\n  {re.escape(_cli.STEP_ROW[0])} +\d+% +\d+%\n", out), out
    assert out.splitlines()[-1].startswith("next: aioload bench --data DIR")
    assert "<svg" in (tmp_path / "bench.svg").read_text()
    # on a terminal, a bar per round (counting its 4 batches), then the round's line
    for name in ("local torch DataLoader", "local aioload DataLoader"):
        assert f"round 1/1 {name}: " in err  # its bar
        assert re.search(f"round 1/1 {name} +[\\d.]+ img/s after the first batch", err)
    assert err.count("0/4 [") >= 2


INTERRUPTIBLE = """
import runpy, signal, sys
# Ctrl-C raises KeyboardInterrupt even where the suite runs as a background job, whose children
# start with SIGINT ignored (and Python then leaves it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv[0] = "aioload"
runpy.run_module("aioload", run_name="__main__", alter_sys=True)
"""
"""``python -m aioload ...`` as run from a terminal."""


@pytest.mark.parametrize("how", ["interrupt", "kill"])
def test_bench_server_stops_with_the_bench(tmp_path, how):
    cache = tmp_path / "cache"
    root = aioload.make_data(tmp_path / "data", 32)
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE, "bench", "--data", str(root), "--scenarios", "http",
                             "--batch-size", "8", "--workers", "1", "--rounds", "1000"],
                            env=bench_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90  # hang guards, not timings
        while not servers_for(root):
            assert proc.poll() is None and time.monotonic() < deadline, "the bench's server never started"
            time.sleep(0.05)
        server = servers_for(root)[0]
        if how == "interrupt":  # Ctrl-C
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 130
        else:
            proc.kill()
            proc.wait(60)
        while servers_for(root):
            assert time.monotonic() < deadline + 30, f"the bench's server (pid {server}) outlived the bench"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
        for pid in servers_for(root):
            os.kill(pid, signal.SIGKILL)


# -- the table, its note and the closing lines (figures made up: the formatting is under test) --
def scenario(key: str, torch_rate: float, aioload_rate: float, ceilings=(), batches: int = 16, workers: int = 2,
             shm: float = 0.0) -> _cli.Scenario:
    """A scenario of one round whose runs have the given rates, over ``batches`` batches of 64."""
    from aioload._tools.bench import Comparison, Run

    def run(name: str, rate: float, shm_mb: float) -> Run:
        images = 64 * (batches - 1)
        return Run(name, images, images / rate, 0.3, 0.03, 700.0, shm_mb, None, 0.5 * images / rate, batches - 1)

    comparison = Comparison({})
    comparison.runs = {"torch DataLoader": [run("torch DataLoader", torch_rate, 18.4)],
                       "aioload DataLoader": [run("aioload DataLoader", aioload_rate, shm)]}
    title = "local folder" if key == "local" else "HTTP, 20 ms round trip"
    return _cli.Scenario(key, title, comparison, workers, list(ceilings))


def test_above_the_ceiling_is_marked_and_explained():
    local = scenario("local", 500.0, 660.0, ceilings=[600.0, 640.0, 700.0])
    http = scenario("http", 80.0, 650.0)
    text = _cli.table([local, http])
    assert "  ceiling img/s (decode alone)        640.0            aioload 103%* of it\n" in text
    assert re.search(r"\n  aioload img/s / local ceiling +102%\*\n", text), text
    note = " ".join(text.split("\n  * ")[1].split())
    # the ceiling's spread over the rounds, and the head start of the first batches: with 2
    # workers on 16-batch epochs, 15 batches counted for 14 batches' work
    assert "(600-700 img/s here)" in note and "up to 7% more on 16-batch epochs with 2 workers" in note
    assert note.endswith("Read it as: at the ceiling.")
    # far above the ceiling and its head start: the load changed during the run
    noisy = _cli.table([scenario("local", 500.0, 800.0, ceilings=[600.0, 640.0, 700.0])])
    assert " ".join(noisy.split("\n  * ")[1].split()).endswith(
        "This far above it, the machine's load changed during the run: measure again when it is quieter.")
    args = argparse.Namespace(latency_ms=20.0, workers=2, data=None, step_ms=0.0)
    assert _cli.summary([local, http], args) == (
        "summary: aioload delivered 1.32x torch's img/s on local files (103% of the ceiling) and 8.12x behind "
        "20 ms of HTTP latency (102% of the local ceiling), with 2 workers each")


def test_below_the_ceiling_needs_no_note_and_shm_of_zero_has_no_ratio():
    local = scenario("local", 500.0, 600.0, ceilings=[640.0], shm=0.0)
    text = _cli.table([local])
    assert "*" not in text and "aioload 94% of it" in text
    assert re.search(r"\n  /dev/shm MB \(peak\) +18\.4 +none\n", text), text
    used = _cli.table([scenario("local", 500.0, 600.0, ceilings=[640.0], shm=9.2)])
    assert re.search(r"\n  /dev/shm MB \(peak\) +18\.4 +9\.2 +0\.50x\n", used), used
    # another program's few KB on /dev/shm, below what the table shows, is still none
    other = _cli.table([scenario("local", 500.0, 600.0, ceilings=[640.0], shm=0.04)])
    assert re.search(r"\n  /dev/shm MB \(peak\) +18\.4 +none\n", other), other


def test_the_step_row_only_with_a_training_step():
    local = scenario("local", 500.0, 600.0, ceilings=[640.0])
    assert _cli.STEP_ROW[0] not in _cli.table([local])
    assert re.search(rf"\n  {re.escape(_cli.STEP_ROW[0])} +50% +50%\n", _cli.table([local], step=True))


@pytest.mark.parametrize(("data", "step_ms", "expected"), [
    (None, 0.0, r"next: aioload bench --data DIR measures your own images .*; --step-ms 30 adds a 30 ms training step .*"),
    (None, 30.0, r"next: aioload bench --data DIR measures your own images \(class folders of JPEGs, as ImageFolder reads\)"),
    ("photos", 0.0, r"next: --step-ms 30 adds a 30 ms training step to each batch, .*"),
    ("photos", 30.0, r"next: put aioload.DataLoader into your training loop \(README.md: the one-line change\)"),
])
def test_the_next_step_follows_what_ran(data, step_ms, expected):
    assert re.fullmatch(expected, _cli.next_step(argparse.Namespace(data=data, step_ms=step_ms)))


# -- the command line's help ------------------------------------------------------------------
def subcommands() -> dict:
    parser = _cli.parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices


@pytest.mark.parametrize("command", ["bench", "make-data"])
def test_every_option_has_help_and_its_default(command):
    for action in subcommands()[command]._actions:
        if action.dest == "help" or not action.option_strings:
            continue
        assert action.help and "default" in action.help, action.option_strings


def test_the_bench_runs_aioload_with_the_loaders_own_defaults():
    args = _cli.parser().parse_args(["bench"])
    signature = inspect.signature(aioload.DataLoader.__init__).parameters
    assert (args.io_concurrency, args.queue_depth) == (signature["io_concurrency"].default,
                                                       signature["queue_depth"].default)
    assert aioload.DataLoader(range(8), num_workers=2).queue_depth == default_queue_depth(None, 2) == 2


def test_top_level_help_is_plain_text_and_names_the_cache_variable(capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "`" not in out
    # each command is listed once (not also in the description), on one line with its help
    for name in subcommands():
        listed = [line for line in out.splitlines() if re.match(rf"\s+(aioload )?{re.escape(name)}\b", line)]
        assert len(listed) == 1, (name, listed)
        assert re.fullmatch(rf"    {re.escape(name)}  +\w.+", listed[0]), listed
    assert "AIOLOAD_CACHE" in out and "~/.cache/aioload" in out
    bench = " ".join(subcommands()["bench"].format_help().split())  # help lines are wrapped
    assert "AIOLOAD_CACHE" in bench and "(default: 20)" in bench and "(default: local,http)" in bench


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _cli.main(["bench", "--data", str(tmp_path), "--plot", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == (
        "error: --plot needs matplotlib, which is not installed: pip install 'aioload[plot]'\n")
    assert not (tmp_path / "x.png").exists()


def test_plot_needs_a_png_or_svg_name(tmp_path, capsys):
    assert _cli.main(["bench", "--data", str(tmp_path), "--plot", str(tmp_path / "x.jpg")]) == 2
    assert capsys.readouterr().err == f"error: --plot {tmp_path / 'x.jpg'}: the file must end in .png or .svg\n"


# -- making data --------------------------------------------------------------------------------
def test_make_data_command(tmp_path, capsys):
    target = tmp_path / "photos"
    assert _cli.main(["make-data", str(target), "--images", "6", "--classes", "3"]) == 0
    assert capsys.readouterr().out.endswith(f"6 JPEGs in 3 class folders under {target}\n")
    dataset = aioload.ImageFolder(target)
    assert len(dataset) == 6 and dataset.classes == ["class_000", "class_001", "class_002"]
    assert [label for _, label in dataset.samples] == [0, 0, 1, 1, 2, 2]
    before = {p: p.stat().st_mtime_ns for p in target.rglob("*.jpg")}
    assert _cli.main(["make-data", str(target), "--images", "6", "--classes", "3"]) == 0
    assert capsys.readouterr().out == f"{target} already holds these 6 generated JPEGs: nothing to do\n"
    assert {p: p.stat().st_mtime_ns for p in target.rglob("*.jpg")} == before


def test_make_data_is_deterministic_and_decodes(tmp_path):
    from PIL import Image

    a = aioload.make_data(tmp_path / "a", 4, classes=2, seed=3)
    b = aioload.make_data(tmp_path / "b", 4, classes=2, seed=3)
    files = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert len(files) == 4
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    with Image.open(a / files[0]) as image:  # an independent decoder reads it
        assert image.format == "JPEG" and 330 <= image.width < 500 and 280 <= image.height < 420


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 0}, "make_data: n must be an int >= 1, got 0"),
    ({"n": 4, "classes": "8"}, "make_data: classes must be an int >= 1, got '8'"),
])
def test_make_data_rejects_bad_counts(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        aioload.make_data(tmp_path, **kwargs)
