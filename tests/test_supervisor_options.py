"""Review of `ckptstore run` (issue c35), in process: the policy options are validated
(exit 2 naming the option and its range; 0 means "off" where documented), and section
bounds are judged by the monotonic clock, so a step of the wall clock neither kills a
healthy section nor switches a bound off. Clocks are injected."""

from __future__ import annotations

import math
import time

import pytest

from ckptstore.cli.run import _parser
from ckptstore.supervisor.classify import Verdict
from ckptstore.supervisor.decide import History, Policy, decide
from ckptstore.supervisor.progress import ProgressReporter, read_progress
from ckptstore.supervisor.sections import Sections

BAD = [("--backoff", "-1"), ("--backoff-max", "inf"), ("--max-restarts", "-1"), ("--max-restarts", "1.5"),
       ("--max-restarts-per-hour", "-2"), ("--max-preemptions-per-hour", "-1"), ("--hang-timeout", "-5"),
       ("--hang-timeout", "0"), ("--hang-timeout", "nan"), ("--first-progress-timeout", "0"),
       ("--resume-timeout", "-inf"), ("--save-timeout", "nan"), ("--join-timeout", "-3"),
       ("--join-timeout", "inf"), ("--join-timeout", "0"), ("--decision-wait", "nan"), ("--decision-wait", "0"),
       ("--outage-window", "nan"), ("--outage-window", "inf"), ("--health-wait", "-1"),
       ("--section-factor", "nan"), ("--health-interval", "-1"), ("--straggler-report", "inf"),
       ("--run-timeout", "0"), ("--run-timeout", "nan"), ("--no-progress-restarts", "-1"),
       ("--expected-gpus", "0"), ("--backoff", "soon"), ("--node-lost-timeout", "0"),
       ("--node-lost-timeout", "inf"), ("--node-fault-silent", "-1"), ("--node-probe-timeout", "nan")]


@pytest.mark.parametrize("option,value", BAD)
def test_an_out_of_range_policy_option_exits_2_naming_the_option_and_its_range(option, value, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--store", "x", f"{option}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and "allowed: " in err, err


def test_the_edges_of_each_range_are_accepted():
    o = _parser().parse_args(["--store", "x", "--backoff", "0", "--max-restarts", "0", "--outage-window", "0",
                              "--no-progress-restarts", "0", "--hang-timeout", "inf",
                              "--first-progress-timeout", "inf", "--run-timeout", "inf", "--section-factor", "0",
                              "--health-interval", "0", "--straggler-report", "0", "--decision-wait", "0.5",
                              "--join-timeout", "1e-3", "--expected-gpus", "1"])
    assert (o.backoff, o.max_restarts, o.no_progress_restarts, o.decision_wait) == (0.0, 0, 0, 0.5)
    assert math.isinf(o.hang_timeout) and math.isinf(o.run_timeout)
    d = _parser().parse_args(["--store", "x"])  # the defaults are not touched by the validation
    assert (d.join_timeout, d.decision_wait, d.max_restarts) == (120.0, 30.0, Policy().max_restarts)


def test_no_progress_restarts_0_is_off():
    """Before, 0 gave up at the first failure ("no checkpoint newer than step 50 in 0
    failures in a row"); elsewhere 0 means "off"."""
    policy, history = Policy(no_progress_restarts=0, backoff_s=0), History()
    for i in range(5):  # different errors: none is a repeat (deterministic)
        d = decide(policy, history, Verdict("transient", f"error {i}", signature=f"sig{i}"), False, float(i),
                   checkpoint=50)
        assert d.code is None, d
    d = decide(Policy(no_progress_restarts=2), History(), Verdict("transient", "e", signature="a"), False, 0.0)
    assert d.code is None  # (the limit still works)


def test_the_reporter_dates_its_section_on_the_monotonic_clock_too(tmp_path):
    r = ProgressReporter(str(tmp_path), 0)
    before = time.monotonic()
    r.report("saving", 3, force=True, section="save")
    p = read_progress(str(tmp_path))[0]
    assert before <= p["section_mono"] <= time.monotonic() and p["section_t"] <= time.time()


def _saving(**clock):
    return {0: {"state": "saving", "section": "save", "step": 7, "first_step_t": 1.0, **clock}}


def test_a_wall_clock_step_neither_ends_a_healthy_section_nor_switches_its_bound_off():
    s = Sections(Policy(save_timeout_s=100.0, section_factor=0))
    mono, wall = 5_000.0, 1_700_000_000.0
    progress = _saving(section_mono=mono, section_t=wall)
    # forward step of a day: 10 s into the save by the monotonic clock
    assert s.judge(progress, 0.0, mono + 10, True, now_t=wall + 86_400) is None
    # backward step of a day: the bound still ends it
    late = s.judge(progress, 0.0, mono + 101, True, now_t=wall - 86_400)
    assert late is not None and late.section == "save" and 100 < late.elapsed_s < 102


def test_an_older_file_dated_in_the_future_is_judged_from_when_it_was_first_seen():
    """No ``section_mono`` (an older rank): the wall clock, and a ``section_t`` in the
    future (the clock stepped back) counts as just started, not as "bound off"."""
    s = Sections(Policy(save_timeout_s=100.0, section_factor=0))
    wall = 1_700_000_000.0
    progress = _saving(section_t=wall + 3600)
    assert s.judge(progress, 0.0, 1_000.0, True, now_t=wall) is None  # first seen: elapsed 0
    assert s.judge(progress, 0.0, 1_050.0, True, now_t=wall + 50) is None
    late = s.judge(progress, 0.0, 1_101.0, True, now_t=wall + 101)  # still "in the future" by the wall clock
    assert late is not None and late.elapsed_s == pytest.approx(101.0)
    # in the past by the wall clock: as before
    s2 = Sections(Policy(save_timeout_s=100.0, section_factor=0))
    assert s2.judge(_saving(section_t=wall - 101), 0.0, 0.0, True, now_t=wall).section == "save"


def test_the_startup_is_judged_by_the_monotonic_launch_time():
    s = Sections(Policy(first_progress_timeout_s=100.0, section_factor=0))
    progress = {0: {"state": "train", "section": "step", "step": None}}
    assert s.judge(progress, 1_000.0, 1_050.0, True, now_t=10.0**12) is None  # wall far ahead: ignored
    assert s.judge(progress, 1_000.0, 1_101.0, True, now_t=0.0).section == "startup"
