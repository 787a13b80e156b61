"""Running the ``ckptstore`` command from tests: in-process through click's runner, and
as real ``python -m ckptstore.cli`` processes (exit codes, stderr, several at once)."""

from __future__ import annotations

import os
import subprocess
import sys

from click.testing import CliRunner

import ckptstore
from ckptstore.cli import main

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
