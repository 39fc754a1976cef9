"""The bench's HTTP server process (aioload/_tools/benchserver.py): what it serves, and how long
it lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from aioload._tools.benchhttp import SERVER, Server


def get(base: str, name: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(base + name, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_a_symlink_that_leads_outside_the_root_is_not_served(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "secret"
    (root / "sub").mkdir(parents=True)
    outside.write_bytes(b"not for the bench")
    (root / "sub" / "inside.jpg").write_bytes(b"a picture")
    (root / "leak.jpg").symlink_to(outside)  # a file under the root that points outside it
    (root / "alias.jpg").symlink_to(root / "sub" / "inside.jpg")  # one that stays inside
    (root / "dangling.jpg").symlink_to(tmp_path / "nothing")
    with Server(root, latency_ms=0) as server:
        assert get(server.base, "sub/inside.jpg") == (200, b"a picture")
        assert get(server.base, "alias.jpg") == (200, b"a picture")
        assert get(server.base, "leak.jpg")[0] == 404
        assert get(server.base, "dangling.jpg")[0] == 404
        assert get(server.base, "../secret")[0] == 404


def test_a_server_started_from_a_thread_outlives_the_thread(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"x" * 10)
    started: list[Server] = []
    thread = threading.Thread(target=lambda: started.append(Server(tmp_path, latency_ms=0)))
    thread.start()
    thread.join()
    (server,) = started
    try:
        assert server.proc.poll() is None
        assert get(server.base, "a.jpg") == (200, b"x" * 10)  # alive after the thread that started it ended
    finally:
        server.close()
    assert server.proc.returncode is not None


def test_the_server_stops_when_its_parent_process_is_killed(tmp_path):
    # the parent starts the server from a thread that ends at once, then waits to be killed
    script = (
        "import sys, threading, time\n"
        "from aioload._tools.benchhttp import Server\n"
        "box = []\n"
        "t = threading.Thread(target=lambda: box.append(Server(sys.argv[1], latency_ms=0)))\n"
        "t.start(); t.join()\n"
        "print(box[0].proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        server = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 30  # a hang guard
        while _alive(server):
            assert time.monotonic() < deadline, f"the server (pid {server}) outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)
        parent.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_the_server_script_runs_alone():
    done = subprocess.run([sys.executable, str(SERVER), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "serve ROOT's files" in done.stdout
