"""Issue 35, section 4, in process (no launcher): every section of a supervised rank
ends in bounded time (bounds learned from the run's journal, with floors and
ceilings), the node's health is checked during the run (a failing GPU: the preemption
save, then exit 13; no GPU: quiet), and stragglers are named by ``status`` and alerted
once per episode. Readings, clocks and progress reports are injected."""

from __future__ import annotations

import signal
import time

import pytest

import ckptstore
from ckptstore.cli_status import render
from ckptstore.supervisor import runner
from ckptstore.supervisor.classify import Verdict
from ckptstore.supervisor.health import Check, HealthLimits
from ckptstore.supervisor.progress import read_progress
from ckptstore.supervisor.sections import FLOORS, Sections
from ckptstore.supervisor.status import summarize
from ckptstore.supervisor.stragglers import ALERT_FACTOR, FACTOR, REPORTS, Tracker
from ckptstore.supervisor.watch import Finding, NodeWatch, run_checks

from test_health import Dev, FakeNvml  # the fake NVML of the health checks' tests


def _supervisor(tmp_path, monkeypatch, **policy) -> runner.Supervisor:
    monkeypatch.setattr(runner, "check_node", lambda *a, **k: [Check("node", True, "")])
    sup = runner.Supervisor(str(tmp_path / "run"), ["train.py"], runner.Policy(backoff_s=0, **policy))
    sup.kills = []
    monkeypatch.setattr(sup, "_kill", lambda signum: sup.kills.append(signum))
    return sup


def _events(sup, kind):
    return [e for e in sup.journal.events() if e["kind"] == kind]


class _Quiet:
    """A node watch that finds nothing."""

    def poll(self):
        return None


# ---------------------------------------------------------------------------- sections
def test_section_bounds_learned_with_floors_and_ceilings():
    s = Sections(runner.Policy())
    b = s.bound("save")
    assert (b.seconds, b.source, b.measured_s) == (1800.0, "ceiling", None)  # nothing measured
    s.observe("save", 200.0)
    assert (s.bound("save").seconds, s.bound("save").source) == (600.0, "learned")  # 3 x 200
    s.observe("save", 50.0)  # the longest counts
    assert s.bound("save").seconds == 600.0
    s2 = Sections(runner.Policy())
    s2.observe("resume", 10.0)
    assert (s2.bound("resume").seconds, s2.bound("resume").source) == (FLOORS["resume"], "floor")
    s2.observe("resume", 1000.0)
    assert (s2.bound("resume").seconds, s2.bound("resume").source) == (1800.0, "ceiling")
    off = Sections(runner.Policy(section_factor=0, save_timeout_s=900.0))
    off.observe("save", 10.0)
    assert (off.bound("save").seconds, off.bound("save").source) == (900.0, "ceiling")
    s3 = Sections(runner.Policy())
    s3.learn_from_journal([{"kind": "resume", "first_step_s": 400.0}, {"kind": "sections", "longest": {
        "save": "a lot", "resume": -5, "startup": float("nan")}}])  # hostile figures teach nothing
    assert s3.longest == {"startup": 400.0}
    assert s3.bound("startup").seconds == 1200.0


def test_a_save_stuck_on_a_dead_peer_is_ended_at_its_learned_bound_with_the_evidence(tmp_path, monkeypatch):
    """Before, a rank reporting `saving` held the hang clock: a save stuck on a dead
    peer ran until the process group's timeout (30 minutes on gloo)."""
    sup = _supervisor(tmp_path, monkeypatch)
    sup.journal.append("sections", attempt=0, longest={"save": 150.0, "step": 1.0})  # an earlier attempt's
    sup._learn_sections()
    now = time.time()
    progress = {0: {"state": "saving", "section": "save", "section_t": now - 400.0, "step": 40,
                    "first_step_t": now - 3000.0, "t": now - 400.0},
                1: {"state": "train", "section": "step", "section_t": now - 400.0, "step": 40,
                    "first_step_t": now - 3000.0, "t": now - 400.0}}
    assert sup._in_run_checks(1, progress, now - 3600.0, _Quiet()) is None  # 400 s < 3 x 150 s
    progress[0]["section_t"] = now - 500.0
    v = sup._in_run_checks(1, progress, now - 3600.0, _Quiet())
    assert v.klass == "hang" and "save section at step 40" in v.reason and "3 x the longest measured 150s" in v.reason
    assert sup.kills == [signal.SIGKILL]
    (e,) = _events(sup, "section_timeout")
    assert (e["section"], e["rank"], e["step"], e["bound_s"], e["source"], e["measured_s"]) == (
        "save", 0, 40, 450.0, "learned", 150.0)
    assert e["elapsed_s"] >= 500.0 and e["attempt"] == 1
    out = summarize(sup.journal.events(), now=time.time() + 1)
    assert out["section_timeouts"][0]["section"] == "save"
    assert "section timeout" in render({**out, "run": "r", "started_at": None})


