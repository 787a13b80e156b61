"""``ckptstore run``'s judgement, in process (issue 35): which errors are the program's
and which an outage or the machinery's, the first exception of a chain deciding; an
outage retried across its window; a hang twice at one step; preemptions bounded;
defaults under which every limit can fire; health checks rechecked, GPU memory waited
for, a store outage apart from an unhealthy node; alerts in the background; hang
detection only for ranks that report; a command line refused before any launch. The
launches themselves: tests/test_supervisor.py."""

from __future__ import annotations

import itertools
import time

import pytest
from click.testing import CliRunner

from ckptstore.supervisor import alerts, gate, runner
from ckptstore.supervisor.classify import Verdict, classify, first_exception
from ckptstore.supervisor.decide import History, Policy, decide, outage_relaunches
from ckptstore.supervisor.health import GiB, Check


def _supervisor(store, monkeypatch, checks=None, **policy) -> runner.Supervisor:
    checks = checks or (lambda: [Check("node", True, "")])
    monkeypatch.setattr(runner, "check_node", lambda *a, **k: checks())
    return runner.Supervisor(str(store), ["train.py"], runner.Policy(backoff_s=0, **policy))


def _result(error: str, traceback: str = "", rank: int = 0) -> dict:
    return {"failures": {str(rank): {"error": error, "traceback": traceback, "exitcode": 1, "timestamp": 1}}}


def _twice(result: dict, step=7, relaunched=False, policy=Policy(backoff_s=0)) -> tuple[str, str]:
    """The classes decide gives the same failure twice, a second apart."""
    history = History()
    return tuple(decide(policy, history, classify(result, step, relaunched=relaunched), False, t).klass
                 for t in (0.0, 1.0))


# ------------------------------------------------------------------ which errors are whose
OUTAGES = {
    "read timed out": "requests.exceptions.ReadTimeout: HTTPSConnectionPool(host='data.example', port=443): "
                      "Read timed out. (read timeout=10)",
    "connection refused": "ConnectionRefusedError: [Errno 111] Connection refused",
    "botocore endpoint": 'EndpointConnectionError: Could not connect to the endpoint URL: "http://s3.local/b"',
    "EIO": "OSError: [Errno 5] Input/output error: '/mnt/lustre/shard-00017'",
    "ESTALE": "OSError: [Errno 116] Stale file handle: '/mnt/nfs/data'",
    "device busy": "RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable",
}
MACHINERY = {
    "nccl watchdog": "DistBackendError: [Rank 1] Watchdog caught collective operation timeout: "
                     "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
                     "600051 milliseconds before timing out.",
    "commit timeout": "CommitTimeoutError: /ckpt/step-000000000010: rank 0 waited 600s for the votes of ranks [1]",
}


@pytest.mark.parametrize("name", sorted(OUTAGES))
def test_a_fault_outside_the_job_is_an_outage_not_the_programs_error(name):
    """Each of these was the program's own error: the same one after a one-second
    backoff stopped the run as deterministic (exit 10) during a network blip."""
    v = classify(_result(OUTAGES[name]), 7)
    assert v.klass == "transient" and v.outage, v.reason
    assert _twice(_result(OUTAGES[name])) == ("transient", "transient")


@pytest.mark.parametrize("name", sorted(MACHINERY))
def test_an_nccl_watchdog_timeout_and_a_commit_timeout_are_the_machinerys(name):
    assert _twice(_result(MACHINERY[name])) == ("transient", "transient")
    # and never the cause when another rank has an error of its own
    both = {"failures": {"0": {"error": MACHINERY[name], "exitcode": 1, "timestamp": 1},
                         "1": {"error": "ValueError: bad row 3", "exitcode": 1, "timestamp": 2}}}
    assert classify(both, 7).rank == 1


def test_out_of_memory_right_after_a_relaunch_is_an_outage_and_later_the_programs():
    oom = _result("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total)")
    assert _twice(oom, step=None, relaunched=True) == ("transient", "transient")
    assert _twice(oom, step=120) == ("transient", "deterministic")  # while training: the program's


