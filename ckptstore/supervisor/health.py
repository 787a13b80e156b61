"""Node health checks: run before each (re)start by ``ckptstore run`` and alone by
``ckptstore doctor --health``.

:func:`check_node` returns a list of :class:`Check` results, one per rule and subject;
the node is healthy when every one is ``ok`` (:func:`healthy`). A check that cannot be
made on this hardware (NVML answers "Not Supported") is ``ok`` with detail ``n/a``;
any other error while making a check fails that check only, with the error's text.

Checks (names as they appear in the table and the JSON), with their limits in
:class:`HealthLimits`:

- ``gpus``: the GPUs NVML sees (``nvidia-ml-py``, imported lazily). No ``pynvml``
  module, no NVML library or driver, or no device: ``none``, ok (a machine without GPUs
  passes), unless ``expected_gpus`` asks for some. ``CUDA_VISIBLE_DEVICES``, when set,
  selects the devices checked (indices or ``GPU-`` UUID prefixes; an entry that names no
  device fails). CUDA itself is never initialised (no torch.cuda call): a supervisor
  that forks workers must not hold a CUDA context.
- per device ``gpuN.<rule>``: ``visible`` (handle, name, UUID), ``memory`` (free
  fraction), ``temperature``, ``power`` (draw against the enforced limit), ``ecc``
  (uncorrected volatile and aggregate counts), ``retired_pages`` (pending retirement
  fails: the GPU needs a reset), ``remapped_rows`` (a failed remap or a pending one
  fails), ``pcie`` (current link width below the maximum fails; a lower current
  generation is normal at idle and only reported), ``clocks`` (a hardware slowdown
  fails; software throttling is reported, ok).
- ``disk.free:<dir>`` and ``disk.write:<dir>`` for each staging directory and for a
  local store's path: free bytes, and a probe file created (``O_CREAT|O_EXCL``),
  fsynced and removed. A missing staging directory fails (a missing mount is a node
  fault; nothing is created). A local store that does not exist yet is measured at its
  nearest existing ancestor (a first run creates it).
- ``store``: the store opens, takes a create-only probe object under
  :data:`PROBE_PREFIX` (``journal/.health/<host>-<pid>-<8 hex>``), returns it
  byte-identical and deletes it. On S3 the client is built with few attempts and short
  timeouts (``store_max_attempts``, ``store_timeout_s``), so an unreachable endpoint
  fails in seconds.
- ``host.memory``: available RAM (``MemAvailable`` of /proc/meminfo; psutil where there
  is no /proc).

Each group runs in its own thread under ``probe_timeout_s``: a hung NFS mount, S3
endpoint or NVML call fails its group ("no answer within ...") instead of hanging the
supervisor.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass

GiB = 1 << 30
EXIT_UNHEALTHY = 13  # ``ckptstore run`` / ``doctor --health``: this node should be replaced
PROBE_PREFIX = "journal/.health/"  # reserved: journal readers skip it; probes are deleted at once


@dataclass
class Check:
    """One rule applied to one subject: ``ok``, a short human ``detail`` and, where
    there are numbers, ``value`` (machine-readable: bytes, degrees C, watts, counts)."""

    name: str
    ok: bool
    detail: str
    value: dict | None = None


@dataclass(frozen=True)
class HealthLimits:
    """The limits the checks apply. Defaults:

    ``expected_gpus`` (None): when set, fewer visible GPUs than this fails.
    ``min_free_gpu_mem_frac`` (0.0): free/total device memory below this fails; 0 only
    reports it (memory held by an orphaned worker shows up here).
    ``max_gpu_temp_c`` (90): core temperature above this fails.
    ``max_power_frac`` (1.05): power draw above the enforced limit times this fails.
    ``max_ecc_uncorrected_volatile`` (0): uncorrected ECC errors since the driver loaded.
    ``max_ecc_uncorrected_aggregate`` (None): lifetime uncorrected errors; None only
    reports them (they persist across resets even after the pages were retired, so a
    default limit would condemn a repaired GPU forever).
    ``max_retired_pages`` (None): retired pages in total; None only reports them.
    ``min_free_disk_bytes`` (1 GiB): per staging directory and local store path.
    ``min_free_host_mem_bytes`` (0): available RAM; 0 only reports it.
    ``probe_timeout_s`` (30): the most a group of checks (GPUs, disks, store, host) may
    take before it fails as hung.
    ``store_max_attempts`` (3) and ``store_timeout_s`` (10): the S3 client's attempts
    per request and connect/read timeout for the store probe.
    """

    expected_gpus: int | None = None
    min_free_gpu_mem_frac: float = 0.0
    max_gpu_temp_c: float = 90.0
    max_power_frac: float = 1.05
    max_ecc_uncorrected_volatile: int = 0
    max_ecc_uncorrected_aggregate: int | None = None
    max_retired_pages: int | None = None
    min_free_disk_bytes: int = GiB
    min_free_host_mem_bytes: int = 0
    probe_timeout_s: float = 30.0
    store_max_attempts: int = 3
    store_timeout_s: float = 10.0

    def __post_init__(self):
        if not 0.0 <= self.min_free_gpu_mem_frac <= 1.0:
            raise ValueError(f"min_free_gpu_mem_frac must be within [0, 1], got {self.min_free_gpu_mem_frac}")
        for name in ("expected_gpus", "max_ecc_uncorrected_aggregate", "max_retired_pages"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {v}")
        for name in ("max_power_frac", "max_ecc_uncorrected_volatile", "min_free_disk_bytes",
                     "min_free_host_mem_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("probe_timeout_s", "store_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.store_max_attempts < 1:
            raise ValueError(f"store_max_attempts must be >= 1, got {self.store_max_attempts}")


def healthy(checks: list[Check]) -> bool:
    return all(c.ok for c in checks)


def _error_text(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _host_tag() -> str:
    """``<hostname>-<pid>-<8 hex>``, safe as one key component and as a file name."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname() or "host").strip(".") or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


