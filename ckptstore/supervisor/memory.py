"""The node's memory directory for the memory tier (docs/design/in-job-restart.md,
sections 5.1 and 7): ``<memory-dir>/<run>-<store digest>/<node>`` on tmpfs (default
``/dev/shm/ckptstore``), mode 0700, owned by ``ckptstore run`` for the whole run (not
per attempt: a cold relaunch still finds what the ranks saved there) and removed at
every exit of the supervisor; and the budget the ranks may fill it with.

The supervisor creates it once (:func:`claim_dir`), exports it and the budget to the
agent, which passes them to every worker (``injob.ENV_MEMORY_DIR``,
``injob.ENV_MEMORY_BUDGET``), and removes it (:func:`release_dir`) however the run ends.

A supervisor killed outright (SIGKILL, the OOM killer) cannot remove it. So each node
directory has an owner file beside it, ``<run>-<digest>/<node>.owner``, which its
supervisor holds ``flock``-ed for its whole life (the kernel drops the lock when the
process dies, whatever killed it; a reused pid holds nothing) and which names its pid,
host and start time. :func:`claim_dir` first sweeps every node directory under the
memory root whose owner file it can lock (its owner is gone) and that this host wrote,
and any directory it finds at its own path once it holds that path's lock; a directory
whose owner file is locked (a live supervisor's) is never touched, nor one without an
owner file (an older version's: whose it is cannot be told). A second supervisor for
the same run and node while the first lives gets :class:`MemoryDirBusy`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
from typing import Callable

DEFAULT_DIR = "/dev/shm/ckptstore"
DEFAULT_BUDGET = "25%"  # of MemAvailable when the run starts
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_budget(text: str) -> str:
    """``--memory-budget``'s value checked (bytes, or ``N%`` of MemAvailable); raises
    ValueError with what is allowed."""
    m = _PERCENT.match(text)
    if m:
        if not 0 < float(m.group(1)) <= 100:
            raise ValueError(f"{text!r}: a percentage must be above 0 and at most 100")
        return text.strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither bytes (a whole number) nor N% of the available memory") from None
    if value < 0:
        raise ValueError(f"{value} bytes: a budget cannot be negative")
    return str(value)


def budget_bytes(spec: str, meminfo: str = "/proc/meminfo") -> int:
    """The budget in bytes: ``spec`` itself, or its percentage of MemAvailable now (0
    when MemAvailable cannot be read: no memory tier rather than a guess)."""
    m = _PERCENT.match(spec)
    if not m:
        return int(spec)
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * float(m.group(1)) / 100)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_dir_name(run_id: str, store_url: str) -> str:
    """The run's directory name under the memory root: its id and a digest of its store,
    so that the same ``--run-id`` given to another store (a copied launch script, a
    bench) never finds this store's memory tier, which its binding would refuse."""
    return f"{run_id}-{hashlib.sha256(store_url.encode()).hexdigest()[:8]}"


def node_dir(root: str, run_id: str, node: int | str) -> str:
    return os.path.join(root, run_id, str(node))


OWNER_SUFFIX = ".owner"
MAX_OWNER_BYTES = 4096
BUSY_WAIT_S = 2.0  # how long a locked owner file of this run and node is waited for (a sweep, not an owner)
LOCK_TRIES = 20  # a sweeper holds a lock for the time of one rmtree: wait that out, not a live owner
_HELD: dict[str, int] = {}  # node directory -> the fd of its owner file's lock (this process's claims)


class MemoryDirBusy(OSError):
    """The node directory belongs to a live supervisor (its owner file is locked)."""


def owner_path(root: str, run_id: str, node: int | str) -> str:
    return node_dir(root, run_id, node) + OWNER_SUFFIX


def _try_lock(path: str, create: bool = True) -> int | None:
    """An fd of ``path`` (created when missing, never through a symlink) locked
    exclusively, and still the file at ``path`` (not one a sweeper unlinked meanwhile);
    None when another process holds the lock."""
    for _ in range(LOCK_TRIES):
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        try:
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # (swept under us: lock the new file)
    raise MemoryDirBusy(errno.EBUSY, f"{path}: replaced {LOCK_TRIES} times while being locked")


def _owner_record(fd: int) -> dict:
    try:
        data = os.pread(fd, MAX_OWNER_BYTES, 0)
        found = json.loads(data) if data else {}
    except (OSError, ValueError, RecursionError):
        return {}
    return found if isinstance(found, dict) else {}


def _describe_owner(found: dict) -> str:
    pid, host, at = found.get("pid"), found.get("host"), found.get("started")
    if not isinstance(pid, int) or not isinstance(host, str):
        return "an owner that is gone"
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)) if isinstance(at, (int, float)) and \
        0 <= at < 1e11 else "?"
    return f"pid {pid} on {host[:64]} (started {when}), which is gone"


