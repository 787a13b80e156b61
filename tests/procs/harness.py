"""Parent-side helpers for the real-process tests: environment for children, line
readers with a hang guard, the zygote client, free ports, FIFO barriers."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import ckptstore

PROCS = Path(__file__).resolve().parent
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ckptstore.__file__)))

# Guard against hangs only: every wait here is on a pipe, a line or a process, and this
# bound turns a library hang into a test failure instead of a stuck suite.
HANG_GUARD_S = 180.0


def child_env(**extra) -> dict:
    env = dict(os.environ)
    parts = [PKG_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore::RuntimeWarning")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def script(name: str) -> str:
    return str(PROCS / name)


class LineReader:
    """Reads a stream's lines on a thread; ``next()`` returns one (None at EOF)."""

    def __init__(self, stream):
        self._q: queue.Queue = queue.Queue()
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._t.start()

    def _run(self, stream):
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def next(self, timeout: float = HANG_GUARD_S) -> str | None:
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the child within {timeout}s (hang?); lines so far: {self.lines[-20:]}")
        if line is not None:
            self.lines.append(line)
        return line

    def rest(self, timeout: float = HANG_GUARD_S) -> list[str]:
        out = []
        while (line := self.next(timeout)) is not None:
            out.append(line)
        return out


class Child:
    """A subprocess running one of tests/procs' scripts, stdout read line by line."""

    def __init__(self, name: str, *args, env: dict | None = None, stdin=subprocess.DEVNULL):
        self.proc = subprocess.Popen(
            [sys.executable, script(name), *map(str, args)], stdin=stdin, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env or child_env(),
        )
        self.out = LineReader(self.proc.stdout)
        self.err = LineReader(self.proc.stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, prefix: str) -> str:
        """The next stdout line, which must start with ``prefix``."""
        line = self.out.next()
        assert line is not None and line.startswith(prefix), (
            f"expected a line starting {prefix!r}, got {line!r}\nstderr:\n{self.stderr_tail()}")
        return line

    def finish(self, timeout: float = HANG_GUARD_S) -> tuple[int, list[str]]:
        """Wait for the child to end; its exit code and remaining stdout lines."""
        rest = self.out.rest(timeout)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"child {self.pid} did not exit within {timeout}s")
        self.err.rest(timeout)
        return code, rest

    def stderr_tail(self, n: int = 40) -> str:
        return "\n".join(self.err.lines[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


class Zygote:
    """Client of tests/procs/zygote.py: fork pre-warmed children, one at a time.

    Start several with :func:`start_zygotes` (they warm up in parallel)."""

    def __init__(self, wait: bool = True):
        self.proc = subprocess.Popen(
            [sys.executable, script("zygote.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=child_env(), bufsize=1,
        )
        self.out = LineReader(self.proc.stdout)
        self.err = LineReader(self.proc.stderr)
        self.current: ForkedChild | None = None  # forked and not yet reaped
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        ready = self._expect("ready")
        assert ready.split(" ", 1)[1] == os.path.abspath(ckptstore.__file__), (
            f"the zygote imported another ckptstore: {ready}")

    def _expect(self, word: str) -> str:
        line = self.out.next()
        assert line is not None and line.split(" ", 1)[0] == word, (
            f"zygote: expected {word!r}, got {line!r}\nstderr:\n{self.stderr_tail()}")
        return line

    def _send(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def run(self, name: str, *args, **env) -> "ForkedChild":
        self._send({"cmd": "run", "script": script(name), "argv": [str(a) for a in args],
                    "env": {k: str(v) for k, v in env.items()}})
        pid = int(self._expect("pid").split()[1])
        self.current = ForkedChild(self, pid)
        return self.current

    def stderr_tail(self, n: int = 40) -> str:
        return "\n".join(self.err.lines[-n:])

    def close(self, wait: bool = True) -> None:
        if self.current is not None:  # a test failed mid-trial: do not leak its child
            try:
                self.current.kill()
            except ProcessLookupError:
                pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if wait:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_zygotes(n: int) -> list[Zygote]:
    zs = [Zygote(wait=False) for _ in range(n)]
    for z in zs:
        z.wait_ready()
    return zs


def close_zygotes(zs: list[Zygote]) -> None:
    for z in zs:
        z.close(wait=False)
    for z in zs:
        z.close()


class ForkedChild:
    def __init__(self, zygote: Zygote, pid: int):
        self.z = zygote
        self.pid = pid
        self.lines: list[str] = []
        self._eof = False
        self.code: int | None = None

    def next(self) -> str | None:
        """The child's next stdout line; None once its stdout closed."""
        if self._eof:
            return None
        line = self.z.out.next()
        assert line is not None, f"zygote died\nstderr:\n{self.z.stderr_tail()}"
        if line == "eof":
            self._eof = True
            return None
        assert line.startswith("out "), f"zygote: unexpected {line!r}"
        self.lines.append(line[4:])
        return line[4:]

    def kill(self, sig=signal.SIGKILL) -> None:
        os.kill(self.pid, sig)  # safe: the zygote reaps only after we say so

    def finish(self) -> int:
        """Read to the end of the child's output, reap it, return its exit code."""
        while self.next() is not None:
            pass
        self.z._send({"cmd": "reap"})
        self.code = int(self.z._expect("exit").split()[1])
        self.z.current = None
        return self.code


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def release_fifos(paths, message: bytes = b"go\n", timeout: float = HANG_GUARD_S) -> None:
    """Open each FIFO for writing (blocks until its reader opened it) and send ``message``.

    Each open runs on its own thread so the readers are released together; the join
    bound only guards against a child that died before opening its FIFO.
    """
    errors = []

    def release(path):
        try:
            with open(path, "wb") as f:
                f.write(message)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=release, args=(p,), daemon=True) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a child never opened its barrier FIFO"
    assert not errors, errors