def test_a_resume_with_nothing_measured_is_bounded_by_the_resume_timeout(tmp_path, monkeypatch):
    sup = _supervisor(tmp_path, monkeypatch, resume_timeout_s=1200.0)
    sup._learn_sections()
    now = time.time()
    progress = {0: {"state": "loading", "section": "resume", "section_t": now - 1100.0, "step": None}}
    assert sup._in_run_checks(0, progress, now - 1100.0, _Quiet()) is None
    progress[0]["section_t"] = now - 1300.0
    v = sup._in_run_checks(0, progress, now - 1300.0, _Quiet())
    assert v.klass == "hang" and "--resume-timeout 1200s; nothing measured yet" in v.reason
    assert _events(sup, "section_timeout")[0]["source"] == "ceiling"


def test_a_relaunch_that_hangs_before_any_report_ends_once_the_run_is_known_to_report(tmp_path, monkeypatch):
    """Start-up before the first report (imports, the process group's set-up) was left to
    torch's timeouts. A script that never reports is still never judged."""
    sup = _supervisor(tmp_path, monkeypatch)
    sup._learn_sections()
    now = time.monotonic()  # the launch time: the supervisor's monotonic clock
    assert sup._in_run_checks(0, {}, now - 10_000.0, _Quiet()) is None  # never reported: never judged
    sup2 = _supervisor(tmp_path / "b", monkeypatch)
    sup2.journal.append("resume", attempt=0, step=None, first_step_s=100.0)  # attempt 0 reported
    sup2._learn_sections()
    assert sup2._in_run_checks(1, {}, now - 500.0, _Quiet()) is None  # floor: 600 s
    v = sup2._in_run_checks(1, {}, now - 700.0, _Quiet())
    assert v.klass == "hang" and v.reason.startswith("the attempt: startup section")
    assert _events(sup2, "section_timeout")[0]["bound_s"] == FLOORS["startup"]


