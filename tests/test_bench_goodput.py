"""bench/bench_goodput.py's pure parts, so that the bench cannot rot between the runs
that take minutes: the progress-line parsing, the seeded fault schedule, the per-fault
loss, the goodput arithmetic, the summary table, the detection of a mode this branch
cannot run, and the commands each mode launches. No job is run here."""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_goodput as bg  # noqa: E402


def test_progress_lines_give_rank_step_and_pid_and_nothing_else_does():
    assert bg.parse_step("rank 1: step 42 pid 31337\n") == (1, 42, 31337)
    for other in ("rank 1: committed step 40", "rank 0: first step 3.10s after start", "rank 1: step 4 pid",
                  "[1] rank 1: step 4 pid 9", "rank 1: step 4 pid 9 extra", "rank x: step 4 pid 9"):
        assert bg.parse_step(other) is None, other


def test_the_schedule_is_a_fixed_grid_from_the_first_step_with_the_same_targets_for_every_mode():
    a, b = bg.Schedule("kill", 7, 12.0), bg.Schedule("kill", 7, 12.0)
    assert a.due(1e9) is None and a.next_t() is None  # nothing before the first step
    a.start(100.0)
    a.start(105.0)  # the first step's time is kept
    assert a.next_t() == 112.0 and a.due(111.9) is None
    targets = []
    for now in (112.0, 124.5, 136.0, 148.0, 160.0, 172.0, 184.0, 196.0):
        t = a.due(now)
        assert t in (0, 1)
        targets.append(t)
    assert a.next_t() == 100.0 + 9 * 12.0  # a late poll does not shift the grid
    b.start(0.0)  # another mode, another start time: the same targets in the same order
    assert [b.due(12.0 * (k + 1)) for k in range(8)] == targets
    assert len(set(targets)) == 2  # both ranks are hit (seed 7)
    c = bg.Schedule("kill", 8, 12.0)
    c.start(0.0)
    assert [c.due(12.0 * (k + 1)) for k in range(8)] != targets  # the seed matters


def test_a_hang_is_one_tick_and_a_node_fault_takes_node_1():
    h = bg.Schedule("hang", 0, 4.0)
    h.start(0.0)
    assert h.due(4.0) in (0, 1)
    assert h.next_t() is None and h.due(1e9) is None
    n = bg.Schedule("node", 0, 4.0)
    n.start(0.0)
    assert [n.due(4.0 * (k + 1)) for k in range(3)] == [1, 1, 1]
    for bad in (("nope", 0, 1.0), ("kill", 0, 0.0)):
        with pytest.raises(ValueError):
            bg.Schedule(*bad)


def test_each_faults_loss_runs_until_the_hit_rank_is_back_from_another_pid_past_its_step():
    # both ranks step every 0.1 s up to step 9 (t=1.0); rank 1 (pid 11) is killed at 1.05
    # while rank 0 (pid 10) still prints step 10, which it had finished: not a recovery
    steps = [(0.1 * (s + 1), r, s, 10 + r) for s in range(10) for r in (0, 1)]
    steps += [(1.06, 0, 10, 10),
              (3.0, 1, 5, 21), (3.5, 1, 9, 21), (3.6, 0, 9, 20),  # relaunched: steps 5..9 redone
              (4.1, 0, 10, 20), (4.1, 1, 10, 21), (4.2, 1, 11, 21)]
    out = bg.fault_losses([{"t": 1.05, "target": 1, "hit": {1: (11, 9, 1.0)}}], steps, 0.1)
    assert out[0]["recovered_t"] == 4.1 and not out[0]["cut"] and out[0]["target"] == 1
    assert out[0]["lost_s"] == pytest.approx(4.1 - (1.0 + 0.1))
    # in-job: the survivor keeps its pid, the spare (pid 30) takes rank 1 and goes on
    injob = steps[:21] + [(1.4, 1, 10, 30), (1.4, 0, 11, 10)]
    assert bg.fault_losses([{"t": 1.05, "hit": {1: (11, 9, 1.0)}}], injob, 0.1)[0]["recovered_t"] == 1.4
    # a second fault at 3.2, before rank 1 was past step 9: the first one's loss ends there
    two = bg.fault_losses([{"t": 1.05, "hit": {1: (11, 9, 1.0)}}, {"t": 3.2, "hit": {1: (21, 5, 3.0)}}], steps, 0.1)
    assert two[0]["cut"] and two[0]["lost_s"] == pytest.approx(3.2 - 1.1)
    assert two[1]["recovered_t"] is None and two[1]["lost_s"] is None  # pid 21 was the one hit: never back
    # a node: every rank it held must be back
    node = bg.fault_losses([{"t": 1.05, "hit": {0: (10, 10, 1.06), 1: (11, 9, 1.0)}}], steps + [(4.2, 0, 11, 20)], 0.1)
    assert node[0]["recovered_t"] == 4.2 and node[0]["lost_s"] == pytest.approx(4.2 - 1.1)
    # after the last step: over when the run is (its end marker, pid -1)
    last = bg.fault_losses([{"t": 1.05, "hit": {1: (11, 9, 1.0)}}], steps[:20] + [(7.0, 1, 10, -1)], 0.1)
    assert last[0]["recovered_t"] == 7.0


