"""``ckptstore doctor``: the native extension, CUDA, staging pool and backends; with
``--health`` this node's checks (supervisor/health.py)."""

from __future__ import annotations

import datetime as _dt
import sys

import click

from .._version import __version__
from .common import _human_bytes, _print_json, _printable

def doctor_report() -> dict:
    import platform

    import torch
    import xxhash
    import zstandard

    from .. import native
    from ..runtime import runtime

    cuda = torch.cuda.is_available()
    backends = ["local", "memory"]
    try:
        import boto3  # noqa: F401

        backends.append("s3 (boto3 present)")
    except ImportError:
        pass
    return {
        "ckptstore": __version__,
        "native": native.NATIVE,
        "native_reason": native.WHY_NOT or None,
        "hardware_threads": native.hardware_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zstandard": zstandard.__version__,
        "xxhash": xxhash.VERSION,
        "cuda": {
            "available": cuda,
            "runtime": torch.version.cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            # the extension's own CUDA path (batched staging, pinned slabs): compiled in,
            # and whether the driver (libcuda, loaded at run time) sees a device
            "native": native.cuda_info(),
            # why that path is off (None: on); staging then runs on torch streams
            "native_off": native.cuda_off_reason(),
        },
        "staging_pool": runtime().pool.stats(),
        "backends": backends,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }

@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--health", is_flag=True, help="Check this node instead (GPUs through NVML, disks, the store), as "
              "`ckptstore run` does before each launch; exit 13 when unhealthy.")
@click.option("--store", "store_url", default=None, help="With --health: the store to check (reachable, writable).")
@click.option("--staging-dir", "staging_dirs", multiple=True, help="With --health: a local directory to check.")
@click.option("--expected-gpus", type=click.IntRange(min=0), default=None,
              help="With --health: fewer visible GPUs than this is unhealthy.")
def doctor(as_json: bool, health: bool, store_url: str | None, staging_dirs: tuple[str, ...],
           expected_gpus: int | None) -> None:
    """Report the native extension, CUDA, staging pool, backends and versions."""
    if health:
        from ..supervisor.health import HealthLimits, health_main

        sys.exit(health_main(store_url, staging_dirs, as_json, HealthLimits(expected_gpus=expected_gpus)))
    report = doctor_report()
    if as_json:
        _print_json(report)
        return
    click.echo(doctor_text(report))


# Figures of the staging pool that count bytes (the rest count events or blocks).
_POOL_BYTES = {"capacity", "held", "in_use", "used", "cached", "peak", "peak_in_use", "overflow_bytes",
               "largest_free", "slab_bytes"}

def _doctor_value(key: str, value, section: str) -> str:
    """One figure of the doctor report, as a person reads it."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or value == "":
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_doctor_value(key, v, section) for v in value) or "none"
    if isinstance(value, dict):  # (deeper than a section: inline)
        return ", ".join(f"{k.replace('_', ' ')} {_doctor_value(k, v, section)}" for k, v in value.items()) or "-"
    if isinstance(value, int) and section == "staging_pool" and key in _POOL_BYTES:
        return f"{_human_bytes(value)} ({value} bytes)" if value >= 1024 else _human_bytes(value)
    if isinstance(value, int) and section == "cuda.native" and key.endswith("_version"):
        # CUDA's encoding: 1000 * major + 10 * minor (12040 is 12.4); 0: none found
        return "-" if value == 0 else f"{value // 1000}.{value % 1000 // 10} ({value})"
    return str(value)

def doctor_text(report: dict) -> str:
    """The doctor report as a table: one row per figure (the same keys as --json, each
    section's rows indented under it), with yes/no for flags, "-" for nothing, byte
    counts with their units, and every string escaped as ls escapes what it prints."""
    rows: list[tuple[str, str]] = []

    def walk(d: dict, depth: int, section: str) -> None:
        for k, v in d.items():
            label = "  " * depth + k.replace("_", " ")
            if isinstance(v, dict) and depth < 2 and v:
                rows.append((label, ""))
                walk(v, depth + 1, f"{section}.{k}" if section else k)
            else:
                rows.append((label, _doctor_value(k, v, section)))

    walk(report, 0, "")
    cuda = report.get("cuda") or {}
    if cuda.get("native_off"):
        # Said plainly: the path is off for a reason the user may fix (driver, build).
        state = "GPU present, " if cuda.get("available") else "no GPU for torch; "
        rows.append(("native CUDA path", f"OFF ({state}{cuda['native_off']})"))
    elif isinstance(cuda.get("native"), dict):
        info = cuda["native"]
        driver = _doctor_value("driver_version", info.get("driver_version"), "cuda.native")
        rows.append(("native CUDA path", f"on (driver API, driver {driver}, "
                                         f"{info.get('devices')} device(s), kernel {info.get('kernel')})"))
    rows = [(_printable(k), _printable(v)) for k, v in rows]  # reasons and names come from the system
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}".rstrip() for k, v in rows)