def test_xid_is_a_word_not_any_name_that_holds_it():
    assert _twice(_result("KeyError: 'maxXid'")) == ("transient", "deterministic")
    assert _twice(_result("RuntimeError: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus")) == \
        ("transient", "transient")


def test_the_programs_first_exception_decides_over_a_cleanup_that_timed_out():
    """A ValueError whose cleanup then timed out in a collective: the whole chained
    traceback was searched, "Timed out" found, and the program's error retried forever
    as the machinery's."""
    tb = ('Traceback (most recent call last):\n  File "train.py", line 40, in main\n    check(batch)\n'
          "ValueError: label 7 out of range\n\nDuring handling of the above exception, another exception "
          'occurred:\n\nTraceback (most recent call last):\n  File "train.py", line 44, in main\n'
          "    dist.barrier()\ntorch.distributed.DistBackendError: [../third_party/gloo/gloo/transport/tcp/"
          "pair.cc:534] Timed out waiting 1800000ms for recv operation to complete\n")
    final = "DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 1800000ms"
    assert first_exception(final, tb) == "ValueError: label 7 out of range"
    v = classify(_result(final, tb), 12)
    assert not v.outage and v.signature.startswith("ValueError: label N out of range")
    assert _twice(_result(final, tb), step=12) == ("transient", "deterministic")


def test_a_nonzero_exit_is_the_programs_unless_a_rank_was_killed():
    """The bootstrap records ``sys.exit(2)`` (argparse's usage error); a SIGTERM handler
    that calls sys.exit in the ranks the launcher stops raises one too, after the
    failure of a peer that is the cause."""
    assert _twice(_result("SystemExit: 2"), step=None) == ("transient", "deterministic")
    both = {"failures": {"0": {"error": "SystemExit: 143", "exitcode": 143, "timestamp": 5},
                         "1": {"error": None, "signal": "SIGKILL", "exitcode": -9}}}
    assert classify(both, 7).reason == "rank 1 was killed by SIGKILL"


def test_where_no_step_is_known_the_signature_and_the_reason_say_so():
    v = classify(_result("ValueError: bad config"), None)
    assert "no step reported" in v.signature and "no step reported" in v.reason


# ------------------------------------------------------------------ decisions
def _outage(step=None) -> Verdict:
    return classify(_result(OUTAGES["connection refused"]), step)


def test_an_outage_is_retried_across_its_window_then_judged_the_programs():
    """The same error twice used to stop the run after about a second's backoff: an
    outage longer than one restart (a mount, a remote service) ended as deterministic."""
    policy, history = Policy(outage_window_s=600, no_progress_restarts=3), History()
    classes = [decide(policy, history, _outage(), False, t).klass for t in (0, 5, 60, 300, 599)]
    assert classes == ["transient"] * 5  # neither a repeat nor "no progress" within the window
    last = decide(policy, history, _outage(), False, 601)
    assert last.klass == "deterministic" and last.code == 10 and "not an outage" in last.reason
    # a failure that left a newer checkpoint ends the outage: a new one starts its own window
    history = History()
    decide(policy, history, _outage(), False, 0)
    assert decide(policy, history, _outage(), True, 700).klass == "transient"


def test_a_hang_at_the_same_step_twice_is_a_deadlock():
    """Retried to the no-progress limit before: 3 x the hang timeout (30 minutes)."""
    def hang(step):
        return Verdict("hang", f"no rank reported progress for 600s (last step {step})", evidence={"step": step})

    history = History()
    assert decide(Policy(), history, hang(11), False, 0).klass == "hang"
    d = decide(Policy(), history, hang(11), False, 700)
    assert (d.klass, d.code) == ("deterministic", 10) and "hung twice at step 11" in d.reason
    history = History()
    decide(Policy(), history, hang(11), False, 0)
    assert decide(Policy(), history, hang(12), False, 700).code is None  # another step: retried


