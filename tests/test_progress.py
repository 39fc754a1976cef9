"""``progress=True``: a tqdm bar on a terminal, plain lines anywhere else (a file, a pipe, a
job's log), so that a log gets a few lines instead of every frame of a bar.

The terminal is a real pseudo-terminal; the loaders run real worker processes.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import aioload
from aioload._observe.monitor import ProgressLines, draws_bars
from tests.datasets import Squares

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import aioload
from tests.datasets import Squares

with aioload.DataLoader(Squares(12), batch_size=4, num_workers=1, progress=True) as loader:
    for epoch in range(2):
        for batch in loader:
            pass
print("finished", flush=True)
"""

LINE = re.compile(r"^epoch (\d): 3/3 batches in [\d.]+ s, \d+ samples/s, waiting \d+%$")


def open_terminal(columns: int = 100) -> tuple[int, int]:
    """A pseudo-terminal ``(controller, terminal)`` of ``columns`` columns."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return controller, terminal


def read_all(fd: int, into: bytearray) -> None:
    """What a pseudo-terminal's programs write, until the last of them closes it."""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: no program holds the terminal any more
            return
        if not data:
            return
        into += data


def run(stderr) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=stderr, timeout=120)


def test_progress_away_from_a_terminal_is_one_line_per_epoch():
    done = run(subprocess.PIPE)
    assert done.returncode == 0, done.stderr.decode()
    err = done.stderr.decode()
    assert "\r" not in err and "|" not in err, err  # no bar frames
    lines = err.splitlines()
    assert [LINE.match(line).group(1) for line in lines] == ["0", "1"], lines


def test_progress_on_a_terminal_is_a_bar():
    controller, terminal = open_terminal()
    written = bytearray()
    reader = threading.Thread(target=read_all, args=(controller, written))
    reader.start()
    try:
        done = run(terminal)
    finally:
        os.close(terminal)
        reader.join(30)
        os.close(controller)
    assert done.returncode == 0 and done.stdout == b"finished\n"
    text = written.decode()
    for epoch in (0, 1):
        assert re.search(rf"\repoch {epoch}: 100%\|[^\r]*\| 3/3 \[", text), text
    assert "samples/s, waiting" in text


def test_progress_lines_during_an_epoch_and_at_its_end():
    out = io.StringIO()
    lines = ProgressLines(out, total=5, desc="epoch 3", every_s=0.0)  # a line at every update
    lines.update(1)
    lines.set_postfix_str("120 samples/s, waiting 4%")
    lines.update(1)
    lines.close()
    written = out.getvalue().splitlines()
    assert len(written) == 3
    assert re.fullmatch(r"epoch 3: 1/5 batches after [\d.]+ s", written[0])
    assert re.fullmatch(r"epoch 3: 2/5 batches after [\d.]+ s, 120 samples/s, waiting 4%", written[1])
    assert re.fullmatch(r"epoch 3: 2/5 batches in [\d.]+ s, 120 samples/s, waiting 4%", written[2])


def test_progress_lines_without_a_length_and_on_a_closed_stream():
    out = io.StringIO()
    lines = ProgressLines(out, total=None, desc="epoch 0")
    lines.update(7)
    lines.close()
    assert re.fullmatch(r"epoch 0: 7 batches in [\d.]+ s\n", out.getvalue())
    out.close()
    ProgressLines(out, total=None, desc="epoch 1").close()  # a closed stream gets nothing, raises nothing


def test_what_draws_bars(tmp_path):
    controller, terminal = open_terminal()
    try:
        with os.fdopen(os.dup(terminal), "w") as tty:
            assert draws_bars(tty)
    finally:
        os.close(terminal)
        os.close(controller)
    with open(tmp_path / "log", "w") as log:
        assert not draws_bars(log)
    assert not draws_bars(log)  # closed
    assert not draws_bars(io.StringIO())
    assert not draws_bars(object())


def test_progress_in_process_without_a_terminal(capsys):
    with aioload.DataLoader(Squares(8), batch_size=4, num_workers=1, progress=True) as loader:
        assert len([batch for batch in loader]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"epoch 0: 2/2 batches in [\d.]+ s, \d+ samples/s, waiting \d+%\n", err), err
