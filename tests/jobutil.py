"""A job run as a subprocess whose output lines the test reads as they come: kills and
signals land at chosen points (a step, a commit) without sleeping. Every wait is
bounded by ``HANG_GUARD_S``, which only turns a hang into a failure."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading

HANG_GUARD_S = 240.0


class Job:
    """A process (a launcher, a supervisor) and the lines its tree prints; ranks print
    ``rank R: step S pid P`` (docs/examples/fault_tolerant_training.py)."""

    def __init__(self, cmd: list[str], env: dict | None = None, cwd=None):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True, cwd=cwd)
        self.lines: list[str] = []
        self.pids: dict[int, int] = {}
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # ends when every holder of the pipe (orphans too) is gone
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def expect(self, predicate, what: str) -> str:
        """The next line that satisfies ``predicate`` (lines before it are kept)."""
        while True:
            try:
                line = self._q.get(timeout=HANG_GUARD_S)
            except queue.Empty:
                raise AssertionError(f"no line {what} within {HANG_GUARD_S}s:\n" + "\n".join(self.lines[-40:]))
            if line is None:
                raise AssertionError(f"output ended before {what}:\n" + "\n".join(self.lines[-40:]))
            self.lines.append(line)
            if " pid " in line and line.startswith("rank "):
                r, pid = int(line.split()[1].rstrip(":")), int(line.rsplit(" ", 1)[1])
                self.pids[r] = pid
            if predicate(line):
                return line

    def at_step(self, rank: int, step: int) -> None:
        self.expect(lambda l: l.startswith(f"rank {rank}: step {step} "), f"of rank {rank} at step {step}")

    def committed(self, step: int) -> None:
        self.expect(lambda l: l == f"rank 0: committed step {step}", f"committing step {step}")

    def stopped(self, step: int, committed: int) -> None:
        """Rank 1 stopped at ``step`` (tests/procs/supervised_train.py's "hang") and step
        ``committed`` committed, in either order: a kill sent then lands where it means to."""
        want, seen = {f"rank 1: stopped at step {step}", f"rank 0: committed step {committed}"}, set()

        def both(line: str) -> bool:
            seen.add(line)
            return want <= seen
        self.expect(both, f"rank 1 stopping at step {step} and step {committed} committed")

    def finish(self) -> int:
        """Wait for the process and for the end of the output (every worker gone)."""
        try:
            code = self.proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError("the job hung:\n" + "\n".join(self.lines[-40:]))
        while True:
            try:
                line = self._q.get(timeout=HANG_GUARD_S)
            except queue.Empty:
                raise AssertionError("workers outlived their launcher:\n" + "\n".join(self.lines[-40:]))
            if line is None:
                return code
            self.lines.append(line)

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.pids.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def output(self) -> str:
        return "\n".join(self.lines)


def assert_bit_identical(final_path, reference: dict) -> None:
    """The parameters a job wrote (torch.save) equal ``reference`` bit for bit."""
    import torch

    got = torch.load(final_path)
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert torch.equal(got[k].view(torch.int32), reference[k].view(torch.int32)), k