# ---------------------------------------------------------------------------- GPUs (NVML)
class _NA(Exception):
    """NVML has no answer for this device (Not Supported / Function Not Found)."""


class _Gpu:
    """The pynvml module and one device handle; ``call`` turns "not supported" into _NA."""

    def __init__(self, nvml, index: int, handle):
        self.nvml, self.index, self.handle = nvml, index, handle
        self.label = f"gpu{index}"

    def call(self, fn_name: str, *args):
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:  # an older nvidia-ml-py without this function
            raise _NA(fn_name)
        try:
            return fn(self.handle, *args)
        except self.nvml.NVMLError as e:
            if getattr(e, "value", None) in _na_codes(self.nvml):
                raise _NA(fn_name) from e
            raise


def _na_codes(nvml) -> set:
    return {getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)}


def _text(s) -> str:
    return s.decode(errors="replace") if isinstance(s, bytes) else str(s)


def _gpu_visible(g: _Gpu, lim: HealthLimits) -> Check:
    name = _text(g.call("nvmlDeviceGetName"))
    uuid = _text(g.call("nvmlDeviceGetUUID"))
    g.label = f"gpu{g.index} ({name})"
    return Check("visible", True, f"{name} {uuid}", {"name": name, "uuid": uuid})


def _gpu_memory(g: _Gpu, lim: HealthLimits) -> Check:
    info = g.call("nvmlDeviceGetMemoryInfo")
    free, total = int(info.free), int(info.total)
    frac = free / total if total else 0.0
    ok = frac >= lim.min_free_gpu_mem_frac
    detail = f"{free / GiB:.1f} of {total / GiB:.1f} GiB free ({frac:.0%})"
    if not ok:
        detail += f" < {lim.min_free_gpu_mem_frac:.0%} required (another process holds it?)"
    return Check("memory", ok, detail, {"free_bytes": free, "total_bytes": total, "free_frac": round(frac, 4)})


