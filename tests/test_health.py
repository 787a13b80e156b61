"""Node health checks (ckptstore/supervisor/health.py): GPUs through NVML, disks, the
store, host memory, the table/JSON output and ``health_main``'s exit codes.

No GPU and no NVIDIA driver exist where these tests run, so the GPU rules run against
:class:`FakeNvml`, a small stand-in for the ``pynvml`` module (nvidia-ml-py) injected
with ``monkeypatch.setitem(sys.modules, "pynvml", fake)``. That is acceptable only
because no real NVML can run here; to keep the fake honest,
``test_fake_matches_real_pynvml`` checks that every function the checks call exists in
the real module with a compatible signature and that every constant has the real value.
The real module's no-driver path (NVML library not found) runs too.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import sys
import threading
import time
import types
from dataclasses import FrozenInstanceError, dataclass, field

import pytest

from ckptstore.storage import open_storage
from ckptstore.supervisor import health
from ckptstore.supervisor.health import (
    EXIT_UNHEALTHY,
    PROBE_PREFIX,
    Check,
    HealthLimits,
    check_node,
    checks_json,
    format_checks,
    gpu_checks,
    health_main,
    healthy,
)

GiB = 1 << 30
RULES = ("visible", "memory", "temperature", "power", "ecc", "retired_pages", "remapped_rows", "pcie", "clocks")

# ---------------------------------------------------------------------------- fake NVML
NOT_SUPPORTED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, FUNCTION_NOT_FOUND = 3, 9, 12, 13
GPU_IS_LOST, LIB_RM_VERSION_MISMATCH, UNKNOWN = 15, 18, 999
ERROR_TEXT = {NOT_SUPPORTED: "Not Supported", DRIVER_NOT_LOADED: "Driver Not Loaded",
              LIBRARY_NOT_FOUND: "NVML Shared Library Not Found", FUNCTION_NOT_FOUND: "Function Not Found",
              GPU_IS_LOST: "GPU is lost", LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
              UNKNOWN: "Unknown Error"}


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")


@dataclass
class Dev:
    """One fake device: healthy defaults (an H100-like GPU at idle)."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-1111-2222-3333-444444444444"
    free: int = 79 * GiB
    total: int = 80 * GiB
    temp: int = 35
    power_mw: int = 70_000
    limit_mw: int = 700_000
    ecc_volatile: int = 0
    ecc_aggregate: int = 0
    pending: int = 0
    retired: dict = field(default_factory=lambda: {0: [], 1: []})
    remapped: tuple = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    pcie: tuple = (1, 5, 16, 16)  # gen, max gen, width, max width (gen 1 at idle)
    reasons: int = 0x1  # GPU idle
    errors: dict = field(default_factory=dict)  # pynvml function name -> error code it raises
    lost: bool = False  # nvmlDeviceGetHandleByIndex fails


