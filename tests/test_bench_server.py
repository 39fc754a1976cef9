"""The bench's HTTP server (``aioload/_tools/benchserver.py``) as its clients use it: torch's
recipe (``urllib``, a connection per request), ``http.client`` on one keep-alive connection,
and aioload's storage; GET, HEAD, ranges, missing files, the request counter, a client that
leaves mid-body."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import time
import urllib.error
import urllib.request

import pytest

import aioload
from aioload._tools.benchhttp import Server

DATA = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture
def served(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(DATA)
    (tmp_path / "b.txt").write_bytes(b"hello")
    with Server(tmp_path, latency_ms=2, mb_per_s=500) as server:
        yield server


def test_gets_ranges_and_heads_over_one_keep_alive_connection(served):
    host, port = served.base.split("/")[2].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        answers = []
        for method, headers in [("GET", {}), ("GET", {"Range": "bytes=10-19"}), ("GET", {"Range": "bytes=1048500-"}),
                                ("HEAD", {}), ("GET", {"Range": "bytes=2000000-"})]:
            conn.request(method, "/sub/a.bin", headers=headers)
            resp = conn.getresponse()
            answers.append((resp.status, resp.getheader("Content-Range"), resp.getheader("Content-Length"), resp.read()))
        sock = conn.sock
        conn.request("GET", "/nope")
        missing = conn.getresponse()
        missing.read()
        assert conn.sock is sock  # every answer on the one connection
    finally:
        conn.close()
    assert answers[0] == (200, None, str(len(DATA)), DATA)
    assert answers[1] == (206, f"bytes 10-19/{len(DATA)}", "10", DATA[10:20])
    assert answers[2] == (206, f"bytes 1048500-{len(DATA) - 1}/{len(DATA)}", "76", DATA[1048500:])
    assert answers[3] == (200, None, str(len(DATA)), b"")
    assert answers[4] == (416, f"bytes */{len(DATA)}", "0", b"")
    assert missing.status == 404
    assert served.requests() == 6


def test_the_server_says_how_much_cpu_it_has_used(served):
    clock_ticks = os.sysconf("SC_CLK_TCK")

    def from_proc() -> float:  # what the kernel counts for the server's process
        with open(f"/proc/{served.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / clock_ticks

    before = served.cpu_seconds()
    for _ in range(20):
        with urllib.request.urlopen(served.base + "sub/a.bin", timeout=30) as resp:
            assert resp.read() == DATA
    after = served.cpu_seconds()
    assert 0 < before < after  # it grows as the server serves bodies
    assert abs(after - from_proc()) < 0.05 + 2 / clock_ticks
    assert served.requests() == 20  # asking for it is not a request for a file


def test_torch_recipe_and_aioload_storage_read_the_same_bytes(served):
    with urllib.request.urlopen(served.base + "b.txt", timeout=30) as resp:  # Connection: close
        assert resp.read() == b"hello"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(served.base + "../b.txt", timeout=30)
    assert info.value.code == 404

    async def main():
        storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=1))
        parts = await asyncio.gather(*(storage.read_range(served.base + "sub/a.bin", i * 4096, 4096)
                                       for i in range(256)))
        return b"".join(parts), await storage.read_bytes(served.base + "sub/a.bin")

    joined, whole = asyncio.run(main())
    assert joined == DATA and whole == DATA


def test_a_client_that_leaves_mid_body_leaves_the_server_serving(served):
    host, port = served.base.split("/")[2].split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"GET /sub/a.bin HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 200 OK\r\n")
    with urllib.request.urlopen(served.base + "sub/a.bin", timeout=30) as resp:
        assert resp.read() == DATA


def slow_reader_ranges(base: str, path: str, ranges: list[tuple[int, int]], wait_s: float) -> list:
    """``(status line, headers, body)`` of a GET of each range of ``path``, one after another on
    one connection whose receive buffer is 4 KB, each read only ``wait_s`` after it was asked."""
    host, port = base.split("/")[2].split(":")
    answers = []
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect((host, int(port)))
        reader = sock.makefile("rb")
        for first, last in ranges:
            sock.sendall(f"GET /{path} HTTP/1.1\r\nHost: x\r\nRange: bytes={first}-{last}\r\n\r\n".encode())
            time.sleep(wait_s)
            status = reader.readline()
            headers = {}
            while (line := reader.readline()) != b"\r\n":
                name, _, value = line.decode().partition(":")
                headers[name.lower()] = value.strip()
            answers.append((status, headers, reader.read(int(headers["content-length"]))))
    return answers


def test_a_paced_body_sent_from_the_file_reaches_a_slow_reader_whole_and_in_order(served):
    # a range of one pace piece (500 MB/s: 1 MB) goes out by sendfile after its head; a client
    # with a small receive buffer that reads late gets each body whole, the second request's
    # answer after the first's on the same connection
    ranges = [(5, 999_999), (1000, 1999)]
    for (first, last), (status, headers, body) in zip(ranges, slow_reader_ranges(served.base, "sub/a.bin", ranges, 0.2)):
        assert status.startswith(b"HTTP/1.1 206")
        assert headers["content-range"] == f"bytes {first}-{last}/{len(DATA)}"
        assert body == DATA[first:last + 1]


def test_a_body_larger_than_the_socket_takes_reaches_a_slow_reader_whole(tmp_path):
    # 12 MB unpaced to a reader with a 4 KB receive buffer that waits before reading: sendfile
    # fills the socket, and what it does not take goes through the transport (which then holds
    # the rest back until the socket drains); each body arrives whole, the next answer after it
    data = os.urandom(12 << 20)
    (tmp_path / "big.bin").write_bytes(data)
    ranges = [(0, len(data) - 1), (5, 1000)]
    with Server(tmp_path, latency_ms=2) as server:
        answers = slow_reader_ranges(server.base, "big.bin", ranges, 0.3)
    for (first, last), (status, _, body) in zip(ranges, answers):
        assert status.startswith(b"HTTP/1.1 206")
        assert body == data[first:last + 1]