def _gpu_temperature(g: _Gpu, lim: HealthLimits) -> Check:
    t = g.call("nvmlDeviceGetTemperature", getattr(g.nvml, "NVML_TEMPERATURE_GPU", 0))
    ok = t <= lim.max_gpu_temp_c
    return Check("temperature", ok, f"{t} C" if ok else f"{g.label}: {t} C > {lim.max_gpu_temp_c:g} C limit",
                 {"temp_c": t, "max_c": lim.max_gpu_temp_c})


def _gpu_power(g: _Gpu, lim: HealthLimits) -> Check:
    draw_w = g.call("nvmlDeviceGetPowerUsage") / 1000.0
    limit_w = g.call("nvmlDeviceGetEnforcedPowerLimit") / 1000.0
    allowed = limit_w * lim.max_power_frac
    ok = draw_w <= allowed
    detail = f"{draw_w:.0f} W of {limit_w:.0f} W enforced limit"
    if not ok:
        detail = (f"{g.label}: {draw_w:.0f} W > {allowed:.0f} W "
                  f"({lim.max_power_frac:g} x {limit_w:.0f} W enforced limit)")
    return Check("power", ok, detail, {"draw_w": draw_w, "limit_w": limit_w})


def _gpu_ecc(g: _Gpu, lim: HealthLimits) -> Check:
    n = g.nvml
    unc = getattr(n, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    vol = g.call("nvmlDeviceGetTotalEccErrors", unc, getattr(n, "NVML_VOLATILE_ECC", 0))
    agg = g.call("nvmlDeviceGetTotalEccErrors", unc, getattr(n, "NVML_AGGREGATE_ECC", 1))
    bad = []
    if vol > lim.max_ecc_uncorrected_volatile:
        bad.append(f"{vol} uncorrected since driver load > {lim.max_ecc_uncorrected_volatile}")
    if lim.max_ecc_uncorrected_aggregate is not None and agg > lim.max_ecc_uncorrected_aggregate:
        bad.append(f"{agg} uncorrected lifetime > {lim.max_ecc_uncorrected_aggregate}")
    detail = f"{g.label}: " + "; ".join(bad) if bad else f"uncorrected: {vol} volatile, {agg} aggregate"
    return Check("ecc", not bad, detail, {"uncorrected_volatile": vol, "uncorrected_aggregate": agg})


def _gpu_retired_pages(g: _Gpu, lim: HealthLimits) -> Check:
    n = g.nvml
    pending = int(g.call("nvmlDeviceGetRetiredPagesPendingStatus"))
    total = 0
    for cause in (getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0),
                  getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1)):
        try:
            total += len(g.call("nvmlDeviceGetRetiredPages", cause))
        except _NA:
            pass
    bad = []
    if pending:
        bad.append("page retirement pending (reset the GPU)")
    if lim.max_retired_pages is not None and total > lim.max_retired_pages:
        bad.append(f"{total} retired pages > {lim.max_retired_pages}")
    detail = f"{g.label}: " + "; ".join(bad) if bad else f"{total} retired, none pending"
    return Check("retired_pages", not bad, detail, {"retired": total, "pending": bool(pending)})


def _gpu_remapped_rows(g: _Gpu, lim: HealthLimits) -> Check:
    corr, unc, pending, failure = (int(x) for x in g.call("nvmlDeviceGetRemappedRows"))
    bad = []
    if failure:
        bad.append("row remapping failed")
    if pending:
        bad.append("row remapping pending (reset the GPU)")
    detail = f"{g.label}: " + "; ".join(bad) if bad else f"{corr} correctable, {unc} uncorrectable rows remapped"
    return Check("remapped_rows", not bad, detail,
                 {"correctable": corr, "uncorrectable": unc, "pending": bool(pending), "failure": bool(failure)})