def test_preemptions_are_bounded(tmp_path, monkeypatch):
    """A process that kept sending SIGTERM relaunched the job forever, at once."""
    sup = _supervisor(tmp_path / "run", monkeypatch)
    attempts = itertools.count()

    def preempted(attempt, started):
        if next(attempts) > 50:
            raise AssertionError("still relaunching after 50 preemptions")
        return Verdict("preempted", "the job saved and stopped on a signal (preemption)", evidence={"step": 3})

    sup._attempt = preempted
    assert sup.run() == runner.EXIT_RESTART_LIMIT
    (give_up,) = [e for e in sup.journal.events() if e["kind"] == "give_up"]
    assert give_up["class"] == "preemption_limit" and "11 preemptions within an hour" in give_up["reason"]


def test_at_the_defaults_the_hourly_limit_fires_before_the_total(tmp_path, monkeypatch):
    """Defaults of 10 restarts in all and 30 per hour: the hourly limit could never fire."""
    sup = _supervisor(tmp_path / "run", monkeypatch)  # the default limits
    steps = itertools.count(10, 10)

    def progressing(attempt, started):  # each attempt commits a newer step, then dies
        s = next(steps)
        return Verdict("transient", "rank 1 was killed by SIGKILL", evidence={
            "step": s + 3, "resume_reported": True, "resumed_step": s - 10, "committed_step": s})

    sup._attempt = progressing
    assert sup.run() == runner.EXIT_RESTART_LIMIT
    (give_up,) = [e for e in sup.journal.events() if e["kind"] == "give_up"]
    assert "within an hour" in give_up["reason"], give_up
    d = Policy()
    assert outage_relaunches(d) < d.max_restarts_per_hour < d.max_restarts  # one outage fits within the hour


# ------------------------------------------------------------------ the gate before a launch
class _Clock:
    def __init__(self):
        self.t = 0.0
        self.slept = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def _gate(checks, readings=None, **policy):
    clock, calls = _Clock(), []
    seq = iter(readings) if readings is not None else None

    def check():
        calls.append(("check", clock.t))
        return next(checks)

    def gpu_memory():
        calls.append(("read", clock.t))
        return None if seq is None else next(seq)

    g = gate.Gate(check, Policy(**policy), lambda: False, gpu_memory=gpu_memory, clock=clock, sleep=clock.sleep,
                  say=lambda line: None)
    return g, calls


OK = [Check("gpus", True, "1 visible"), Check("store", True, "writable")]


def test_a_relaunch_waits_for_the_last_attempts_gpu_memory_before_judging_the_gpus():
    before = {"GPU-a": (1 * GiB, 80 * GiB), "GPU-b": (1 * GiB, 80 * GiB)}
    held = {"GPU-a": (70 * GiB, 80 * GiB), "GPU-b": (1 * GiB, 80 * GiB)}
    freed = {"GPU-a": (1 * GiB + 100, 80 * GiB), "GPU-b": (1 * GiB, 80 * GiB)}
    g, calls = _gate(itertools.repeat(OK), [before, held, held, freed])
    assert g.before_launch(relaunch=False).state == "ok"  # the first launch: the baseline
    assert g.before_launch(relaunch=True).state == "ok"
    assert [c for c, _ in calls] == ["read", "check", "read", "read", "read", "check"]
    # no NVML, no GPU: nothing to wait for
    g, calls = _gate(itertools.repeat(OK), itertools.repeat(None))
    g.before_launch(relaunch=False)
    g.before_launch(relaunch=True)
    assert [c for c, _ in calls] == ["read", "check", "check"]


def test_failed_health_checks_are_rechecked_for_a_bounded_time():
    hot = [Check("gpu0.temperature", False, "gpu0: 93 C > 90 C limit")]
    g, calls = _gate(iter([hot, hot, OK]), health_wait_s=120, backoff_s=1)
    assert g.before_launch(relaunch=False).state == "ok"
    g, calls = _gate(itertools.repeat(hot), health_wait_s=120, backoff_s=1, backoff_max_s=60)
    fit = g.before_launch(relaunch=False)
    checked = [t for c, t in calls if c == "check"]
    assert fit.state == "unhealthy" and "93 C" in fit.reason
    assert checked[-1] - checked[0] == 120 and len(checked) < 10