def _remove_node(node_path: str, owner_file: str | None) -> None:
    shutil.rmtree(node_path, ignore_errors=True)  # (never follows a symlink: rmtree's fd-based walk)
    try:
        if os.path.islink(node_path):
            os.unlink(node_path)
    except OSError:
        pass
    if owner_file is not None:
        try:
            os.unlink(owner_file)
        except OSError:
            pass


def sweep_stale(root: str, skip: str = "", say: Callable[[str], None] | None = None) -> list[str]:
    """Remove every node directory under ``root`` whose owner file this process can
    lock (its supervisor is gone) and which this host's supervisor wrote; returns their
    paths. ``skip``: a node directory left alone (the caller's own, handled under its
    lock). Live owners, other hosts' directories (a memory root on a shared file
    system), directories without an owner file and symlinks are never touched."""
    swept = []
    try:
        runs = sorted(os.listdir(root))
    except OSError:
        return swept
    host = socket.gethostname()
    for run in runs:
        run_path = os.path.join(root, run)
        if os.path.islink(run_path) or not os.path.isdir(run_path):
            continue
        try:
            leaves = sorted(os.listdir(run_path))
        except OSError:
            continue
        for leaf in leaves:
            node = leaf[:-len(OWNER_SUFFIX)]
            if not leaf.endswith(OWNER_SUFFIX) or not node or node.startswith("."):
                continue
            owner_file, node_path = os.path.join(run_path, leaf), os.path.join(run_path, node)
            if node_path == skip or os.path.islink(owner_file):
                continue
            try:
                fd = _try_lock(owner_file, create=False)
            except OSError:
                continue
            if fd is None:
                continue  # a live supervisor's
            try:
                found = _owner_record(fd)
                if found.get("host") != host:
                    continue  # (another host's, or unreadable: flock across hosts is not to be trusted)
                _remove_node(node_path, owner_file)
                swept.append(node_path)
                if say is not None:
                    say(f"memory tier: removed {node_path}, left by {_describe_owner(found)} (killed before it "
                        "could remove it)")
            finally:
                os.close(fd)
        try:
            os.rmdir(run_path)  # (once empty)
        except OSError:
            pass
    return swept


def claim_dir(root: str, run_id: str, node: int | str, say: Callable[[str], None] | None = None,
              swept: list[str] | None = None) -> str:
    """Create ``<root>/<run>/<node>`` (mode 0700; the levels above it too, 0700 where
    this call creates them) and return it, holding its owner file's lock until
    :func:`release_dir` or this process's end. Stale node directories are swept first
    (:func:`sweep_stale`; one at this path too: what a killed supervisor of this run
    left); their paths are appended to ``swept``, and ``say`` tells of each. Raises
    :class:`MemoryDirBusy` when a live supervisor owns this path."""
    path = node_dir(root, run_id, node)
    found = sweep_stale(root, skip=path, say=say)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    owner_file = owner_path(root, run_id, node)
    deadline = time.monotonic() + BUSY_WAIT_S
    fd = _try_lock(owner_file)
    while fd is None and time.monotonic() < deadline:  # (another start's sweep may hold it a moment)
        time.sleep(0.05)
        fd = _try_lock(owner_file)
    if fd is None:
        previous = ""
        try:
            with open(owner_file, "rb") as f:
                previous = f.read(MAX_OWNER_BYTES).decode(errors="replace")
        except OSError:
            pass
        raise MemoryDirBusy(errno.EBUSY, f"{path} belongs to a live supervisor of the same run and node "
                            f"({previous[:200] or 'its owner file is locked'}): two `ckptstore run` with one "
                            "--run-id and node rank on one host; this one runs without the memory tier")
    try:
        if os.path.lexists(path):  # its lock was free: left by a supervisor of this run that was killed
            stale = _owner_record(fd)
            _remove_node(path, None)  # (the owner file stays: it is locked, and ours now)
            found.append(path)
            if say is not None:
                who = _describe_owner(stale) if stale else "a supervisor of this run"
                say(f"memory tier: removed {path}, left by {who} (killed before it could remove it); this run "
                    "starts it empty")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                             "run": run_id, "node": str(node)}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)  # whatever the umask made of it
    except BaseException:
        os.close(fd)
        raise
    old = _HELD.pop(path, None)
    if old is not None:
        os.close(old)
    _HELD[path] = fd
    if swept is not None:
        swept.extend(found)
    return path


def release_dir(root: str, run_id: str, node: int | str) -> None:
    """Remove the node's directory and its owner file and, once empty, the run's
    directory (never ``root``); then drop the owner file's lock."""
    path = node_dir(root, run_id, node)
    fd = _HELD.pop(path, None)
    try:
        _remove_node(path, owner_path(root, run_id, node) if fd is not None else None)
    finally:
        if fd is not None:
            os.close(fd)
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:  # another node's directory is still there, or it is gone already
        pass