def _gpu_pcie(g: _Gpu, lim: HealthLimits) -> Check:
    gen, max_gen = g.call("nvmlDeviceGetCurrPcieLinkGeneration"), g.call("nvmlDeviceGetMaxPcieLinkGeneration")
    width, max_width = g.call("nvmlDeviceGetCurrPcieLinkWidth"), g.call("nvmlDeviceGetMaxPcieLinkWidth")
    ok = width >= max_width
    detail = f"gen {gen}/{max_gen} x{width}/x{max_width}"
    if not ok:
        detail = f"{g.label}: PCIe link degraded: x{width} of x{max_width} lanes (gen {gen} of {max_gen})"
    elif gen < max_gen:
        detail += " (a lower generation at idle is power saving)"
    return Check("pcie", ok, detail, {"gen": gen, "max_gen": max_gen, "width": width, "max_width": max_width})


# Clock event reason bits (nvmlClocksEventReason*; the same values as the older
# nvmlClocksThrottleReason* names).
_HW_SLOWDOWN = {0x08: "hw_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake"}
_SW_REASONS = {0x04: "sw_power_cap", 0x20: "sw_thermal_slowdown", 0x10: "sync_boost",
               0x02: "applications_clocks", 0x100: "display_clocks"}


def _gpu_clocks(g: _Gpu, lim: HealthLimits) -> Check:
    try:
        mask = int(g.call("nvmlDeviceGetCurrentClocksEventReasons"))
    except _NA:
        mask = int(g.call("nvmlDeviceGetCurrentClocksThrottleReasons"))
    hw = [name for bit, name in _HW_SLOWDOWN.items() if mask & bit]
    sw = [name for bit, name in _SW_REASONS.items() if mask & bit]
    if hw:
        detail = f"{g.label}: hardware slowdown: {', '.join(hw + sw)}"
    else:
        detail = f"throttled: {', '.join(sw)} (software, not a fault)" if sw else "no throttling"
    return Check("clocks", not hw, detail, {"reasons_mask": mask, "hw_slowdown": hw, "sw": sw})


GPU_RULES = (_gpu_visible, _gpu_memory, _gpu_temperature, _gpu_power, _gpu_ecc, _gpu_retired_pages,
             _gpu_remapped_rows, _gpu_pcie, _gpu_clocks)


def _driver_gpu_count() -> int:
    """GPUs the NVIDIA kernel driver registered (/proc/driver/nvidia/gpus), for a hint
    when NVML is missing; 0 when the file tree is absent."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _none(reason: str, lim: HealthLimits) -> list[Check]:
    hint = _driver_gpu_count()
    detail = "none" + (f" ({reason})" if reason else "")
    if hint:
        detail += f"; the NVIDIA driver lists {hint} GPU(s) in /proc/driver/nvidia/gpus"
    ok = not lim.expected_gpus
    if not ok:
        detail += f"; {lim.expected_gpus} expected"
    return [Check("gpus", ok, detail, {"count": 0, "expected": lim.expected_gpus})]


def _select(nvml, count: int) -> tuple[list[int], str | None, str]:
    """(device indices to check, a problem with CUDA_VISIBLE_DEVICES or None, a note):
    CUDA's rules, without CUDA: entries up to the first invalid one, each an index or
    a UUID prefix; "-1" or an empty value hides every device."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count)), None, ""
    note = f"CUDA_VISIBLE_DEVICES={env!r}"
    entries = [e.strip() for e in env.split(",")]
    if any(e.upper().startswith("MIG-") for e in entries):
        return list(range(count)), None, f"{note}: MIG instances, every device checked"
    uuids: list[str] | None = None
    chosen: list[int] = []
    for e in entries:
        if not e:
            break
        if re.fullmatch(r"-?\d+", e):
            i = int(e)
            if i < 0:
                break
            if i >= count:
                return chosen, f"{note} names device {i}, NVML sees {count}", note
        else:
            if uuids is None:
                uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(j))) for j in range(count)]
            match = [j for j, u in enumerate(uuids) if u.startswith(e) or u.startswith("GPU-" + e)]
            if len(match) != 1:
                return chosen, f"{note}: {e!r} matches {len(match)} of the {count} devices NVML sees", note
            i = match[0]
        if i not in chosen:
            chosen.append(i)
    return chosen, None, note


