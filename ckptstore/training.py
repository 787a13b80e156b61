"""A training loop's checkpoints over a :class:`~ckptstore.Store`: resume at start-up,
save every N steps or seconds, save once more and stop on preemption (SIGTERM).

A thin layer: everything it does is ``Store.resume`` / ``Store.save`` plus the
``state_dict()`` / ``load_state_dict()`` calls a program would otherwise write, and the
bookkeeping that must agree across ranks (when a save is due, when to stop).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
from collections import deque
import threading
import time
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist

from . import durable_cadence
from . import format as fmt
from . import inprocess
from . import lifecycle
from . import names
from .store import Store
from .checkpoint import exiting
from .checkpoint.flatten import _is_dtensor
from .checkpoint.walk import tensors_in
from .checkpoint.group import rank_and_world
from .config import config
from .resume import ResumeInfo
from .rng import rng_state, set_rng_state
from .storage import Storage
from .supervisor.progress import STEP_WINDOW, ProgressReporter, guard_worker
from .supervisor.status import PRIOR_MTBF_S, status, young_daly
from .supervisor.injob import ENV_ROUND

MEMORY_OVERHEAD_SAVES = 50  # every="auto" with a memory tier: a save at least every 50 save costs (2%)
PROGRESS_EVERY = 10.0  # seconds between progress records (each is one small PUT)


def is_stateful(obj) -> bool:
    """The protocol torch.distributed.checkpoint uses: schedulers, GradScaler,
    torchdata's StatefulDataLoader, and any object of the program's own."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Checkpointer:
    """Checkpoints of one training run.

    ``model`` and ``optimizer`` are saved and restored through
    ``torch.distributed.checkpoint.state_dict`` (plain modules, DDP and FSDP2 alike:
    FSDP2's DTensors are saved by shard and resharded on load). ``state`` names further
    objects: each is Stateful (saved by ``state_dict()``, restored by
    ``load_state_dict()``) or a dict of plain values (restored in place). RNG states
    (:func:`ckptstore.rng_state`) are captured unless ``rng=False``.

    Saves run every ``every`` steps and/or every ``every_seconds`` seconds (the ranks
    agree on it); ``every="auto"`` follows Young/Daly (:meth:`auto_interval_s`); on one of ``signals`` (default SIGTERM: preemption, or the launcher
    stopping the job) the next :meth:`step` saves, waits up to ``exit_deadline`` seconds
    for the commit, and returns True: the loop should stop. Repeated signals change
    nothing (a scheduler and the launcher may both send one). ``on_commit(step)`` is called (on ckptstore's
    commit thread) when a save has committed; ``on_resume(info)`` after a resume. ``prepare=True``:
    after the first step, make the first save's staging memory ready in the background
    (:func:`ckptstore.prepare`), so that save copies without page faults. Off by
    default: in stress runs of docs/examples/fault_tolerant_training.py it raised the
    rate of torch's gloo abort at interpreter exit (2 in 25 runs with it, none in 39
    without), for reasons not yet understood (the aborting thread is gloo's).
    """

    def __init__(self, store: Store | str, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, state: Mapping[str, Any] | None = None,
                 every: int | str | None = None, every_seconds: float | None = None, rng: bool = True,
                 signals=(signal.SIGTERM,), exit_deadline: float | None = None,
                 replicated=(), validate=None, on_resume: Callable[[ResumeInfo], None] | None = None,
                 on_commit: Callable[[int], None] | None = None, map_location=None, prepare: bool = False):
        self.store = store if isinstance(store, Store) else Store(store)
        self.model, self.optimizer, self.rng = model, optimizer, rng
        self.prepare = prepare  # ckptstore.prepare after the first step
        self._prepared = None  # the staging warm-up started after the first step
        self.objects = dict(state or {})
        for name, obj in self.objects.items():
            if name in _RESERVED:
                raise ValueError(f"state name {name!r} is the Checkpointer's own: choose another")
            if not (is_stateful(obj) or isinstance(obj, MutableMapping)):
                raise TypeError(f"state[{name!r}] must have state_dict()/load_state_dict() or be a dict, "
                                f"got {type(obj).__name__}")
        if optimizer is not None and model is None:
            raise ValueError("an optimizer is saved together with its model: pass model= too")
        self._auto = every == "auto"
        if self._auto:
            every = None
        elif every is not None and (isinstance(every, str) or every < 1):
            raise ValueError(f"every must be >= 1 or 'auto', got {every!r}")
        self.every, self.every_seconds = every, every_seconds
        self._mtbf_s = PRIOR_MTBF_S  # every="auto": the run's observed MTBF, read at resume
        self.exit_deadline = exit_deadline
        self.replicated, self.validate, self.on_resume = tuple(replicated), validate, on_resume
        self.on_commit = on_commit
        self.map_location = map_location
        self.info: ResumeInfo | None = None
        self.last_saved: int | None = None
        self._last_save_time = time.monotonic()
        self._last_progress = float("-inf")
        self._signalled = threading.Event()
        self._previous: dict[int, Any] = {}
        self._install(signals)
        # Under `ckptstore run`: progress for the supervisor (hangs, lost work, intervals).
        self._rank = rank_and_world(self.store.process_group)[0]
        self._reporter = ProgressReporter.from_env(self._rank)
        self._waiting_from: str | None = None  # the state a wait for saves reported over
        if self._reporter is not None:
            guard_worker()
            lifecycle.on_wait(self._on_wait)
        inprocess.at_round_end(self._restore_handlers)  # (in-job mode: the handlers go with the round)
        self._last_step_time: float | None = None
        self._step_s: float | None = None  # smoothed training step time
        self._recent_steps: deque = deque(maxlen=STEP_WINDOW)  # the last step times (stragglers)
        self._save_blocking_s: float | None = None

    # ------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Restore the newest step every rank can use; returns the step to run next
        (0 when the store holds no checkpoint). ``self.info`` says what was found."""
        self._report("loading", force=True, section="resume")
        began = time.monotonic()
        if self._auto:
            self._mtbf_s = _journal_mtbf(self.store.storage)
        template = self._state_dict()
        sharded = any(_is_dtensor(t) for t in tensors_in(template))
        # An in-job recovery's round (> 0) claims no durable epoch: the memory tier's
        # commits are fenced by the round instead (docs/design/in-job-restart.md 7.3).
        state, info = self.store.resume(template if sharded else None, map_location=self.map_location,
                                        validate=self.validate, claim=_injob_round() == 0)
        self.info = info
        if self._reporter is not None:
            self._reporter.note_longest("resume", time.monotonic() - began)
        inprocess.note_restored(info.step, info.tier, time.monotonic() - began)  # (in-job mode only)
        self._report("train", None if info.step is None else info.step, force=True, section="step",
                     resumed_step=info.step,
                     resumed_tier=info.tier, resumed_age_s=info.age_s, skipped=[s.step for s in info.skipped])
        if self._reporter is not None and info.step is not None:
            self._reporter.note_committed(info.step, time.time() - (info.age_s or 0.0))
        if state is None:
            return 0
        self._load_state_dict(state)
        if self.on_resume is not None:
            self.on_resume(info)
        self.last_saved = info.step
        self._record_progress(info.step, force=True)
        return info.step + 1

    # ------------------------------------------------------------------ steps
    def step(self, step: int, metrics: dict | None = None, *, stream=None) -> bool:
        """Call after finishing ``step``: saves when due; returns True when the loop
        must stop (a signal arrived; the final save is committed or its deadline passed).
        ``stream``: what a save's copies of CUDA tensors wait for (:meth:`save`)."""
        now = time.monotonic()
        if self._last_step_time is not None:
            took = now - self._last_step_time
            self._step_s = took if self._step_s is None else 0.8 * self._step_s + 0.2 * took
            self._recent_steps.append(took)
            if self._reporter is not None:
                self._reporter.note_longest("step", took)
        first = self._last_step_time is None
        self._last_step_time = now
        inprocess.note_step(step)  # (in-job mode only: the round's first step is the recovery's end)
        if first:  # the supervisor measures launch-to-first-step from this
            self._report("train", step, force=True, section="step", first_step_t=time.time())
            if self.prepare:
                self._prepare()
        else:
            self._report("train", step, section="step")
        cadence = getattr(self.store, "durable_cadence", None)  # durable_every="auto"
        durable_flags = cadence.flags() if cadence is not None else (False, False)
        preempted, due_time, durable_due = self._agree(self._signalled.is_set(), self._due_by_time(), durable_flags)
        due = preempted or due_time or (self.every is not None and step % self.every == 0)
        if due and step != self.last_saved:
            # a preemption's save goes to the durable tier too: the node may not come back
            future = self.save(step, metrics, durable=preempted, stream=stream,
                               durable_due=durable_due if cadence is not None else None)
            if preempted:
                self._report("saving", step, force=True, section="save")  # the wait for its commit
                self._finish(future)
        self._record_progress(step, force=preempted)
        if preempted:
            self._report("preempted", step, force=True)
        self._last_step_time = time.monotonic()  # a save's blocking time is not step time
        return preempted

    def _prepare(self) -> None:
        """After the first step, when the optimizer has made its state: the staging
        memory of the first save is made ready in the background (ckptstore.prepare),
        so that save copies without page faults."""
        from .warmup import prepare

        parts: list = []
        if self.model is not None:
            parts += [list(self.model.parameters()), list(self.model.buffers())]
        if self.optimizer is not None:
            parts.append(list(self.optimizer.state.values()))
        try:
            self._prepared = prepare(parts)
        except Exception as e:  # only a speed-up: it must never stop training
            warnings.warn(f"ckptstore: could not prepare the staging memory of the first save: {e}",
                          RuntimeWarning, stacklevel=3)

    def save(self, step: int, metrics: dict | None = None, durable: bool = False, *, stream=None,
             durable_due: bool | None = None):
        """Save now (collective); returns the :class:`~ckptstore.SaveFuture`.
        ``durable``: with a two-tier store, promote this step whatever ``durable_every``
        says (every rank alike). ``stream``: what the copies of CUDA tensors wait for
        (:meth:`Store.save`); default each device's current stream. ``durable_due``: see
        :meth:`Store.save` (:meth:`step` passes what the ranks agreed on)."""
        began = time.monotonic()
        self._report("saving", step, section="save")  # a supervisor does not take a long staging copy for a hang
        with inprocess.atomic():  # an in-job abort waits for the staging copy (a failing collective does not)
            future = self.store.save(step, self._state_dict(), metrics, replicated=self.replicated,
                                     durable=durable, stream=stream,
                                     **({} if durable_due is None else {"durable_due": durable_due}))
        self._save_blocking_s = time.monotonic() - began
        if self._reporter is not None:
            self._reporter.note_longest("save", self._save_blocking_s)
        self._report("train", step, section="step", memory_full=self.store.memory_full)
        if self._reporter is not None:  # where the next attempt resumes (a local tier's commit too)
            reporter = self._reporter

            def committed(f):
                if f.failure() is None:
                    reporter.note_committed(step, time.time())
                    reporter.note_longest("save", time.monotonic() - began)  # start to commit

            future.add_done_callback(committed)
        if self.on_commit is not None:
            on_commit = self.on_commit
            # (not f.exception(): that would mark a failure seen, and the next save would not raise it)
            future.add_done_callback(lambda f: on_commit(step) if f.failure() is None else None)
        self.last_saved = step
        self._last_save_time = time.monotonic()
        return future

    @property
    def should_stop(self) -> bool:
        return self._signalled.is_set()

    def _report(self, state: str, step: int | None = None, force: bool = False, **fields) -> None:
        if self._reporter is not None:
            median = statistics.median(self._recent_steps) if self._recent_steps else None
            if inprocess.active():
                fields["round"] = inprocess.round()
            self._reporter.report(state, step, force, step_s=self._step_s, step_median_s=median,
                                  save_blocking_s=self._save_blocking_s, **fields)

    def _on_wait(self, waiting: bool) -> None:
        """While the process waits for its saves (``ckptstore.wait()`` after the loop,
        the exit drain), a supervisor sees this rank saving: the final commit of a slow
        upload is no hang."""
        if waiting and self._reporter.record["state"] == "train":
            self._waiting_from = "train"
            self._report("saving", force=True, section="save")
        elif not waiting and self._waiting_from is not None:
            if self._reporter.record["state"] == "saving":
                self._report(self._waiting_from, force=True, section="step")
            self._waiting_from = None

    def close(self) -> None:
        """Restore the signal handlers; in-flight saves keep going (``ckptstore.wait()``
        and the exit wait for them). With a memory tier, the newest save is promoted to
        the durable tier now if no promotion covers it: the memory tier is removed with
        the job (a collective in effect: every rank closes after the same saves)."""
        self._restore_handlers()
        self.store.promote_newest()

    def _restore_handlers(self) -> None:
        for signum, previous in self._previous.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, previous)
        self._previous.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals
    def _state_dict(self) -> dict:
        out: dict[str, Any] = {}
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

            if self.optimizer is not None:
                out["model"], out["optimizer"] = get_state_dict(self.model, self.optimizer)
            else:
                out["model"] = get_model_state_dict(self.model)
        for name, obj in self.objects.items():
            out[name] = obj.state_dict() if is_stateful(obj) else dict(obj)
        if self.rng:
            out["rng"] = rng_state()
        return out

    def _load_state_dict(self, state: dict) -> None:
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

            if self.optimizer is not None:
                set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optimizer"])
            else:
                set_model_state_dict(self.model, state["model"])
        for name, obj in self.objects.items():
            if name not in state:
                raise KeyError(f"the checkpoint holds no {name!r}: was it saved by another program?")
            if is_stateful(obj):
                obj.load_state_dict(state[name])
            else:
                obj.clear()
                obj.update(state[name])
        if self.rng and "rng" in state:
            # The resume decided, in one numbering (ranks of the store's group), whether
            # this rank reads its own state; an RNG state it re-derived already says
            # this rank. So restore it as it is, whichever numbering it was saved in.
            saved = state["rng"].get("rank") if isinstance(state["rng"], dict) else None
            set_rng_state(state["rng"], rank=saved)

    def _due_by_time(self) -> bool:
        interval = self.auto_interval_s() if self._auto else self.every_seconds
        return interval is not None and time.monotonic() - self._last_save_time >= interval

    def auto_interval_s(self) -> float:
        """``every="auto"``: Young/Daly's interval, sqrt(2 x blocking save cost x MTBF),
        with the MTBF the run's journal has observed (``ckptstore status``; a prior of
        one failure a day before any) and the cost of this run's last save (the first
        save comes at the first step, to measure it); never more than
        ``supervisor.status.MAX_INTERVAL_S`` (6 hours) nor less than
        ``MIN_INTERVAL_SAVES`` (5) times that cost, whatever the journal claims.
        With a memory tier, also never more than ``MEMORY_OVERHEAD_SAVES`` (50) times
        that cost: a save costing milliseconds is worth 2% of the time whatever the
        MTBF is believed to be (before the first failure the prior says a day, and
        Young/Daly would let a minute of work be lost to it)."""
        if self._save_blocking_s is None:
            return 0.0
        interval = young_daly(self._save_blocking_s, self._mtbf_s)
        if getattr(getattr(self, "store", None), "memory", None) is not None:  # (a memory tier)
            interval = min(interval, MEMORY_OVERHEAD_SAVES * self._save_blocking_s)
        return interval

    def _agree(self, preempted: bool, due_time: bool,
               durable: tuple[bool, bool] = (False, False)) -> tuple[bool, bool, bool]:
        """Every rank's view, combined (any rank signalled / any rank's clock says due),
        so that all of them save the same step; and whether that save is promoted to the
        durable tier (``durable``: this rank's ``durable_cadence`` flags (due, busy); any
        rank due and none busy: durable_cadence.agreed). One all-reduce."""
        group = self.store.process_group
        _, world = rank_and_world(group)
        if world == 1:
            return preempted, due_time, durable_cadence.agreed([durable])
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        flags = torch.tensor([int(preempted), int(due_time), int(durable[0]), int(durable[1])],
                             dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return bool(flags[0]), bool(flags[1]), durable_cadence.agreed([(bool(flags[2]), bool(flags[3]))])

    def _finish(self, future) -> None:
        """The preemption save: wait for its commit as the exit drain does (a peer that
        died makes it stop at once), within the deadline; the loop stops either way."""
        deadline = self.exit_deadline if self.exit_deadline is not None else config().exit_timeout
        try:
            lifecycle.drain(deadline)
        finally:
            exiting.leave()

    def _record_progress(self, step: int, force: bool = False) -> None:
        """The last step reached, for the run's journal (lost work = this - the resumed
        step). Rank 0 only, and at most every PROGRESS_EVERY seconds."""
        now = time.monotonic()
        if self._rank != 0:
            return
        if not force and now - self._last_progress < PROGRESS_EVERY:
            return
        self._last_progress = now
        write_progress(self.store.storage, step)

    def _install(self, signals) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        signalled = self._signalled  # (not self: a handler left installed must not keep the model alive)

        def on_signal(signum, frame):
            # Idempotent: a scheduler and the launcher may both send one (Slurm signals
            # every process of the job, torchrun forwards its own); the launcher's
            # SIGKILL after its grace is the backstop for a loop that never gets back.
            signalled.set()

        lifecycle.install_hooks()  # first: our handler replaces its SIGTERM drain while we run
        for signum in signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, on_signal)


_RESERVED = ("model", "optimizer", "rng")


def write_progress(storage: Storage, step: int) -> None:
    """Best effort: a missed record only makes lost work look larger."""
    try:
        record = {"step": int(step), "at": fmt.utc_now()}
        storage.put(names.PROGRESS_NAME, json.dumps(record).encode())
    except Exception:
        pass


def _injob_round() -> int:
    """The in-job recovery round this process runs in (0 outside ``ckptstore run --in-job``)."""
    try:
        return int(os.environ.get(ENV_ROUND) or 0)
    except ValueError:
        return 0


def _journal_mtbf(storage: Storage) -> float:
    """The MTBF ``ckptstore status`` reports for the store's latest supervised run (at
    most the run's wall clock: status takes every event's time into [0, now]), or the
    prior (no journal, no failure yet, or an unreadable one)."""
    try:
        mtbf = status(storage).get("mtbf_s")
    except Exception:
        mtbf = None
    ok = isinstance(mtbf, (int, float)) and not isinstance(mtbf, bool) and math.isfinite(mtbf) and mtbf > 0
    return float(mtbf) if ok else PRIOR_MTBF_S