def test_a_store_outage_is_not_an_unhealthy_node():
    down = [Check("gpus", True, "none"), Check("store", False, "s3://b/run: EndpointConnectionError")]
    g, calls = _gate(itertools.repeat(down), outage_window_s=600, health_wait_s=120)
    fit = g.before_launch(relaunch=False)
    checked = [t for c, t in calls if c == "check"]
    assert fit.state == "store" and checked[-1] == 600  # waited out as an outage, not the node's 120 s


def test_a_run_rechecks_its_node_and_stops_on_a_store_outage_with_its_own_code(tmp_path, monkeypatch):
    """An unhealthy check ended the run at once (exit 13), a store outage included."""
    monkeypatch.setattr(gate, "POLL_S", 0.01)  # (the recheck's shortest wait)
    hot = [Check("gpu0.temperature", False, "gpu0: 93 C > 90 C limit")]
    answers = iter([hot, [Check("node", True, "")]])
    sup = _supervisor(tmp_path / "a", monkeypatch, checks=lambda: next(answers))
    sup._attempt = lambda attempt, started: Verdict("finished", "the script finished", evidence={"step": 3})
    assert sup.run() == runner.EXIT_FINISHED
    down = [Check("store", False, "s3://b/run: EndpointConnectionError")]
    sup = _supervisor(tmp_path / "b", monkeypatch, checks=lambda: down, outage_window_s=0.05)
    assert sup.run() == gate.EXIT_STORE_UNREACHABLE == 15
    kinds = [e["kind"] for e in sup.journal.events()]
    assert "unhealthy" not in kinds and kinds[-1] == "give_up"


# ------------------------------------------------------------------ alerts
def test_an_alert_never_delays_the_relaunch(tmp_path, monkeypatch):
    """The alert ran before each relaunch, for up to 30 s. Here the first failure's
    alert can only finish once the relaunch has started."""
    go, out = tmp_path / "relaunched", tmp_path / "alerts"
    sup = _supervisor(tmp_path / "run", monkeypatch, alert=f"cat >> {out}; echo >> {out}; "
                      f"while [ ! -e {go} ]; do sleep 0.05; done; echo released >> {out}")

    def attempt(n, started):
        if n == 0:
            return Verdict("transient", "rank 1 was killed by SIGKILL", evidence={"step": 3})
        go.touch()
        return Verdict("finished", "the script finished", evidence={"step": 9})

    sup._attempt = attempt
    assert sup.run() == runner.EXIT_FINISHED
    # (run() waits for the alerts still running; one that held up the relaunch was killed at its timeout)
    lines = [line for line in out.read_text().splitlines() if line.strip()]
    assert lines[0].startswith('{"kind": "failure"') and lines[1:] == ["released"], lines


# ------------------------------------------------------------------ hangs
def test_a_rank_that_never_reports_is_never_hung():
    """A script without a Checkpointer was killed as hung 30 minutes after each launch."""
    watch = runner._ProgressWatch(time.monotonic() - 10_000)
    watch.update({})
    assert watch.hung(Policy(first_progress_timeout_s=1, hang_timeout_s=1)) is None
    watch.update({0: {"state": "loading", "step": None}})  # a rank that reports is judged
    watch.update({0: {"state": "train", "step": None}})
    assert watch.hung(Policy(first_progress_timeout_s=1, hang_timeout_s=1))


# ------------------------------------------------------------------ the command line
def test_a_missing_script_is_refused_before_any_launch(tmp_path):
    from ckptstore.cli import main

    out = CliRunner().invoke(main, ["run", "--standalone", "--store", str(tmp_path / "s"), "--backoff", "0",
                                    str(tmp_path / "trian.py")])
    assert out.exit_code == 2 and "trian.py: no such file" in out.output, out.output
    assert not (tmp_path / "s").exists()  # nothing launched, nothing journaled


def test_supervisor_options_after_the_script_are_named():
    from ckptstore.cli import main

    out = CliRunner().invoke(main, ["run", "--standalone", "train.py", "--store", "s3://b/run"])
    assert out.exit_code == 2 and "--store after SCRIPT (train.py)" in out.output, out.output
    assert "options go before the script" in out.output
