"""aioload's HTTP client against a server that answers at random, for a bounded time: random
heads (header names, blanks, long values, interim answers, HTTP/1.0), bodies framed by
Content-Length, chunks of random sizes or the connection's end, written in random pieces;
surplus bytes after an answer (a whole stale response, or noise); answers cut short at every
byte; heads the client must refuse; a server that stops answering.

The rule held: a request gets its own response (the body names the request it answers) or a
clear ``RemoteReadError`` naming its URL, never another request's bytes and never any other
exception, and nothing holds the event loop for as long as a request's timeout. The seed is
printed with any failure (``AIOLOAD_FUZZ_SEED=<seed>`` replays it).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time

import aioload
from tests.loopstall import longest_stall

TIMEOUT = 2.0  # a request's timeout: also the longest the loop may be held
BUDGET_S = 12.0  # the random rounds' share of the test's time
TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def body_of(seed: int, request_id: int) -> bytes:
    """The body of a request's answers: it names the request, and its size (0 to about 70 KB)
    is drawn from the seed and the request."""
    rng = random.Random(f"{seed}:{request_id}:body")
    size = rng.choice([0, 1, 7, 100, 4096, 65_536 + 17, rng.randrange(1, 70_000)])
    stamp = b"<%d>" % request_id
    return (stamp * (size // len(stamp) + 1))[:size] if size else b""


class Answer:
    """One response as bytes, and what the client may make of it: ``must`` (the body, or the
    part a range asked for, must come back), ``may_prefix`` (a body ended by the connection's
    end, cut: a prefix of it is a right answer), or only an error."""

    def __init__(self, data: bytes, close: bool, must: bool, may_prefix: bool = False, hang: bool = False):
        self.data, self.close, self.must, self.may_prefix, self.hang = data, close, must, may_prefix, hang


def head_lines(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(rng.randrange(0, 5)):
        name = "X-" + "".join(rng.choice(TOKEN) for _ in range(rng.randrange(1, 12)))
        blanks = rng.choice(["", " ", "\t", "  \t ", " " * rng.randrange(0, 3000)])
        value = "".join(rng.choice("abc xyz,;=/\t") for _ in range(rng.randrange(0, 40)))
        lines.append(f"{name}:{blanks}{value}{rng.choice(['', ' ', chr(9), ' ' * rng.randrange(0, 500)])}")
    if rng.random() < 0.01:  # blanks inside a value: a backtracking parser takes seconds over it
        lines.append("X-Pad: a" + " " * 20_000 + "b")
    return lines


def valid(request_id: int, whole: bytes, asked: tuple[int, int] | None, rng: random.Random) -> tuple[bytes, bool, str]:
    """``(response, close after it, framing)``: a valid answer to the request."""
    status, body, lines = "200 OK", whole, head_lines(rng)
    if asked is not None and rng.random() < 0.6:  # Range honoured
        start, end = asked
        end = min(end, len(whole) - 1)
        if start < len(whole):
            status, body = "206 Partial Content", whole[start:end + 1]
            lines.append(f"Content-Range: bytes {start}-{end}/{len(whole)}")
    version = "HTTP/1.0" if rng.random() < 0.1 else "HTTP/1.1"
    close = version == "HTTP/1.0" or rng.random() < 0.1
    if version == "HTTP/1.1" and close:
        lines.append("Connection: close")
    framing = rng.choice(["length", "length", "chunked", "close"]) if status.startswith("200") else "length"
    if framing == "length":
        lines += [f"Content-Length: {len(body)}"] * rng.choice([1, 1, 2])
        framed = body
    elif framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
        pieces, at = [], 0
        while at < len(body):
            n = rng.choice([1, 3, 100, 8192, 70_000])
            ext = rng.choice(["", ";a=b", "; x"])
            pieces.append(b"%x%s\r\n%s\r\n" % (len(body[at:at + n]), ext.encode(), body[at:at + n]))
            at += n
        framed = b"".join(pieces) + b"0\r\n" + rng.choice([b"", b"X-Sum: 1\r\n"]) + b"\r\n"
    else:
        close = True
        framed = body
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" if rng.random() < 0.1 else b""
    head = f"{version} {status}\r\n" + "".join(line + "\r\n" for line in lines) + "\r\n"
    return interim + head.encode("latin-1") + framed, close, framing


BAD_HEADS = [
    b"HTTP/1.1 200 OK\nContent-Length: 3\n\nabc",
    "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\nab".encode("latin-1"),
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n folded\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


def answer(seed: int, request_id: int, asked: tuple[int, int] | None, rng: random.Random) -> Answer:
    whole = body_of(seed, request_id)
    data, close, framing = valid(request_id, whole, asked, rng)
    fault = rng.choices(["none", "surplus", "cut", "bad", "hang"], [55, 15, 24, 5, 1])[0]
    if fault == "none" or (fault == "surplus" and (close or framing == "close")):
        return Answer(data, close, must=True)
    if fault == "surplus":  # a stale answer to another request, or noise, right after this one
        stale, _, _ = valid(request_id + 1_000_000, body_of(seed, request_id + 1_000_000), None, rng)
        extra = stale if rng.random() < 0.5 else bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        return Answer(data + extra, close=False, must=True)
    if fault == "cut":
        return Answer(data[:rng.randrange(0, len(data))], close=True, must=False, may_prefix=framing == "close")
    if fault == "bad":
        return Answer(rng.choice(BAD_HEADS), close=True, must=False)
    return Answer(data[:rng.randrange(0, len(data))], close=False, must=False, hang=True)


class Fuzzer:
    """The server: each request ``/r/<id>`` is answered by ``answer`` (the last answer given to
    a request is kept in ``given``), written in pieces of random sizes."""

    def __init__(self, seed: int):
        self.seed = seed
        self.given: dict[int, Answer] = {}
        self.fixed: dict[int, Answer] = {}  # answers set by the test (the cut-at-every-byte rounds)
        self.tasks: set = set()

    async def serve(self, reader, writer) -> None:
        self.tasks.add(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_id = int(re.search(rb"^GET /r/(\d+) ", head).group(1))
                rng = random.Random(f"{self.seed}:{request_id}:{len(self.given)}")
                asked = re.search(rb"\r\nRange: bytes=(\d+)-(\d+)\r\n", head)
                span = (int(asked.group(1)), int(asked.group(2))) if asked else None
                out = self.fixed.get(request_id) or answer(self.seed, request_id, span, rng)
                self.given[request_id] = out
                at = 0
                while at < len(out.data):
                    n = rng.choice([1, 2, 17, 1000, 65_536, len(out.data)])
                    writer.write(out.data[at:at + n])
                    at += n
                    if rng.random() < 0.3:
                        await writer.drain()
                await writer.drain()
                if out.hang:
                    await asyncio.Event().wait()  # until the client gives up and the test ends
                if out.close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass  # the test is over: end quietly
        finally:
            writer.close()
            self.tasks.discard(asyncio.current_task())


def check(request_id: int, url: str, asked, outcome, given: Answer, whole: bytes) -> str | None:
    """Why ``outcome`` breaks the rule, or None."""
    expected = whole if asked is None else whole[asked[0]:asked[1] + 1]
    if isinstance(outcome, aioload.RemoteReadError):
        if not re.match(rf"^GET {re.escape(url)} failed after \d+ attempts?; last status: ", str(outcome)):
            return f"an unclear error: {outcome}"
        return f"an error for a valid answer: {outcome}" if given.must else None
    if isinstance(outcome, BaseException):
        return f"{type(outcome).__name__}: {outcome}"
    if outcome == expected:
        return None
    if given.may_prefix and expected.startswith(outcome):  # a body ended by the connection's end, cut
        return None
    return f"not its own answer: {bytes(outcome[:60])!r} ({len(outcome)} bytes) for {bytes(expected[:60])!r}"


def test_the_client_against_random_answers_gets_each_its_own_answer_or_a_clear_error():
    seed = int(os.environ.get("AIOLOAD_FUZZ_SEED") or random.randrange(1 << 32))
    failures: list[str] = []

    async def main():
        fuzzer = Fuzzer(seed)
        server = await asyncio.start_server(fuzzer.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=1, timeout=TIMEOUT), connections_per_host=4)
        done = asyncio.Event()
        watch = asyncio.ensure_future(longest_stall(done))
        rng = random.Random(seed)
        requests = 0

        async def one(request_id: int, ranged: bool = False, whole: bytes | None = None) -> None:
            url = f"http://127.0.0.1:{port}/r/{request_id}"
            whole = body_of(seed, request_id) if whole is None else whole
            asked = None
            if ranged:
                start = rng.randrange(0, 80_000)
                asked = (start, start + rng.randrange(0, 5000))
            try:
                if asked is None:
                    outcome = await storage.read_bytes(url)
                else:
                    outcome = await storage.read_range(url, asked[0], asked[1] - asked[0] + 1)
            except Exception as exc:  # noqa: BLE001 - judged below
                outcome = exc
            why = check(request_id, url, asked, outcome, fuzzer.given[request_id], whole)
            if why is not None:
                failures.append(f"request {request_id}{'' if asked is None else f' (range {asked})'}: {why}")

        try:
            async with server:
                # cut at every byte: a sized and a chunked answer (to one request each, asked again
                # for each cut), each prefix of it then a close
                for request_id, framing in ((10**7, "length"), (10**7 + 1, "chunked")):
                    whole = b"<%d>" % request_id * 40
                    lines = ([f"Content-Length: {len(whole)}"] if framing == "length"
                             else ["Transfer-Encoding: chunked"])
                    head = ("HTTP/1.1 200 OK\r\n" + "".join(x + "\r\n" for x in lines) + "\r\n").encode()
                    full = head + (whole if framing == "length" else b"%x\r\n%s\r\n0\r\n\r\n" % (len(whole), whole))
                    for cut in range(len(full)):
                        fuzzer.fixed[request_id] = Answer(full[:cut], close=True, must=False)
                        await one(request_id, whole=whole)
                    fuzzer.fixed[request_id] = Answer(full, close=False, must=True)
                    await one(request_id, whole=whole)
                    requests += len(full) + 1
                # random rounds, some at once, for the time budget
                ends = time.monotonic() + BUDGET_S
                while time.monotonic() < ends and len(failures) < 5:
                    batch = [one(requests + k, rng.random() < 0.3) for k in range(rng.randrange(1, 9))]
                    requests += len(batch)
                    await asyncio.gather(*batch)
                await storage.aclose()
                for task in list(fuzzer.tasks):
                    task.cancel()
                await asyncio.gather(*fuzzer.tasks, return_exceptions=True)
        finally:
            done.set()
        return requests, await watch

    requests, stall = asyncio.run(main())
    assert not failures, f"seed {seed} (AIOLOAD_FUZZ_SEED={seed} replays it), {len(failures)} of {requests} " \
                         "requests broke the rule:\n" + "\n".join(failures[:5])
    assert stall < TIMEOUT, f"seed {seed}: the loop was held {stall:.2f} s, as long as a request's timeout"
    assert requests > 100
