"""The node's memory directory for the memory tier (docs/design/in-job-restart.md,
sections 5.1 and 7): ``<memory-dir>/<run>-<store digest>/<node>`` on tmpfs (default
``/dev/shm/ckptstore``), mode 0700, owned by ``ckptstore run`` for the whole run (not
per attempt: a cold relaunch still finds what the ranks saved there) and removed at
every exit of the supervisor; and the budget the ranks may fill it with.

The supervisor creates it once (:func:`claim_dir`), exports it and the budget to the
agent, which passes them to every worker (``injob.ENV_MEMORY_DIR``,
``injob.ENV_MEMORY_BUDGET``), and removes it (:func:`release_dir`) however the run ends.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil

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


def claim_dir(root: str, run_id: str, node: int | str) -> str:
    """Create ``<root>/<run>/<node>`` (mode 0700; the levels above it too, 0700 where
    this call creates them) and return it. One that exists (a ``--run-id`` run again
    on this node) is kept: it holds the run's own memory tier."""
    path = node_dir(root, run_id, node)
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # whatever the umask made of it
    return path


def release_dir(root: str, run_id: str, node: int | str) -> None:
    """Remove the node's directory and, once empty, the run's (never ``root``)."""
    path = node_dir(root, run_id, node)
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:  # another node's directory is still there, or it is gone already
        pass
