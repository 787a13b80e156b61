"""The Checkpointer of a training loop (issue 12), in one process: whole training state
restored (model, optimizer, scheduler, Stateful objects, dicts, RNG), saves when due,
a SIGTERM turned into a save at the next step and a stop, progress records, fencing of
an older incarnation. Multi-rank and killed runs: tests/test_fault_tolerance.py."""

from __future__ import annotations

import json
import math
import os
import random
import signal

import pytest
import torch

import ckptstore
from ckptstore import names
from ckptstore import FencedError
from ckptstore.checkpoint.fencing import epochs


class Counter:
    """A Stateful object of the program's own."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def make(root, **kw):
    torch.manual_seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    counter, progress = Counter(), {"samples": 0}
    ckpt = ckptstore.Checkpointer(str(root), model=model, optimizer=opt,
                                  state={"sched": sched, "counter": counter, "progress": progress}, **kw)
    return ckpt, model, opt, sched, counter, progress


def train(model, opt, sched, counter, progress, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    sched.step()
    counter.n += 1
    progress["samples"] += 4
    return torch.rand(1).item() + random.random()  # the RNG streams must continue exactly


def run(root, steps, stop_at=None, **kw):
    ckpt, model, opt, sched, counter, progress = make(root, **kw)
    draws = []
    try:
        start = ckpt.resume()
        for step in range(start, steps):
            draws.append(train(model, opt, sched, counter, progress, step))
            if ckpt.step(step) or step == stop_at:
                break
        ckptstore.wait()
    finally:
        ckpt.close()
    return start, draws, model, opt, sched, counter, progress


def test_an_interrupted_loop_resumes_to_the_same_state_as_an_uninterrupted_one(tmp_path):
    _, ref_draws, ref_model, ref_opt, ref_sched, ref_counter, ref_progress = run(tmp_path / "ref", 12, every=4)
    start, first, *_ = run(tmp_path / "run", 12, stop_at=6, every=4)  # dies after step 6; saved 0, 4
    assert start == 0 and first == ref_draws[:7]
    start, rest, model, opt, sched, counter, progress = run(tmp_path / "run", 12, every=4)
    assert start == 5  # continues after the newest saved step
    assert rest == ref_draws[5:]  # torch and Python RNG continue exactly
    assert counter.n == ref_counter.n and progress == ref_progress
    assert sched.state_dict() == ref_sched.state_dict()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"])


def test_sigterm_saves_at_the_next_step_and_stops_the_loop(tmp_path):
    ckpt, model, opt, sched, counter, progress = make(tmp_path / "s", every=100)
    committed = []
    ckpt.on_commit = committed.append
    try:
        assert ckpt.resume() == 0
        stopped_at = None
        for step in range(50):
            train(model, opt, sched, counter, progress, step)
            if step == 7:
                os.kill(os.getpid(), signal.SIGTERM)  # handled: the process lives on
            if ckpt.step(step):
                stopped_at = step
                break
    finally:
        ckpt.close()
    assert stopped_at is not None and stopped_at >= 7 and ckpt.should_stop
    assert ckpt.store.steps() == [0, stopped_at]  # every=100 saves step 0; the signal, its step
    assert committed == [0, stopped_at]
    assert json.loads((tmp_path / "s" / names.PROGRESS_NAME).read_text())["step"] == stopped_at
    assert signal.getsignal(signal.SIGTERM) is not None  # close() put the previous handler back


def test_a_later_run_fences_off_an_earlier_one(tmp_path):
    root = str(tmp_path / "s")
    old = ckptstore.Store(root)
    old.resume(claim=True)
    old.save(1, {"w": torch.ones(2)}).result()
    new = ckptstore.Store(root)
    _, info = new.resume(claim=True)
    assert (old.epoch, new.epoch, info.epoch) == (1, 2, 2) and epochs(new.storage) == [1, 2]
    with pytest.raises(FencedError, match="epoch 2"):
        old.save(2, {"w": torch.zeros(2)}).result()
    new.save(2, {"w": torch.full((2,), 2.0)}).result()
    assert [new.manifest(s).epoch for s in new.steps()] == [1, 2]
    assert torch.equal(new.load()["w"], torch.full((2,), 2.0))
    # a reader (the default) must not fence the writer off
    ckptstore.Store(root).resume()
    assert epochs(new.storage) == [1, 2]
    new.save(3, {"w": torch.ones(2)}).result()
    # a planted claim at the top of the range: a clear error naming it, on every rank
    (tmp_path / "s" / "epochs" / "epoch-9999999999.json").write_text("{}")
    with pytest.raises(ckptstore.ResumeError, match="epoch-9999999999.json"):
        ckptstore.Store(root).resume(claim=True)


def test_bad_arguments_are_refused_with_a_clear_error(tmp_path):
    with pytest.raises(TypeError, match=r"state\['x'\] must have state_dict"):
        ckptstore.Checkpointer(str(tmp_path), state={"x": 3})
    with pytest.raises(ValueError, match="is the Checkpointer's own"):
        ckptstore.Checkpointer(str(tmp_path), state={"rng": {}})
    with pytest.raises(ValueError, match="every must be >= 1"):
        ckptstore.Checkpointer(str(tmp_path), every=0)
    with pytest.raises(ValueError, match="pass model= too"):
        ckptstore.Checkpointer(str(tmp_path), optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))


def test_a_checkpoint_without_a_named_object_is_refused_naming_it(tmp_path):
    ckptstore.Store(str(tmp_path)).save(3, {"other": 1}).result()
    ckpt = ckptstore.Checkpointer(str(tmp_path), state={"counter": Counter()}, rng=False)
    try:
        with pytest.raises(KeyError, match="'counter'"):
            ckpt.resume()
    finally:
        ckpt.close()


def test_every_auto_follows_young_daly_with_the_journals_mtbf(tmp_path):
    import math

    from ckptstore.supervisor.journal import Journal
    from ckptstore.supervisor.status import PRIOR_MTBF_S

    ckpt, model, opt, sched, counter, progress = make(tmp_path / "fresh", every="auto")
    try:
        ckpt.resume()
        for step in range(20):
            train(model, opt, sched, counter, progress, step)
            ckpt.step(step)
        ckptstore.wait()
        # the first step saves (to measure the cost); the next is due after sqrt(2 C M)
        assert ckpt.store.steps() == [0]
        assert ckpt.auto_interval_s() == pytest.approx(math.sqrt(2 * ckpt._save_blocking_s * PRIOR_MTBF_S))
    finally:
        ckpt.close()
    root = tmp_path / "journaled"
    clock = iter([1000.0, 1100.0, 1400.0, 1500.0]).__next__
    journal = Journal(ckptstore.Store(str(root)).storage, "run-1", clock=clock)
    journal.append("run_start", command=["x"], world_size=1, nnodes=1, policy={})
    journal.append("failure", attempt=0, **{"class": "transient"}, reason="rank 0 was killed by SIGKILL")
    journal.append("failure", attempt=1, **{"class": "transient"}, reason="rank 0 was killed by SIGKILL")
    journal.append("give_up", reason="test", code=11, **{"class": "restart_limit"})
    ckpt = ckptstore.Checkpointer(str(root), state={"counter": Counter()}, every="auto")
    try:
        ckpt.resume()
        assert ckpt._mtbf_s == pytest.approx(250.0)  # 500 s of run, 2 failures
    finally:
        ckpt.close()
    with pytest.raises(ValueError, match="'auto'"):
        ckptstore.Checkpointer(str(root), every="sometimes")


def test_every_auto_is_bounded_by_the_runs_wall_clock_and_a_maximum(tmp_path):
    """A journal whose ``finish`` claimed ``t: 1e300`` made every="auto" choose an
    interval of about 1e149 s: after its first step the job never saved again."""
    import json
    import time

    from ckptstore.supervisor.journal import Journal

    root = tmp_path / "store"
    storage = ckptstore.Store(str(root)).storage
    start = time.time() - 1000.0
    journal = Journal(storage, "run-1", clock=iter([start, start + 1.0]).__next__)
    journal.append("run_start", command=["x"], world_size=1, nnodes=1, policy={})
    journal.append("failure", attempt=0, **{"class": "transient"}, reason="rank 0 was killed by SIGKILL")
    us = int((start + 2.0) * 1e6)
    event = {"kind": "finish", "run": "run-1", "at": "x", "t": 1e300, "host": "h", "step": 9}
    storage.put(f"journal/run-1/{us:016d}-00000001-finish.json", json.dumps(event).encode())
    ckpt = ckptstore.Checkpointer(str(root), state={"counter": Counter()}, every="auto")
    try:
        ckpt.resume()
        assert 0 < ckpt._mtbf_s <= time.time() - start  # at most the run's wall clock
        assert ckpt._mtbf_s == pytest.approx(2.0)  # start to finish, by the events' names
        ckpt.step(0)  # the first step saves, measuring the cost
        ckptstore.wait()
        assert ckpt.store.steps() == [0]
        assert 0 < ckpt.auto_interval_s() == pytest.approx(math.sqrt(2 * ckpt._save_blocking_s * 2.0))
        ckpt._mtbf_s, ckpt._save_blocking_s = 1e300, 1e300  # whatever the figures: a maximum
        from ckptstore.supervisor.status import MAX_INTERVAL_S

        assert ckpt.auto_interval_s() == MAX_INTERVAL_S == 6 * 3600.0
    finally:
        ckpt.close()