def gpu_checks(lim: HealthLimits, rules=GPU_RULES) -> list[Check]:
    """The ``gpus`` check and each selected device's ``rules`` (default all; see the
    module docstring)."""
    try:
        import pynvml as nvml
    except ImportError:
        return _none("pynvml not installed: pip install 'ckptstore[gpu]'", lim)
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        absent = {getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12), getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9)}
        if getattr(e, "value", None) in absent:
            return _none(f"NVML: {_text(e)}", lim)
        return [Check("gpus", False, f"NVML failed to start: {_error_text(e)}")]
    try:
        return _device_checks(nvml, lim, rules)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down; the checks are made
            pass


def _device_checks(nvml, lim: HealthLimits, rules=GPU_RULES) -> list[Check]:
    try:
        count = int(nvml.nvmlDeviceGetCount())
        indices, problem, note = _select(nvml, count)
    except nvml.NVMLError as e:
        return [Check("gpus", False, f"NVML cannot list devices: {_error_text(e)}")]
    if count == 0:
        return _none("NVML sees no device", lim)
    value = {"count": len(indices), "nvml_count": count, "expected": lim.expected_gpus}
    if problem:
        out = [Check("gpus", False, problem, value)]
    elif lim.expected_gpus is not None and len(indices) < lim.expected_gpus:
        out = [Check("gpus", False, f"{len(indices)} visible < {lim.expected_gpus} expected"
                     + (f" ({note})" if note else ""), value)]
    else:
        out = [Check("gpus", True, f"{len(indices)} visible" + (f" ({note})" if note else ""), value)]
    for i in indices:
        try:
            g = _Gpu(nvml, i, nvml.nvmlDeviceGetHandleByIndex(i))
        except nvml.NVMLError as e:
            out.append(Check(f"gpu{i}.visible", False, f"gpu{i}: {_error_text(e)}"))
            continue
        for rule in rules:
            name = f"gpu{i}.{rule.__name__[len('_gpu_'):]}"
            try:
                c = rule(g, lim)
                out.append(Check(name, c.ok, c.detail, c.value))
            except _NA:
                out.append(Check(name, True, "n/a"))
            except Exception as e:  # noqa: BLE001 - an NVML error fails this check only
                out.append(Check(name, False, f"{g.label}: {_error_text(e)}"))
    return out


def gpu_memory_used() -> dict[str, tuple[int, int]] | None:
    """``{uuid: (used bytes, total bytes)}`` of each selected device (as
    ``CUDA_VISIBLE_DEVICES`` selects), or None without NVML or devices, or when NVML
    fails: the supervisor waits on these for a previous attempt's memory to be freed."""
    try:
        import pynvml as nvml
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML, no readings
        return None
    try:
        indices, _, _ = _select(nvml, int(nvml.nvmlDeviceGetCount()))
        out = {}
        for i in indices:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            out[_text(nvml.nvmlDeviceGetUUID(handle))] = (int(info.used), int(info.total))
        return out or None
    except Exception:  # noqa: BLE001 - a reading that fails is no reading
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------- disks
def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def _disk_free(path: str, subject: str, lim: HealthLimits) -> Check:
    name = f"disk.free:{subject}"
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check(name, False, _error_text(e))
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    ok = free >= lim.min_free_disk_bytes
    detail = f"{free / GiB:.1f} of {total / GiB:.1f} GiB free"
    if path != subject:
        detail += f" (at {path}: the store does not exist yet)"
    if not ok:
        detail += f" < {lim.min_free_disk_bytes / GiB:.2f} GiB required"
    return Check(name, ok, detail, {"free_bytes": free, "total_bytes": total, "min_bytes": lim.min_free_disk_bytes})