def test_the_job_is_back_only_when_every_hit_rank_reported_a_newer_step_from_a_new_pid():
    fault = {"hit": {1: (11, 47, 60.5)}}
    assert bg.is_back(None, {})  # no fault yet
    assert not bg.is_back(fault, {0: (10, 48, 60.7, 0), 1: (11, 47, 60.5, 0)})  # a survivor's line
    assert not bg.is_back(fault, {1: (21, 40, 70.0, 0)})  # relaunched, redoing steps from the checkpoint
    assert bg.is_back(fault, {1: (21, 48, 75.0, 0)})
    node = {"hit": {0: (10, 48, 1.0), 1: (11, 47, 1.0)}}
    assert not bg.is_back(node, {0: (20, 49, 2.0, 1), 1: (11, 47, 1.0, 1)})
    assert bg.is_back(node, {0: (20, 49, 2.0, 1), 1: (21, 49, 2.0, 1)})


def test_the_step_interval_is_the_median_gap_between_consecutive_steps():
    assert bg.step_interval([(0.0, 0), (0.1, 1), (0.3, 2), (5.0, 0), (5.1, 1)]) == pytest.approx(0.1)
    assert bg.step_interval([(0.0, 3)]) is None


def test_goodput_and_loss_per_failure_follow_the_issues_definitions():
    # issue 36's figures: 55 s without faults, 166 s with 8, 400 steps
    base, ref = {"wall_s": 55.0, "steps": 400, "finished": True}, {"wall_s": 50.0, "steps": 400, "finished": True}
    s = bg.scores({"wall_s": 166.0, "steps": 400, "finished": True, "failures": 8}, base, ref)
    assert s["goodput"] == pytest.approx(55.0 / 166.0)
    assert s["goodput_vs_torchrun"] == pytest.approx(50.0 / 166.0)
    assert s["lost_per_failure_s"] == pytest.approx((166.0 - 55.0) / 8)
    hung = bg.scores({"wall_s": 600.0, "steps": 120, "finished": False, "failures": 1}, base, ref)
    assert hung == {"goodput": 0.0, "goodput_vs_torchrun": 0.0, "lost_per_failure_s": None}
    none = bg.scores({"wall_s": 60.0, "steps": 400, "finished": True, "failures": 0}, None, None)
    assert none == {"goodput": None, "goodput_vs_torchrun": None, "lost_per_failure_s": None}
    assert bg.scores({"wall_s": 60.0, "steps": 400, "finished": True, "failures": 0}, base, None)[
        "lost_per_failure_s"] is None  # no failure: no loss per failure


