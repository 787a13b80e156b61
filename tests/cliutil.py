"""Running the ``ckptstore`` command from tests: in-process through click's runner, and
as real ``python -m ckptstore.cli`` processes (exit codes, stderr, several at once);
the store debris the commands act on (aged files, failed save attempts), and snapshots
of a store's files to show a command changed nothing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

from click.testing import CliRunner

import ckptstore
from ckptstore import format as fmt
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.cli import main
from ckptstore.errors import CommitTimeoutError
from ckptstore.runtime import runtime

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ckptstore.__file__)))


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PKG_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONWARNINGS"] = "ignore::RuntimeWarning"  # the pure-torch fallback notice
    return env


def run_cli_processes(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Run several ``python -m ckptstore.cli`` processes at once (imports dominate)."""
    procs = [subprocess.Popen([sys.executable, "-m", "ckptstore.cli", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=cli_env()) for argv in argvs]
    out = []
    for argv, p in zip(argvs, procs):
        stdout, stderr = p.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(argv, p.returncode, stdout, stderr))
    return out


def age_files(directory, seconds: float) -> None:
    """Set the mtime of every file below ``directory`` ``seconds`` into the past."""
    then = time.time() - seconds
    for dirpath, _, files in os.walk(directory):
        for f in files:
            os.utime(os.path.join(dirpath, f), (then, then))


def failed_attempt(where, obj, *, rank: int, step: int) -> str:
    """One rank of a 2-rank save of ``obj`` whose partner never shows up: it leaves data
    and a vote (rank 0 also an abort marker) and fails; nothing is committed (the
    timeout is the failure, not a synchronisation). Returns the attempt id."""
    attempt = fmt.new_attempt_id()
    fut = start_save(obj, where, rt=runtime(), attempt=attempt, step=step, rank=rank, world_size=2,
                     metrics=None, options=SaveOptions(commit_timeout=0.2))
    assert isinstance(fut.exception(timeout=60), CommitTimeoutError)
    return attempt


def files_below(root) -> dict[str, str]:
    """{relative path: sha256} of every file below ``root``."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def tree(root) -> dict[str, str]:
    """files_below plus the directories (so removing an empty directory shows)."""
    out = files_below(root)
    for dirpath, dirs, _ in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = ""
    return out