def _disk_write(path: str) -> Check:
    """Create (exclusively), write, fsync and remove a probe file in ``path``."""
    name = f"disk.write:{path}"
    probe = os.path.join(path, f".ckptstore-health-{_host_tag()}")
    t0 = time.monotonic()
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, b"ckptstore health probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return Check(name, False, f"not writable: {_error_text(e)}")
    ms = (time.monotonic() - t0) * 1000
    return Check(name, True, f"writable ({ms:.1f} ms create+fsync+unlink)", {"probe_ms": round(ms, 3)})


def disk_checks(staging_dirs, store_path: str | None, lim: HealthLimits) -> list[Check]:
    out: list[Check] = []
    seen: set[str] = set()
    for d in staging_dirs:
        d = os.path.abspath(os.fspath(d))
        if d in seen:
            continue
        seen.add(d)
        if not os.path.isdir(d):
            try:
                os.stat(d)
                why = "is not a directory"
            except (FileNotFoundError, NotADirectoryError):
                why = "does not exist"
            except OSError as e:
                why = f"cannot be reached: {_error_text(e)}"
            out.append(Check(f"disk.free:{d}", False, f"staging directory {why} (a missing mount?)"))
            continue
        out.append(_disk_free(d, d, lim))
        out.append(_disk_write(d))
    if store_path is not None:
        p = os.path.abspath(store_path)
        if p not in seen:  # a store inside a staging directory was measured above
            out.append(_disk_free(_nearest_existing(p), p, lim))
    return out


# ---------------------------------------------------------------------------- store
def local_store_path(store_url: str) -> str | None:
    """The directory of a local store (a path or ``file://`` URL), else None."""
    from ..storage.urls import parse_location

    try:
        scheme, rest = parse_location(os.fspath(store_url))
    except ValueError:  # refused: the store check says why
        return None
    return rest if scheme in (None, "file") else None


def store_check(store_url: str, lim: HealthLimits) -> Check:
    """Reachable and writable: a create-only probe under PROBE_PREFIX, read back, deleted."""
    from ..storage import open_storage
    from ..storage.urls import shown as shown_url

    shown = shown_url(store_url)
    key = PROBE_PREFIX + _host_tag()
    payload = json.dumps({"probe": key, "host": socket.gethostname(), "pid": os.getpid(),
                          "time": time.time()}).encode()
    t0 = time.monotonic()
    try:
        options = {}
        if str(store_url).startswith("s3://"):
            options = {"max_attempts": lim.store_max_attempts, "connect_timeout": lim.store_timeout_s,
                       "read_timeout": lim.store_timeout_s}
        storage = open_storage(store_url, **options)
        storage.put(key, payload, if_absent=True)
        try:
            got = storage.read(key)
        finally:
            storage.delete(key)
        if got != payload:
            return Check("store", False, f"{shown}: probe {key} read back {len(got)} bytes that differ "
                         f"from the {len(payload)} written")
    except Exception as e:  # noqa: BLE001 - any failure to reach or write the store
        text = _error_text(e)
        return Check("store", False, text if shown in text else f"{shown}: {text}")
    ms = (time.monotonic() - t0) * 1000
    return Check("store", True, f"{shown}: writable ({ms:.0f} ms put+get+delete)", {"probe_ms": round(ms, 3)})