def test_the_checkpointer_reports_its_section_the_longest_of_each_and_its_median_step(tmp_path, monkeypatch):
    from ckptstore import training

    monkeypatch.setenv("CKPTSTORE_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setattr(training, "guard_worker", lambda: None)  # (no parent-death signal for pytest)
    ck = ckptstore.Checkpointer(ckptstore.Store(tmp_path / "run"), state={"x": {"a": 1}}, every=3)
    assert ck.resume() == 0
    p = read_progress(str(tmp_path))[0]
    assert p["section"] == "step" and "resume" in p["longest"]
    for step in range(1, 5):
        ck.step(step)
    ckptstore.wait()
    p = read_progress(str(tmp_path))[0]
    assert p["section"] == "step" and p["section_t"] <= time.time()
    assert set(p["longest"]) == {"resume", "step", "save"}
    assert p["longest"]["save"] >= p["save_blocking_s"]  # start to commit
    assert p["step_median_s"] > 0
    ck.close()


def test_the_rank_enters_the_save_section_while_saving(tmp_path, monkeypatch):
    from ckptstore import training

    monkeypatch.setenv("CKPTSTORE_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setattr(training, "guard_worker", lambda: None)
    ck = ckptstore.Checkpointer(ckptstore.Store(tmp_path / "run"), state={"x": {}})
    seen = []
    real = ck.store.save

    def save(*a, **k):
        seen.append(read_progress(str(tmp_path))[0])
        return real(*a, **k)

    monkeypatch.setattr(ck.store, "save", save)
    ck.save(7).result()
    assert (seen[0]["state"], seen[0]["section"]) == ("saving", "save")
    ck.close()


# ---------------------------------------------------------------------------- health during the run
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _watch(readings, interval=60.0):
    clock, spawned = _Clock(), []

    def spawn(fn):
        spawned.append(fn)
        fn()  # synchronous: the check's result is there at the next poll

    w = NodeWatch(lambda: readings.pop(0), interval, clock=clock, spawn=spawn)
    return w, clock, spawned


def _gpu(name, ok, detail="x"):
    return Check(name, ok, detail)


def test_a_failing_gpu_is_acted_on_temperature_only_when_confirmed():
    hot = [_gpu("gpus", True), _gpu("gpu0.visible", True), _gpu("gpu0.temperature", False, "95 C > 90 C")]
    w, clock, spawned = _watch([hot, list(hot), [_gpu("gpus", True), _gpu("gpu0.ecc", False, "2 uncorrected")]])
    assert w.poll() is None and not spawned  # not due before one interval
    clock.t = 60.0
    assert w.poll() is None and len(spawned) == 1  # checked; judged at the next poll
    assert w.poll() is None  # one hot reading: not yet
    clock.t = 120.0
    w.poll()
    f = w.poll()
    assert [c.name for c in f.unhealthy] == ["gpu0.temperature"]  # two in a row
    clock.t = 180.0
    w.poll()
    assert [c.name for c in w.poll().unhealthy] == ["gpu0.ecc"]  # at once


def test_no_gpu_and_nothing_to_watch_is_quiet_and_stops_checking():
    w, clock, spawned = _watch([[Check("gpus", True, "none", {"count": 0})]])
    for t in (60.0, 61.0, 120.0, 600.0):
        clock.t = t
        assert w.poll() is None
    assert len(spawned) == 1 and w.stopped


def test_a_full_disk_is_warned_once_per_episode():
    full = [Check("gpus", True, "none", {"count": 0}), Check("disk.free:/stage", False, "0.1 GiB free")]
    fine = [Check("gpus", True, "none", {"count": 0}), Check("disk.free:/stage", True, "50 GiB free")]
    w, clock, _ = _watch([full, list(full), fine, list(full)])
    found = []
    for t in (60, 120, 180, 240, 300):
        clock.t = float(t)
        f = w.poll()
        found.append([c.name for c in f.warnings] if f else [])
    assert found == [[], ["disk.free:/stage"], [], [], ["disk.free:/stage"]]


def test_run_checks_read_only_the_run_time_rules(monkeypatch, tmp_path):
    import sys

    fake = FakeNvml([Dev(ecc_volatile=1)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    checks = run_checks([str(tmp_path)], None, HealthLimits())
    assert [c.name for c in checks if not c.ok] == ["gpu0.ecc"]
    assert {c.name for c in checks} == {"gpus", "gpu0.visible", "gpu0.temperature", "gpu0.ecc",
                                        "gpu0.retired_pages", "gpu0.remapped_rows", f"disk.free:{tmp_path}"}
    assert not {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMemoryInfo"} & set(fake.calls)


def test_a_gpu_failing_during_the_run_stops_the_job_with_its_preemption_save_then_exits_13(tmp_path, monkeypatch):
    sup = _supervisor(tmp_path, monkeypatch)

    class Failing:
        def poll(self):
            return Finding(unhealthy=[Check("gpu0.ecc", False, "gpu0: 3 uncorrected since driver load > 0")])

    v = sup._in_run_checks(0, {}, time.time(), Failing())
    assert sup.kills == [signal.SIGTERM]  # the Checkpointer's preemption save, not SIGKILL
    assert v.klass == "unhealthy" and "gpu0.ecc" in v.reason
    (e,) = _events(sup, "run_health")
    assert e["action"] == "preempt" and e["checks"][0]["name"] == "gpu0.ecc"
    v.evidence.update(step=42, committed_step=42, committed_t=time.time())
    sup._attempt = lambda attempt, started: v
    assert sup.run() == runner.EXIT_UNHEALTHY
    (u,) = _events(sup, "unhealthy")
    assert u["during_run"] is True and u["checkpoint_step"] == 42 and u["checks"][0]["name"] == "gpu0.ecc"
    assert not _events(sup, "failure")
    out = summarize(sup.journal.events(), now=time.time() + 1)
    assert out["state"] == "unhealthy" and out["run_health"][0]["action"] == "preempt"


# ---------------------------------------------------------------------------- stragglers
def test_a_straggler_is_named_after_m_reports_and_alerted_once_per_episode():
    t = Tracker()
    normal = {0: 1.0, 1: 1.0, 2: 1.1, 3: 1.0}
    alerts = []
    for _ in range(REPORTS + 2):  # rank 3 at 2.5x for five reports: one alert
        alerts.append([s.rank for s in t.update(0, {**normal, 3: 2.5})])
    assert alerts == [[], [], [3], [], []]
    assert [s.rank for s in t.stragglers()] == [3]
    t.update(0, normal)  # back to normal: the episode ends
    assert t.stragglers() == []
    again = [[s.rank for s in t.update(0, {**normal, 3: 2.5})] for _ in range(REPORTS)]
    assert again == [[], [], [3]]  # a new episode, a new alert
    mild = Tracker()
    for _ in range(REPORTS):
        assert mild.update(0, {**normal, 1: (FACTOR + ALERT_FACTOR) / 2}) == []  # named, not alerted
    assert [s.rank for s in mild.stragglers()] == [1]
    two = Tracker()  # two ranks: each is compared with the other
    for _ in range(REPORTS):
        two.update(0, {0: 1.0, 1: 2.2})
    assert [(s.rank, s.ratio) for s in two.stragglers()] == [(1, 2.2)]


def test_status_names_stragglers_from_the_journaled_step_times(tmp_path, monkeypatch):
    sup = _supervisor(tmp_path, monkeypatch)
    sup.world_size = 4
    progress = {r: {"state": "train", "step": 10, "step_median_s": 1.0} for r in range(4)}
    progress[2]["step_median_s"] = 3.0
    for _ in range(REPORTS):
        sup._report_step_times(0, progress)
    (s,) = _events(sup, "straggler")
    assert (s["rank"], s["ratio"], s["reports"]) == (2, 3.0, REPORTS)
    sup._report_step_times(0, progress)
    assert len(_events(sup, "straggler")) == 1  # once per episode, not per report
    out = summarize(sup.journal.events(), now=time.time() + 1)
    assert [(x["rank"], x["reports"]) for x in out["stragglers"]] == [(2, REPORTS + 1)]
    assert "straggler" in render({**out, "run": "r", "started_at": None})
    hostile = summarize([{"kind": "step_times", "t": 1.0, "ranks": {"x": 1, "1": "slow", "2": -1.0, "3": 1e308,
                                                                    "4": 1e-308}}], now=2.0)
    assert isinstance(hostile["stragglers"], list)  # no crash on odd figures


def test_a_real_save_stuck_on_rank_1_is_ended_at_the_save_timeout_and_the_run_recovers(tmp_path):
    """One short real launch (2 CPU ranks): rank 1 blocks inside the save of step 15,
    rank 0 waits for it in the save's agreement. Both report `saving`, which held the
    hang clock: the attempt waited for gloo's 30-minute timeout."""
    from test_supervisor import Supervised, journal, kinds

    store = tmp_path / "store"
    job = Supervised(store, tmp_path, "--save-timeout", "4", "--hang-timeout", "inf",
                     fault=f"hangsave:15:{tmp_path / 'stuck-once'}")
    assert job.finish() == runner.EXIT_FINISHED, job.output()[-3000:]
    events = journal(store)
    (late,) = kinds(events, "section_timeout")
    assert (late["section"], late["source"], late["bound_s"]) == ("save", "ceiling", 4.0)
    assert late["elapsed_s"] > 4.0 and late["step"] in (14, 15)
    (failure,) = kinds(events, "failure")
    assert failure["class"] == "hang" and "save section" in failure["reason"]
    assert any(e.get("longest", {}).get("save") for e in kinds(events, "sections"))