class FakeNvml(types.ModuleType):
    """The part of pynvml the health checks use, over a list of :class:`Dev`."""

    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_DRIVER_NOT_LOADED = DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = FUNCTION_NOT_FOUND
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1

    def __init__(self, devices=(), init_error: int | None = None):
        super().__init__("pynvml")
        self.devices = list(devices)
        self.init_error = init_error
        self.initialised = 0
        self.calls: list[str] = []

    def _dev(self, fn: str, handle: Dev) -> Dev:
        assert self.initialised > 0, f"{fn} called outside nvmlInit/nvmlShutdown"
        self.calls.append(fn)
        if fn in handle.errors:
            raise NVMLError(handle.errors[fn])
        return handle

    def nvmlInit(self):
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        d = self.devices[index]
        if d.lost:
            raise NVMLError(GPU_IS_LOST)
        return d

    def nvmlDeviceGetName(self, handle):
        return self._dev("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle):
        return self._dev("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        d = self._dev("nvmlDeviceGetMemoryInfo", handle)
        return types.SimpleNamespace(free=d.free, total=d.total, used=d.total - d.free)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._dev("nvmlDeviceGetTemperature", handle).temp

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._dev("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._dev("nvmlDeviceGetEnforcedPowerLimit", handle).limit_mw

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        d = self._dev("nvmlDeviceGetTotalEccErrors", handle)
        assert errorType == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return d.ecc_volatile if counterType == self.NVML_VOLATILE_ECC else d.ecc_aggregate

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device):
        return self._dev("nvmlDeviceGetRetiredPagesPendingStatus", device).pending

    def nvmlDeviceGetRetiredPages(self, device, sourceFilter):
        return list(self._dev("nvmlDeviceGetRetiredPages", device).retired[sourceFilter])

    def nvmlDeviceGetRemappedRows(self, device):
        return self._dev("nvmlDeviceGetRemappedRows", device).remapped

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return self._dev("nvmlDeviceGetCurrPcieLinkGeneration", handle).pcie[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        return self._dev("nvmlDeviceGetMaxPcieLinkGeneration", handle).pcie[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return self._dev("nvmlDeviceGetCurrPcieLinkWidth", handle).pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        return self._dev("nvmlDeviceGetMaxPcieLinkWidth", handle).pcie[3]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._dev("nvmlDeviceGetCurrentClocksEventReasons", handle).reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._dev("nvmlDeviceGetCurrentClocksThrottleReasons", handle).reasons


def two_gpus(**second) -> list[Dev]:
    return [Dev(), Dev(uuid="GPU-99999999-1111-2222-3333-444444444444", **second)]


@pytest.fixture
def nvml(monkeypatch):
    """Install a FakeNvml as ``pynvml``: ``nvml(devices, init_error=None)`` returns it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(devices=(), init_error=None):
        fake = FakeNvml(devices, init_error)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


def by_name(checks) -> dict[str, Check]:
    names = [c.name for c in checks]
    assert len(names) == len(set(names)), names
    return {c.name: c for c in checks}


def failed(checks) -> list[str]:
    return [c.name for c in checks if not c.ok]


# ---------------------------------------------------------------------------- no GPU
def test_no_gpu_real_pynvml_passes_with_none(tmp_path):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine: the no-GPU path does not apply")
    checks = check_node(str(tmp_path / "store"), [str(tmp_path)])
    c = by_name(checks)
    assert c["gpus"].ok and c["gpus"].detail.startswith("none")
    assert not any(n.startswith("gpu0") for n in c)
    assert healthy(checks), format_checks(checks)


def test_no_pynvml_module_passes_with_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    checks = gpu_checks(HealthLimits())
    assert [(c.name, c.ok) for c in checks] == [("gpus", True)]
    assert checks[0].detail.startswith("none") and "not installed" in checks[0].detail
    # a node that must have GPUs fails without them
    [c] = gpu_checks(HealthLimits(expected_gpus=8))
    assert not c.ok and "8 expected" in c.detail


@pytest.mark.parametrize("code", [LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED])
def test_no_nvml_library_or_driver_is_none(nvml, code):
    nvml(init_error=code)
    [c] = gpu_checks(HealthLimits())
    assert c.name == "gpus" and c.ok and c.detail.startswith("none") and ERROR_TEXT[code] in c.detail
    [c] = gpu_checks(HealthLimits(expected_gpus=1))
    assert not c.ok


def test_zero_devices_is_none(nvml):
    fake = nvml([])
    [c] = gpu_checks(HealthLimits())
    assert c.ok and c.detail.startswith("none") and c.value["count"] == 0
    assert fake.initialised == 0  # shut down again


def test_other_init_error_fails(nvml):
    nvml(init_error=LIB_RM_VERSION_MISMATCH)  # driver upgraded without a reboot
    [c] = gpu_checks(HealthLimits())
    assert c.name == "gpus" and not c.ok and "version mismatch" in c.detail


# ---------------------------------------------------------------------------- GPU rules
def test_healthy_gpus_every_rule_ok(nvml):
    fake = nvml(two_gpus())
    checks = gpu_checks(HealthLimits(expected_gpus=2))
    assert [c.name for c in checks] == ["gpus"] + [f"gpu{i}.{r}" for i in (0, 1) for r in RULES]
    assert failed(checks) == []
    c = by_name(checks)
    assert c["gpus"].value["count"] == 2
    assert c["gpu0.temperature"].value == {"temp_c": 35, "max_c": 90.0}
    assert c["gpu1.visible"].value["uuid"].startswith("GPU-9999")
    assert c["gpu0.power"].value == {"draw_w": 70.0, "limit_w": 700.0}
    assert c["gpu0.pcie"].value == {"gen": 1, "max_gen": 5, "width": 16, "max_width": 16}
    assert "power saving" in c["gpu0.pcie"].detail  # gen 1 of 5 at idle: reported, ok
    assert fake.initialised == 0
    # fewer than expected fails
    [gpus] = [x for x in gpu_checks(HealthLimits(expected_gpus=3)) if x.name == "gpus"]
    assert not gpus.ok and "2 visible < 3 expected" in gpus.detail


def test_hot_gpu_fails_naming_device_and_temperature(nvml):
    nvml(two_gpus(temp=95))
    checks = gpu_checks(HealthLimits())
    assert failed(checks) == ["gpu1.temperature"]
    c = by_name(checks)["gpu1.temperature"]
    assert "gpu1 (NVIDIA H100 80GB HBM3)" in c.detail and "95 C" in c.detail and "90 C" in c.detail
    assert c.value["temp_c"] == 95
    assert failed(gpu_checks(HealthLimits(max_gpu_temp_c=95))) == []  # the limit is the limit


def test_pending_page_retirement_fails(nvml):
    nvml([Dev(pending=1, retired={0: [0x1000, 0x2000], 1: [0x3000]})])
    c = by_name(gpu_checks(HealthLimits()))["gpu0.retired_pages"]
    assert not c.ok and "pending" in c.detail and c.value == {"retired": 3, "pending": True}


def test_retired_pages_count_limit(nvml):
    nvml([Dev(retired={0: [1, 2], 1: [3]})])
    assert by_name(gpu_checks(HealthLimits()))["gpu0.retired_pages"].ok  # reported only
    c = by_name(gpu_checks(HealthLimits(max_retired_pages=2)))["gpu0.retired_pages"]
    assert not c.ok and "3 retired pages > 2" in c.detail


def test_degraded_pcie_width_fails(nvml):
    nvml([Dev(pcie=(5, 5, 8, 16))])
    c = by_name(gpu_checks(HealthLimits()))["gpu0.pcie"]
    assert not c.ok and "x8 of x16" in c.detail and "gen 5 of 5" in c.detail


def test_not_supported_is_na_and_ok(nvml):
    na = {fn: NOT_SUPPORTED for fn in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors",
                                       "nvmlDeviceGetRemappedRows", "nvmlDeviceGetCurrPcieLinkWidth")}
    nvml([Dev(errors=na)])
    checks = gpu_checks(HealthLimits())
    c = by_name(checks)
    for rule in ("power", "ecc", "remapped_rows", "pcie"):
        assert c[f"gpu0.{rule}"].ok and c[f"gpu0.{rule}"].detail == "n/a", rule
    assert c["gpu0.temperature"].detail != "n/a"
    assert failed(checks) == []


def test_nvml_error_fails_only_that_check(nvml):
    nvml(two_gpus(errors={"nvmlDeviceGetTemperature": UNKNOWN}))
    checks = gpu_checks(HealthLimits())
    assert failed(checks) == ["gpu1.temperature"]
    c = by_name(checks)["gpu1.temperature"]
    assert "gpu1" in c.detail and "Unknown Error" in c.detail


def test_lost_gpu_fails_visible(nvml):
    nvml(two_gpus(lost=True))
    checks = gpu_checks(HealthLimits())
    assert failed(checks) == ["gpu1.visible"]
    assert "GPU is lost" in by_name(checks)["gpu1.visible"].detail
    assert not any(c.name.startswith("gpu1.") and c.name != "gpu1.visible" for c in checks)


def test_power_ecc_remap_memory_limits(nvml):
    nvml([Dev(power_mw=800_000), Dev(ecc_volatile=2, ecc_aggregate=5), Dev(remapped=(3, 1, 1, 0)),
          Dev(remapped=(0, 0, 0, 1), free=1 * GiB)])
    c = by_name(gpu_checks(HealthLimits()))
    assert not c["gpu0.power"].ok and "800 W > 735 W" in c["gpu0.power"].detail
    assert not c["gpu1.ecc"].ok and "2 uncorrected since driver load" in c["gpu1.ecc"].detail
    assert not c["gpu2.remapped_rows"].ok and "pending" in c["gpu2.remapped_rows"].detail
    assert not c["gpu3.remapped_rows"].ok and "failed" in c["gpu3.remapped_rows"].detail
    assert c["gpu3.memory"].ok  # 0.0: informational by default
    assert c["gpu3.memory"].value["free_frac"] == pytest.approx(1 / 80, abs=1e-4)
    assert c["gpu0.ecc"].ok
    c = by_name(gpu_checks(HealthLimits(min_free_gpu_mem_frac=0.5, max_power_frac=1.2)))
    assert not c["gpu3.memory"].ok and c["gpu0.memory"].ok and c["gpu0.power"].ok


def test_aggregate_ecc_reported_unless_limited(nvml):
    nvml([Dev(ecc_aggregate=4)])
    c = by_name(gpu_checks(HealthLimits()))["gpu0.ecc"]
    assert c.ok and c.value == {"uncorrected_volatile": 0, "uncorrected_aggregate": 4}
    c = by_name(gpu_checks(HealthLimits(max_ecc_uncorrected_aggregate=3)))["gpu0.ecc"]
    assert not c.ok and "4 uncorrected lifetime > 3" in c.detail


def test_clocks_hw_slowdown_fails_sw_throttle_warns(nvml):
    fake = nvml([Dev(reasons=0x08 | 0x40), Dev(reasons=0x04),
                 Dev(reasons=0x80, errors={"nvmlDeviceGetCurrentClocksEventReasons": FUNCTION_NOT_FOUND})])
    c = by_name(gpu_checks(HealthLimits()))
    assert not c["gpu0.clocks"].ok and "hw_slowdown" in c["gpu0.clocks"].detail
    assert "hw_thermal_slowdown" in c["gpu0.clocks"].detail
    assert c["gpu1.clocks"].ok and "sw_power_cap" in c["gpu1.clocks"].detail
    # an older driver without the "event reasons" name: the throttle-reasons one answers
    assert not c["gpu2.clocks"].ok and "hw_power_brake" in c["gpu2.clocks"].detail
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in fake.calls


def test_cuda_visible_devices_selects(nvml, monkeypatch):
    nvml(two_gpus(temp=99))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    checks = gpu_checks(HealthLimits())
    assert failed(checks) == [] and not any(c.name.startswith("gpu1") for c in checks)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-9999")  # a UUID prefix
    assert failed(gpu_checks(HealthLimits())) == ["gpu1.temperature"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,7")
    checks = gpu_checks(HealthLimits())
    assert failed(checks) == ["gpus"] and "names device 7, NVML sees 2" in checks[0].detail
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every device hidden
    assert [(c.name, c.ok, c.value["count"]) for c in gpu_checks(HealthLimits())] == [("gpus", True, 0)]
    assert failed(gpu_checks(HealthLimits(expected_gpus=1))) == ["gpus"]


def test_fake_matches_real_pynvml():
    """Every pynvml function the fake stands in for exists in nvidia-ml-py with a
    compatible signature, and every constant has the real value."""
    real = pytest.importorskip("pynvml")
    fake = FakeNvml()
    for name, fn in inspect.getmembers(FakeNvml, inspect.isfunction):
        if not name.startswith("nvml"):
            continue
        assert hasattr(real, name), name
        want = [p for p in inspect.signature(getattr(real, name)).parameters.values()]
        got = list(inspect.signature(getattr(fake, name)).parameters.values())
        assert [p.name for p in got] == [p.name for p in want], name
    for name in dir(FakeNvml):
        if name.startswith("NVML_"):
            assert getattr(real, name) == getattr(FakeNvml, name), name
    for code, text in ERROR_TEXT.items():
        assert str(real.NVMLError(code)) == text, code
    # the clock-reason bits the checks decode
    assert real.nvmlClocksEventReasonHwSlowdown == 0x08
    assert real.nvmlClocksThrottleReasonHwThermalSlowdown == 0x40
    assert real.nvmlClocksEventReasonHwPowerBrakeSlowdown == 0x80
    assert real.nvmlClocksEventReasonSwPowerCap == 0x04


# ---------------------------------------------------------------------------- disks
def test_disk_free_and_writable(tmp_path):
    d = tmp_path / "stage"
    d.mkdir()
    c = by_name(check_node(None, [str(d)]))
    assert c[f"disk.free:{d}"].ok and c[f"disk.free:{d}"].value["free_bytes"] > 0
    assert c[f"disk.write:{d}"].ok
    assert os.listdir(d) == []  # the probe file is gone


def test_disk_below_limit_fails(tmp_path):
    c = by_name(check_node(None, [str(tmp_path)], HealthLimits(min_free_disk_bytes=1 << 62)))
    free = c[f"disk.free:{tmp_path}"]
    assert not free.ok and "required" in free.detail and free.value["min_bytes"] == 1 << 62
    assert c[f"disk.write:{tmp_path}"].ok


def test_missing_staging_dir_fails_and_is_not_created(tmp_path):
    missing = tmp_path / "nope"
    under_file = tmp_path / "file" / "stage"
    (tmp_path / "file").write_bytes(b"x")
    checks = check_node(None, [str(missing), str(under_file)])
    assert set(failed(checks)) == {f"disk.free:{missing}", f"disk.free:{under_file}"}
    assert "does not exist" in by_name(checks)[f"disk.free:{missing}"].detail
    assert not missing.exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes through mode 0o500")
def test_unwritable_dir_fails_chmod(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        c = by_name(check_node(None, [str(d)]))[f"disk.write:{d}"]
        assert not c.ok and "PermissionError" in c.detail
    finally:
        d.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_unwritable_dir_fails_even_for_root():
    """/proc takes no new files, for root too (root bypasses mode bits)."""
    c = by_name(check_node(None, ["/proc"], HealthLimits(min_free_disk_bytes=0)))
    assert c["disk.free:/proc"].ok and not c["disk.write:/proc"].ok
    assert c["disk.write:/proc"].detail.startswith("not writable:")


# ---------------------------------------------------------------------------- store
def test_local_store_writable_and_left_clean(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    (root / "keep").write_bytes(b"k")
    checks = check_node(str(root))
    c = by_name(checks)
    assert c["store"].ok and "writable" in c["store"].detail
    assert c[f"disk.free:{root}"].ok
    assert [o.key for o in open_storage(str(root)).walk("")] == ["keep"]
    assert sorted(os.listdir(root)) == ["keep"]  # no journal/.health directories left either


def test_local_store_not_yet_created_is_measured_at_ancestor(tmp_path):
    root = tmp_path / "new" / "store"
    c = by_name(check_node(f"file://{root}"))
    assert c["store"].ok
    assert c[f"disk.free:{root}"].ok and f"at {tmp_path}" in c[f"disk.free:{root}"].detail


def test_local_store_unwritable_fails(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    root = tmp_path / "file" / "store"
    c = by_name(check_node(str(root)))["store"]
    assert not c.ok and str(root) in c.detail


def test_store_probe_key_is_reserved_and_deleted(monkeypatch):
    seen = []
    store = open_storage("memory://health-probe/x")
    real_put = type(store).put

    def spy(self, key, data, *, if_absent=False):
        seen.append((key, if_absent))
        return real_put(self, key, data, if_absent=if_absent)

    monkeypatch.setattr(type(store), "put", spy)
    c = health.store_check("memory://health-probe/x", HealthLimits())
    assert c.ok
    [(key, if_absent)] = seen
    assert if_absent and key.startswith(PROBE_PREFIX)
    assert key[len(PROBE_PREFIX):].split("-")[-2] == str(os.getpid())
    assert list(store.walk("")) == []


def test_hung_group_fails_by_timeout(monkeypatch, tmp_path):
    release = threading.Event()

    def stuck(url, lim):
        release.wait()
        return Check("store", True, "late")

    monkeypatch.setattr(health, "store_check", stuck)
    try:
        checks = check_node(str(tmp_path), limits=HealthLimits(probe_timeout_s=0.2))
        c = by_name(checks)["store"]
        assert not c.ok and "no answer within 0.2 s" in c.detail
        assert c.name == "store" and by_name(checks)["host.memory"].ok
    finally:
        release.set()


# ---------------------------------------------------------------------------- store on S3
@pytest.fixture
def s3(monkeypatch):
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    import s3util as util

    endpoint = util.moto_endpoint()
    for k in util.UNSET_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in util.aws_env(endpoint).items():
        monkeypatch.setenv(k, v)
    return util, endpoint


def test_s3_store_on_moto_passes(s3):
    util, endpoint = s3
    bucket = util.new_bucket(endpoint)
    try:
        c = health.store_check(f"s3://{bucket}/runs/a", HealthLimits())
        assert c.ok, c.detail
        assert util.admin_client(endpoint).list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    finally:
        util.empty_bucket(bucket, endpoint)


def test_s3_missing_bucket_fails(s3):
    c = health.store_check("s3://no-such-bucket-ckptstore-health/x", HealthLimits())
    assert not c.ok and "s3://no-such-bucket-ckptstore-health" in c.detail and "NoSuchBucket" in c.detail


def test_s3_unreachable_endpoint_fails_quickly(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    t0 = time.monotonic()
    c = health.store_check("s3://bucket/prefix", HealthLimits(store_max_attempts=1))
    elapsed = time.monotonic() - t0
    assert not c.ok and "s3://bucket/prefix" in c.detail
    assert "Could not connect" in c.detail and "127.0.0.1:1" in c.detail
    # one attempt per request, no retry pauses (the default, 3 attempts, takes seconds)
    assert elapsed < 5, elapsed


# ---------------------------------------------------------------------------- output and exit codes
def test_health_main_exit_codes_and_json(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    out = io.StringIO()
    assert health_main(str(tmp_path), [str(tmp_path)], as_json=False, out=out) == 0
    text = out.getvalue()
    assert text.rstrip().endswith("healthy") and "store" in text

    out = io.StringIO()
    rc = health_main(str(tmp_path), [str(tmp_path / "missing")], as_json=True, out=out)
    assert rc == EXIT_UNHEALTHY == 13
    doc = json.loads(out.getvalue())
    assert isinstance(doc, list) and all(set(d) == {"name", "ok", "detail", "value"} for d in doc)
    assert all(isinstance(d["ok"], bool) and isinstance(d["detail"], str) for d in doc)
    assert all(d["value"] is None or isinstance(d["value"], dict) for d in doc)
    assert [d["name"] for d in doc if not d["ok"]] == [f"disk.free:{tmp_path / 'missing'}"]
    assert {"gpus", "store", "host.memory"} <= {d["name"] for d in doc}


def test_health_main_prints_to_stdout(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert health_main(str(tmp_path), [], as_json=True) == 0
    assert json.loads(capsys.readouterr().out)[0]["name"] == "gpus"


def test_format_checks_aligned():
    checks = [Check("gpus", True, "none"), Check("disk.free:/a/long/path", False, "0.1 of 1 GiB free")]
    lines = format_checks(checks).splitlines()
    assert lines[0].startswith("ok") and lines[1].startswith("FAIL")
    assert lines[0].index("none") == lines[1].index("0.1 of")
    assert lines[-1] == "UNHEALTHY: 1 of 2 checks failed"
    assert checks_json(checks)[1] == {"name": "disk.free:/a/long/path", "ok": False,
                                      "detail": "0.1 of 1 GiB free", "value": None}


def test_host_memory_limit():
    [c] = health.host_checks(HealthLimits())
    assert c.ok and c.value["available_bytes"] > 0
    [c] = health.host_checks(HealthLimits(min_free_host_mem_bytes=1 << 62))
    assert not c.ok and "required" in c.detail


def test_limits_are_frozen_and_validated():
    lim = HealthLimits()
    assert (lim.max_gpu_temp_c, lim.max_power_frac, lim.min_free_disk_bytes) == (90.0, 1.05, GiB)
    with pytest.raises(FrozenInstanceError):
        lim.max_gpu_temp_c = 10
    for bad in ({"min_free_gpu_mem_frac": 1.5}, {"min_free_disk_bytes": -1}, {"expected_gpus": -1},
                {"probe_timeout_s": 0}, {"store_max_attempts": 0}):
        with pytest.raises(ValueError):
            HealthLimits(**bad)


def test_gpu_memory_used_reads_what_the_gate_waits_on(nvml, monkeypatch):
    """The readings ``ckptstore run`` waits on before a relaunch (supervisor/gate.py):
    used and total bytes of each selected device, None without NVML."""
    fake = nvml(two_gpus(free=30 * GiB))
    assert health.gpu_memory_used() == {Dev().uuid: (1 * GiB, 80 * GiB),
                                        "GPU-99999999-1111-2222-3333-444444444444": (50 * GiB, 80 * GiB)}
    assert fake.initialised == 0  # shut down again
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert list(health.gpu_memory_used()) == ["GPU-99999999-1111-2222-3333-444444444444"]
    nvml(init_error=DRIVER_NOT_LOADED)
    assert health.gpu_memory_used() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert health.gpu_memory_used() is None