def test_the_summary_takes_medians_over_repeats_and_the_table_says_what_failed():
    runs = [
        {"mode": "relaunch", "schedule": "baseline", "wall_s": 50.0},
        {"mode": "relaunch", "schedule": "kill", "goodput": 0.3, "goodput_vs_torchrun": 0.28,
         "lost_per_failure_s": 14.0, "failures": 8, "bit_identical": True,
         "faults": [{"lost_s": 12.0}, {"lost_s": 16.0}, {"lost_s": None}]},
        {"mode": "relaunch", "schedule": "kill", "goodput": 0.4, "goodput_vs_torchrun": 0.38,
         "lost_per_failure_s": 12.0, "failures": 6, "bit_identical": True, "faults": [{"lost_s": 11.0}]},
        {"mode": "torchrun", "schedule": "kill", "goodput": 0.0, "goodput_vs_torchrun": 0.0, "failures": 1,
         "bit_identical": None, "note": "hung (killed after 600 s)", "faults": [{"lost_s": None}]},
        {"mode": "in-job", "schedule": "kill", "unavailable": "ckptstore run has no --in-job"},
    ]
    rows = {(r["mode"], r["schedule"]): r for r in bg.summarize(runs)}
    assert set(rows) == {("relaunch", "kill"), ("torchrun", "kill"), ("in-job", "kill")}  # no baseline row
    rel = rows["relaunch", "kill"]
    assert (rel["runs"], rel["goodput"], rel["lost_per_failure_s"], rel["failures"]) == (2, 0.35, 13.0, 7)
    assert (rel["fault_lost_median_s"], rel["fault_lost_max_s"], rel["bit_identical"]) == (12.0, 16.0, True)
    assert rows["torchrun", "kill"]["bit_identical"] is None
    runs.append({"mode": "relaunch", "schedule": "kill", "goodput": 0.0, "bit_identical": None, "note": "hung"})
    assert bg.summarize(runs)[0]["bit_identical"] is True  # a run that did not finish has no verdict
    runs[2]["bit_identical"] = False
    assert bg.summarize(runs)[0]["bit_identical"] is False  # one run off is "no"
    runs.pop()
    text = bg.table(bg.summarize(runs)).splitlines()
    assert len(text) == 2 + 3 and all(line.count("|") == text[0].count("|") for line in text)
    assert "| relaunch | kill | 0.35 | 0.33 | 13.00 s | 12.00 / 16.00 s | 7 | **no** |" in text[2]
    assert "hung (killed after 600 s)" in text[3] and text[3].split("|")[3].strip() == "0.00"
    assert "unavailable: ckptstore run has no --in-job" in text[4]


def test_an_option_or_value_the_launcher_does_not_know_is_recognised():
    assert bg.unknown_option("x\n__main__.py: error: unrecognized arguments: --in-job --spares\n") \
        == "__main__.py: error: unrecognized arguments: --in-job --spares"
    assert bg.unknown_option("train.py: error: argument --every: invalid int value: 'auto'")
    assert bg.unknown_option("rank 0: step 3 pid 9\nrank 0: done") is None
    # a usage refusal before any step (exit 2) makes the mode unavailable in that layout ...
    refused = "ckptstore run: --in-job runs on one node for now (--nnodes 2); run without --in-job, or on one node"
    assert bg.refusal(f"W1207 some warning\n{refused}\n", [2, 2], -1) == refused
    # ... a failure after steps, or another exit, is a failure of the mode, not a refusal
    assert bg.refusal(f"{refused}\n", [2], 12) is None
    assert bg.refusal("Traceback ...\nRuntimeError: boom\n", [1], -1) is None
    assert bg.refusal("x: error: unrecognized arguments: --spares\n", [1], 5).endswith("--spares")


def test_each_mode_is_one_command_with_its_options_and_every():
    class A:
        steps, step_delay, hidden, hang_timeout, ckptstore_args = 60, 0.1, 64, 5.0, "--backoff 0.01"
    tr = bg.command(bg.MODES["torchrun"], A, "S", "F.pt", "kill")
    assert tr[1:3] == ["-m", "torch.distributed.run"] and "--max-restarts" in tr and "--store" not in tr
    assert tr[tr.index("--every") + 1] == "10" and tr[tr.index("--step-delay") + 1] == "0.1"
    inj = bg.command(bg.MODES["in-job-auto"], A, "S", "F.pt", "hang")
    i = inj.index(bg.EXAMPLE)
    # in-job is ckptstore run's default for the example; the relaunch mode turns it off
    assert inj[1:4] == ["-m", "ckptstore.cli", "run"] and "--backoff" in inj[:i] and "--no-in-job" not in inj
    assert "--no-in-job" in bg.command(bg.MODES["relaunch"], A, "S", "F.pt", "kill")
    assert inj[inj.index("--hang-timeout") + 1] == "5" and inj[inj.index("--every") + 1] == "auto"
    assert "--hang-timeout" not in bg.command(bg.MODES["relaunch"], A, "S", "F.pt", "kill")
    node = bg.command(bg.MODES["relaunch"], A, "S", "F.pt", "node", node_rank=1, port=29999, run_id="r")
    assert node[node.index("--node-rank") + 1] == "1" and "127.0.0.1:29999" in node and "--standalone" not in node
    assert node[node.index("--run-id") + 1] == "r"


