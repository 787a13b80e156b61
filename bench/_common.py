"""Helpers shared by the benchmark scripts in bench/: walking and comparing nested states,
machine facts (CPU model, the mount a directory is on), dropping the page cache, measuring
other processes' CPU use, and writing the result JSON.

The scripts run as ``python bench/<name>.py``, so this directory is on ``sys.path``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform

import torch


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor in a nested dict / list / tuple, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def same(a, b) -> bool:
    """Bit-exact equality of two nested states (tensor dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mount_of(path: str, options: bool = True) -> dict:
    """The mount ``path`` is on, from /proc/mounts: mountpoint, fstype, device and (with
    ``options``) the mount options."""
    path = os.path.realpath(path)
    best = {"mountpoint": "/", "fstype": "unknown", "device": "unknown", "options": ""}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts = line.split()[:4]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best["mountpoint"]):
                    best = {"mountpoint": mnt, "fstype": fstype, "device": dev, "options": opts}
    except OSError:
        pass
    if not options:
        del best["options"]
    return best


_DROP_OK: bool | None = None


def drop_caches() -> bool:
    """sync + drop the page cache; False (once decided) when the process may not."""
    global _DROP_OK
    os.sync()
    if _DROP_OK is False:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        _DROP_OK = True
    except OSError:
        _DROP_OK = False
    return _DROP_OK


def read_through(path: str) -> None:
    """Read every file under ``path`` (or the file itself) once, so that a "warm" load
    finds it in the page cache whoever wrote it: ckptstore's writer advises the kernel
    to drop what it wrote (writeback starts early, and a checkpoint does not crowd out
    training's page cache), torch.save's stays cached."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


class Contention:
    """CPU used by other processes over the run: machine-wide busy time (/proc/stat)
    minus this process's and its children's CPU time, in cores."""

    def __init__(self):
        self.t0 = self._stat()
        self.c0 = os.times()

    @staticmethod
    def _stat():
        try:
            with open("/proc/stat") as f:
                v = list(map(int, f.readline().split()[1:]))
            return sum(v) - v[3] - v[4], sum(v)  # busy (not idle, not iowait), total jiffies
        except OSError:
            return None

    def others_cores(self) -> float | None:
        t1, c1 = self._stat(), os.times()
        if self.t0 is None or t1 is None or t1[1] == self.t0[1]:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        ours = sum(getattr(c1, a) - getattr(self.c0, a)
                   for a in ("user", "system", "children_user", "children_system")) * hz
        busy = t1[0] - self.t0[0]
        return max(0.0, (busy - ours) / (t1[1] - self.t0[1]) * (os.cpu_count() or 1))


def write_json(path: str, result, indent: int = 2) -> None:
    """Write ``result`` as JSON to ``path`` (making its directory) and print ``wrote PATH``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
    print(f"wrote {path}")


def machine_info(bench_dir: str, **extra) -> dict:
    """The machine a run came from: CPU, cores, memory, versions, kernel and the disk of
    ``bench_dir``; ``extra`` adds the script's own facts (library versions, threads)."""
    import ckptstore
    from ckptstore import native

    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "ram_bytes": ram,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ckptstore": ckptstore.__version__,
        "ckptstore_native": bool(native.NATIVE),
        **extra,
        "kernel": platform.release(),
        "disk": {"dir": bench_dir, **mount_of(bench_dir, options=False)},
    }
