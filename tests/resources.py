"""What a process holds, read from /proc: child processes, aioload threads, file descriptors,
shared-memory mappings, /dev/shm entries and memory. Tests compare a snapshot taken before a
loader with one taken after, waiting (with a deadline) for the release to complete."""

from __future__ import annotations

import gc
import multiprocessing.forkserver
import os
import threading
import time
from dataclasses import dataclass

SHM_DIR = "/dev/shm"


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``"Z"`` for a zombie), ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie nobody has reaped yet)."""
    return proc_state(pid) in (None, "Z", "X")


def children(pid: int | None = None) -> set[int]:
    """Live (non-zombie) child processes of ``pid``, leaving out multiprocessing's forkserver
    and resource tracker, which belong to the interpreter rather than to a loader (earlier
    tests that used spawn or forkserver start them once per test session)."""
    import multiprocessing.resource_tracker

    parent = os.getpid() if pid is None else pid
    helpers = {
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
    }
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == parent and fields[0] not in ("Z", "X") and int(entry) not in helpers:
            found.add(int(entry))
    return found


def aioload_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("aioload"))


def fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def memfd_fds(pid: int | str = "self") -> int:
    """Open file descriptors of aioload's shared-memory slots."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:aioload" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                count += 1
        except FileNotFoundError:
            continue
    return count


def memfd_maps(pid: int | str = "self") -> int:
    """Mappings of aioload's shared-memory slots in the address space."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "memfd:aioload" in line)


def shm_entries() -> set[str]:
    """Files in /dev/shm, without multiprocessing's semaphores (``sem.*``: any process on the
    machine makes them, and unlinks them as soon as they are created)."""
    try:
        return {name for name in os.listdir(SHM_DIR) if not name.startswith("sem.")}
    except FileNotFoundError:
        return set()


def status_kb(pid: int | str, field: str) -> int:
    """A ``/proc/<pid>/status`` figure in kB (``VmRSS``, ``VmHWM``, ...)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def private_kb(pid: int | str) -> int:
    """Memory the process does not share with its parent: pages it wrote or copied (after a
    fork, every page touched by a reference count change lands here)."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Dirty:", "Private_Clean:")):
                total += int(line.split()[1])
    return total


@dataclass(frozen=True)
class Snapshot:
    children: frozenset
    threads: tuple
    fds: int
    memfd_fds: int
    memfd_maps: int
    shm: frozenset

    @classmethod
    def take(cls) -> "Snapshot":
        return cls(frozenset(children()), tuple(aioload_threads()), fd_count(), memfd_fds(),
                   memfd_maps(), frozenset(shm_entries()))

    def leaks(self, after: "Snapshot") -> list[str]:
        found = []
        if after.children - self.children:
            found.append(f"child processes {sorted(after.children - self.children)}")
        if after.threads:
            found.append(f"threads {list(after.threads)}")
        if after.fds > self.fds:
            found.append(f"{after.fds - self.fds} more file descriptors")
        if after.memfd_fds > self.memfd_fds or after.memfd_maps > self.memfd_maps:
            found.append(f"slot memory: {after.memfd_fds} fds, {after.memfd_maps} mappings")
        if after.shm - self.shm:
            found.append(f"/dev/shm entries {sorted(after.shm - self.shm)}")
        return found


def assert_released(before: Snapshot, timeout: float = 10.0) -> None:
    """Everything a loader held since ``before`` is released within ``timeout`` seconds."""
    state = {}

    def clean():
        gc.collect()
        state["leaks"] = before.leaks(Snapshot.take())
        return not state["leaks"]

    try:
        wait_until(clean, timeout, "the loader's resources to be released", interval=0.05)
    except AssertionError:
        raise AssertionError(f"still held after {timeout} s: {'; '.join(state['leaks'])}") from None


def zombies(pid: int | None = None) -> set[int]:
    """Children of ``pid`` that exited and were never reaped."""
    parent = os.getpid() if pid is None else pid
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == parent and fields[0] == "Z":
                found.add(int(entry))
    return found
