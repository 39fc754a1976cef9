"""A user program's terminal stays clean: no "Task was destroyed but it is pending!", no
never-awaited coroutine, no ResourceWarning, whatever way an epoch ends.

Each case runs a small program in a fresh interpreter with ``-X dev`` and asyncio's debug mode
(which report never-awaited coroutines, unclosed sockets and tasks destroyed while pending) and
fails on any output at all on stderr. The dataset's reads return 400 kB each, so a task message
is larger than a worker's socket takes at once and the per-worker backlog flush is in flight
when an epoch is left early; one read leaves a task of its own running on the loader's loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent('''
    import asyncio
    import logging
    import multiprocessing
    import sys

    import torch

    import aioload

    # asyncio's debug mode also logs callbacks slower than 0.1 s (a WARNING): timing, not a
    # fault, on a busy machine. Errors (a task destroyed while pending) are still shown.
    logging.getLogger("asyncio").setLevel(logging.ERROR)

    WORKERS = int(sys.argv[1])
    LEFT = []  # tasks the reads left running on the loader's event loop
    ASYNC = sys.argv[2] == "async"


    class Big(aioload.Dataset):
        """256 samples whose reads return 400 kB: a batch's task fills a worker's socket."""

        def __len__(self):
            return 256

        async def read(self, index):
            await asyncio.sleep(0)
            if index == 0:  # a task the read leaves running, as a prefetch or a client might
                LEFT.append(asyncio.ensure_future(asyncio.sleep(60)))
            return bytes([index % 256]) * 400_000

        def decode(self, raw):
            return torch.tensor(raw[0]), len(raw)


    def make():
        return aioload.DataLoader(Big(), batch_size=16, shuffle=True, num_workers=WORKERS,
                                  generator=torch.Generator().manual_seed(0))


    async def take(loader, n):
        """The first ``n`` batches of an epoch, leaving it with break (sync or async)."""
        got = []
        if ASYNC:
            async for batch in loader:
                got.append(batch)
                if len(got) == n:
                    break
        else:
            for batch in loader:
                got.append(batch)
                if len(got) == n:
                    break
        return got


    async def epoch(loader):
        if ASYNC:
            return [batch async for batch in loader]
        return list(loader)


    async def main():
        # break out of a loop, twice, then close
        loader = make()
        assert len(await take(loader, 1)) == 1
        assert len(await take(loader, 2)) == 2
        loader.close()

        # save mid-epoch, close, resume into a new loader and run two epochs to their end
        loader = make()
        await take(loader, 2)
        state = loader.state_dict()
        loader.close()
        loader = make()
        loader.load_state_dict(state)
        assert len(await epoch(loader)) == 14
        assert len(await epoch(loader)) == 16
        loader.close()

        # an epoch left by leaving the loader's with block
        with make() as loader:
            await take(loader, 3)
        print("ok")


    if __name__ == "__main__":  # spawn and forkserver run this module again in the workers' template
        if len(sys.argv) > 3:
            multiprocessing.set_start_method(sys.argv[3])  # the interpreter's default, as 3.14 sets it
        asyncio.run(main())
''')


@pytest.mark.parametrize(("workers", "mode", "method"), [
    (0, "sync", None), (0, "async", None), (2, "sync", None), (2, "async", None),
    (2, "sync", "spawn"), (2, "async", "forkserver"),
])
def test_no_output_on_stderr(tmp_path, workers, mode, method):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONASYNCIODEBUG="1", PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-X", "dev", str(script), str(workers), mode, *([method] if method else [])],
                          capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n"
    assert done.stderr == ""