# ---------------------------------------------------------------------------- host
def _meminfo() -> tuple[int, int] | None:
    """(available, total) bytes from /proc/meminfo, or psutil, or None."""
    try:
        with open("/proc/meminfo") as f:
            fields = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f) if v.strip()}
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def host_checks(lim: HealthLimits) -> list[Check]:
    mem = _meminfo()
    if mem is None:
        return [Check("host.memory", lim.min_free_host_mem_bytes == 0, "n/a (no /proc/meminfo, no psutil)")]
    avail, total = mem
    ok = avail >= lim.min_free_host_mem_bytes
    detail = f"{avail / GiB:.1f} of {total / GiB:.1f} GiB available"
    if not ok:
        detail += f" < {lim.min_free_host_mem_bytes / GiB:.2f} GiB required"
    return [Check("host.memory", ok, detail, {"available_bytes": avail, "total_bytes": total,
                                              "min_bytes": lim.min_free_host_mem_bytes})]


# ---------------------------------------------------------------------------- running
def _run_bounded(groups, timeout: float) -> list[Check]:
    """Run each (name, fn) group in its own daemon thread; a group that does not finish
    within ``timeout`` seconds becomes one failed check (its thread is abandoned)."""
    results: list = [None] * len(groups)

    def runner(i, fn):
        try:
            results[i] = fn()
        except Exception as e:  # noqa: BLE001 - a bug in a check must not hide the others
            results[i] = e

    threads = []
    for i, (name, fn) in enumerate(groups):
        t = threading.Thread(target=runner, args=(i, fn), name=f"ckptstore-health-{name}", daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout
    out: list[Check] = []
    for i, ((name, _), t) in enumerate(zip(groups, threads)):
        t.join(max(0.0, deadline - time.monotonic()))
        r = results[i]
        if t.is_alive():
            out.append(Check(name, False, f"no answer within {timeout:g} s (hung?)"))
        elif isinstance(r, Exception):
            out.append(Check(name, False, f"check crashed: {_error_text(r)}"))
        else:
            out.extend(r)
    return out


def check_node(store_url: str | None = None, staging_dirs=(), limits: HealthLimits = HealthLimits()) -> list[Check]:
    """Every check of this node (see the module docstring), in a fixed order: GPUs,
    disks, store, host memory. Never raises for an unhealthy node: read :func:`healthy`."""
    store_path = local_store_path(store_url) if store_url is not None else None
    groups = [("gpus", lambda: gpu_checks(limits)),
              ("disks", lambda: disk_checks(list(staging_dirs), store_path, limits))]
    if store_url is not None:
        groups.append(("store", lambda: [store_check(store_url, limits)]))
    groups.append(("host.memory", lambda: host_checks(limits)))
    return _run_bounded(groups, limits.probe_timeout_s)


# ---------------------------------------------------------------------------- output
def checks_json(checks: list[Check]) -> list[dict]:
    """Each check as ``{"name", "ok", "detail", "value"}`` (value: a dict or null)."""
    return [asdict(c) for c in checks]


def format_checks(checks: list[Check]) -> str:
    """A short aligned table: status, name, detail; then a one-line verdict."""
    width = max((len(c.name) for c in checks), default=0)
    lines = [f"{'ok  ' if c.ok else 'FAIL'}  {c.name.ljust(width)}  {c.detail}" for c in checks]
    failed = sum(not c.ok for c in checks)
    lines.append("healthy" if not failed else f"UNHEALTHY: {failed} of {len(checks)} checks failed")
    return "\n".join(lines)


def health_main(store_url: str | None, staging_dirs=(), as_json: bool = False,
                limits: HealthLimits | None = None, out=None) -> int:
    """Run the checks, print them (table, or a JSON list) and return 0 when the node is
    healthy, :data:`EXIT_UNHEALTHY` when not. For ``ckptstore doctor --health``."""
    out = out or sys.stdout
    checks = check_node(store_url, list(staging_dirs), limits or HealthLimits())
    if as_json:
        print(json.dumps(checks_json(checks), indent=2), file=out)
    else:
        print(format_checks(checks), file=out)
    return 0 if healthy(checks) else EXIT_UNHEALTHY