def test_the_arguments_default_to_the_issues_workload_and_quick_shrinks_it():
    full = bg.parse([])
    assert (full.steps, full.kill_every, full.timeout, full.repeat) == (400, 12.0, 600.0, 1)
    assert full.modes == list(bg.MODES) and full.schedule == ["kill"]
    quick = bg.parse(["--quick", "--modes", "torchrun,relaunch", "--schedule", "kill,hang"])
    assert (quick.steps, quick.kill_every, quick.timeout) == (60, 4.0, 180.0)
    assert bg.parse(["--quick", "--steps", "30"]).steps == 30  # an explicit value wins
    for bad in (["--modes", "nope"], ["--schedule", "flood"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            bg.parse(bad)


def test_the_journal_breakdown_pools_the_in_job_recoveries_of_the_repeats():
    def journal(detect, sources):
        return {"failures": [{"class": "transient"}] * 2, "lost_steps": 3,
                "recovery_events": [{}, {}], "recovery_medians_s": {"detect_s": detect, "first_step_s": 0.4},
                "restore_from_totals": sources}
    runs = [{"mode": "in-job", "schedule": "kill", "faults": [], "journal": journal(0.1, {"memory": 2})},
            {"mode": "in-job", "schedule": "kill", "faults": [], "journal": journal(0.3, {"memory": 1, "peer": 1})},
            {"mode": "torchrun", "schedule": "kill", "faults": []},  # no journal: no row
            {"mode": "relaunch", "schedule": "kill", "faults": [], "journal": {"error": "OSError: gone"}}]
    rows = bg.summarize(runs)
    j = rows[0]["journal"]
    assert (j["failures"], j["lost_steps"], j["recoveries"]) == (2, 3, 4)
    assert j["recovery_medians_s"] == {"detect_s": pytest.approx(0.2), "first_step_s": 0.4}
    assert j["restore_from"] == {"memory": 3, "peer": 1}
    assert rows[1]["journal"] is None and rows[2]["journal"] is None
    text = bg.breakdown(rows).splitlines()
    assert len(text) == 3 and text[2].startswith("| in-job | kill | 2 | 3 | 4 | 0.20 | - | - | - | 0.40 |")
    assert text[2].endswith("| memory 3, peer 1 |")
    assert bg.breakdown(rows[1:]) == ""  # nothing journaled: no table


def test_the_gpu_variant_passes_device_backend_and_ranks_and_refuses_what_one_gpu_cannot_run():
    cpu = bg.parse([])
    assert (cpu.backend, cpu.device, cpu.nproc) == ("gloo", "cpu", 2)
    plain = bg.command(bg.MODES["in-job"], cpu, "S", "F.pt", "kill")
    assert "--device" not in plain and "--backend" not in plain  # the CPU command is unchanged
    nccl = bg.parse(["--backend", "nccl", "--nproc", "1", "--quick"])
    assert (nccl.device, nccl.nproc) == ("cuda", 1)
    cmd = bg.command(bg.MODES["in-job"], nccl, "S", "F.pt", "kill")
    i = cmd.index(bg.EXAMPLE)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "1" and cmd.index("--nproc-per-node") < i
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--backend") + 1] == "nccl"
    assert cmd.index("--device") > i  # the example's options, not the launcher's
    shared = bg.parse(["--backend", "gloo", "--device", "cuda"])
    assert bg.command(bg.MODES["relaunch"], shared, "S", "F.pt", "kill")[-4:] == ["--device", "cuda", "--backend",
                                                                                  "gloo"]
    one = bg.Schedule("kill", 3, 4.0, nranks=nccl.nproc)
    one.start(0.0)
    assert {one.due(4.0 * (k + 1)) for k in range(6)} == {0}
    for bad in (["--backend", "nccl", "--device", "cpu"], ["--backend", "nccl", "--schedule", "node"],
                ["--nproc", "0"]):
        with pytest.raises(SystemExit):
            bg.parse(bad)
