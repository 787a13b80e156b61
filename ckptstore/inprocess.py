"""In-job restart, the rank side (docs/design/in-job-restart.md, sections 5.2 and 6).

``run(main, args)`` calls ``main(args)``. Under ``ckptstore run --in-job`` (the node
agent exports ``CKPTSTORE_INJOB_STORE``) it calls it again in this same process after
each in-job recovery, in a re-formed process group, so that a peer's failure costs
this rank no new interpreter, no import and no CUDA context; elsewhere (torchrun,
today's relaunch mode, plain python) it calls it once.

One round of an in-job process::

    init_process_group(store=<in-job store>/pg/<r>)  -> main(...)  -> returns: done
        monitor thread: round/<r>/fault or end -> shut the group's sockets, RoundAborted
    main raised (a lost peer, RoundAborted): abandon saves, destroy, post left, gc,
        wait for the leader's verdict: continue in round r+1 (same rank), stop, or cold

A rank's own program error is not handled here: it ends the process as today (the
error file says why; the agent replaces the rank and the leader classifies it).

The abort shim: gloo (torch 2.13) has no abort that interrupts a blocked collective,
so on a fault notice the monitor shuts down the group's connected sockets (never its
listener: shutting that std::terminates the process; never the store's): the blocked
collective raises "Connection closed by peer" at once. NCCL: torch's group abort
(``_abort_process_group``: every communicator of the process in one NCCL group call) in
a thread bounded by the abort timeout; a rank whose abort does not return kills itself
and a spare takes its rank. NCCL needs one GPU per rank (``cuda:LOCAL_RANK``, set before
each round's group) and the settings in ``NCCL_ENV``. The NCCL path has not run on a GPU
yet: tests/test_gpu_injob.py and bench/gpu_check.sh wait for one.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref

from .supervisor import injob

__all__ = ["InJobUnsupportedError", "RoundAborted", "atomic", "round", "run"]

_round = round  # (the builtin: this module's round() is the in-job round)
_WAKE_SIGNAL = signal.SIGURG  # ignored by default: a no-op handler makes a blocking call return to Python
DEFAULT_TIMEOUT_S = 60.0  # collectives and re-form, when the agent does not say
DEFAULT_ABORT_TIMEOUT_S = 10.0


class RoundAborted(BaseException):
    """Raised into the training function when its round failed (a peer died or hung).
    A BaseException so that ``except Exception`` in the program lets it through."""


class InJobUnsupportedError(RuntimeError):
    """The program cannot be restarted in-process as written; the message says the fix."""


class InJobEnded(SystemExit):
    """The in-job attempt ended for this process (a stop or cold verdict, the agent's
    end, or a wait that timed out): the process exits non-zero, the agent decides."""


# --- the round this process is in, and the async abort's gate ------------------------

class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.round: int | None = None  # None outside in-job mode
        self.rank: int | None = None
        self.store = None  # the attempt's store, main thread's client
        self.armed = False  # main runs fn: an async RoundAborted may land
        self.atomic = 0  # depth of atomic() on the main thread
        self.deferred = False  # an abort waits for atomic() to end
        self.injected = False  # an async RoundAborted was set and may not have landed yet
        self.first_posted = False
        self.last_step: int | None = None
        self.stats: dict = {}  # the last leave's timings (teardown_s, gc_s), for tests and people
        self.at_end: list = []  # weak methods called when the round ends


_state = _State()


def round() -> int:  # noqa: A001 (the design's name)
    """The current in-job round (0 outside in-job mode)."""
    return _state.round or 0


def active() -> bool:
    """Whether this process runs a training function under in-job restart."""
    return _state.round is not None


def last_leave() -> dict:
    """Timings of this process's last exit from a failed round: ``teardown_s`` (the
    exception caught to the group destroyed and ``left`` posted), ``gc_s``."""
    return dict(_state.stats)


class atomic:
    """``with inprocess.atomic():`` no async :class:`RoundAborted` lands inside; one that
    arrives meanwhile is raised when the block ends (unless it ends by an exception:
    that one is unwinding already). ckptstore's own saves use it around their blocking
    part. A collective inside still fails at once when the group is aborted."""

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            with _state.lock:
                pending = _state.injected and _state.armed and not _state.atomic
                if pending:  # set just before: raised here rather than inside
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)
                    _state.injected = False
                else:
                    _state.atomic += 1
            if pending:
                raise RoundAborted(f"in-job round {round()} failed")
        return self

    def __exit__(self, exc_type, exc, tb):
        if threading.current_thread() is not threading.main_thread():
            return False
        with _state.lock:
            _state.atomic = max(0, _state.atomic - 1)
            fire = _state.atomic == 0 and _state.deferred and _state.armed
            if _state.atomic == 0:
                _state.deferred = False
        if fire and exc_type is None:
            raise RoundAborted(f"in-job round {round()} failed (the abort waited for an atomic section)")
        return False


def _inject_abort(main_ident: int) -> None:
    """The monitor's async exception into the main thread (deferred inside atomic())."""
    with _state.lock:
        if not _state.armed:
            return
        if _state.atomic:
            _state.deferred = True
            return
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main_ident), ctypes.py_object(RoundAborted))
        _state.injected = True
    with contextlib.suppress(Exception):  # wake a blocking call (time.sleep, a read) to let it land
        if signal.getsignal(_WAKE_SIGNAL) is _wake:
            signal.pthread_kill(main_ident, _WAKE_SIGNAL)


def _disarm() -> None:
    """Main thread, fn has returned or raised: no async abort from now on; one set but
    not yet landed is withdrawn."""
    with _state.lock:
        _state.armed = False
        _state.deferred = False
        _state.atomic = 0
        if _state.injected:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident), None)
            _state.injected = False


def _wake(signum, frame) -> None:
    """Runs Python code on the main thread, where a pending async exception lands."""


# --- hooks the Checkpointer calls (training.py) --------------------------------------

def at_round_end(method) -> None:
    """Call ``method()`` on the main thread when this round ends, by a return or a failure
    (a Checkpointer restores its signal handlers: they must not keep the round's objects
    alive nor outlive it). Held weakly; nothing happens outside in-job mode."""
    if _state.round is not None:
        _state.at_end.append(weakref.WeakMethod(method))


def _round_ended() -> None:
    hooks, _state.at_end = _state.at_end, []
    for ref in reversed(hooks):
        method = ref()
        if method is not None:
            with contextlib.suppress(Exception):
                method()


def note_step(step: int) -> None:
    """The training loop finished ``step``: the first one of a round is posted
    (``round/<r>/first/<rank>``: the leader's recovery ends there)."""
    if _state.round is None:
        return
    _state.last_step = int(step)
    if not _state.first_posted:
        _state.first_posted = True
        with contextlib.suppress(Exception):
            injob.post_mark(_state.store, _state.round, "first", _state.rank, step=int(step))


def note_restored(step, tier, seconds: float) -> None:
    """The Checkpointer's resume in this round: ``round/<r>/restored/<rank>``."""
    if _state.round is None:
        return
    if step is not None:
        _state.last_step = int(step)
    with contextlib.suppress(Exception):
        injob.post_mark(_state.store, _state.round, "restored", _state.rank, step=step, tier=tier,
                        seconds=_round(seconds, 4))


# --- the group's sockets: the gloo abort shim ----------------------------------------

def _socket_inodes() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _fds_of(inodes: set[int]) -> dict[int, int]:
    """{fd: socket inode} of this process's sockets among ``inodes``."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and int(target[8:-1]) in inodes:
            fds[int(fd)] = int(target[8:-1])
    return fds


def _sock(fd: int, inode: int) -> socket.socket | None:
    """A socket object over a duplicate of ``fd``, if it still is socket ``inode`` (the fd
    may have been closed and reused since it was listed)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino == inode:
            return socket.socket(fileno=dup)
    except OSError:
        pass
    os.close(dup)
    return None


class _GroupSockets:
    """The sockets round r's group opened: those that appeared during its init, re-read
    at abort time (gloo may connect lazily: a new socket accepted by the group's
    listener, or one to a peer already connected at init, counts). Never those that
    existed before init (the store's clients)."""

    def __init__(self, before: set[int]):
        self.before = before
        self.at_init = _socket_inodes() - before

    def shut(self) -> int:
        listen_ports: set[int] = set()
        peer_ports: set[tuple] = set()
        candidates = _socket_inodes() - self.before
        socks = {}
        for fd, inode in _fds_of(candidates).items():
            s = _sock(fd, inode)
            if s is None or s.family not in (socket.AF_INET, socket.AF_INET6):
                if s is not None:
                    s.close()
                continue
            socks[fd] = s
        connected = {}
        for fd, s in socks.items():
            try:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    listen_ports.add(s.getsockname()[1])
                    continue
                connected[fd] = (s, s.getsockname()[1], s.getpeername()[:2])
            except OSError:
                continue  # not connected (any more)
        init_fds = set(_fds_of(self.at_init))
        for fd, (_, local, peer) in connected.items():
            if fd in init_fds and local not in listen_ports:
                peer_ports.add(peer)  # a peer's listener this group connected to
        shut = 0
        for fd, (s, local, peer) in connected.items():
            if fd in init_fds or local in listen_ports or peer in peer_ports:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
        for s in socks.values():
            s.close()  # (the dup only)
        return shut


def _abort_nccl() -> None:
    """Abort every process group of this process (torch's group abort: the NCCL
    communicators of the default group and of every subgroup in one
    ncclGroupStart/End, so that one communicator's abort does not wait on a kernel of
    another: pytorch#119797). A group already gone (destroyed, or aborted by NCCL's
    watchdog and removed) leaves nothing to abort."""
    from torch.distributed import distributed_c10d as c10d

    if c10d.GroupMember.WORLD is None:
        return
    c10d._abort_process_group()


def _abort_group(sockets: _GroupSockets | None, backend: str, timeout_s: float) -> bool:
    """Make the group's blocked collectives return. Returns False when an NCCL abort did
    not return within ``timeout_s`` (ncclCommAbort can hang: NVIDIA/nccl#1013)."""
    if backend == "nccl":
        def abort():
            with contextlib.suppress(Exception):  # (a group destroyed meanwhile: nothing left to abort)
                _abort_nccl()

        # In a thread: a call into NCCL that never returns must not take this one with it.
        t = threading.Thread(target=abort, name="ckptstore-nccl-abort", daemon=True)
        t.start()
        t.join(timeout_s)
        return not t.is_alive()
    if sockets is not None:
        sockets.shut()
    return True


def _abort_or_die(sockets: _GroupSockets | None, backend: str, timeout_s: float, round_: int, rank) -> None:
    """``_abort_group``; a rank whose NCCL abort did not return is stuck for good (its
    main thread waits on a kernel that the abort was to end, and a CUDA context cannot
    be reset from inside the process): it says so and SIGKILLs itself, so that its
    agent sees it exit and a spare takes its rank. It posts no ``left`` record: the
    leader would count it a survivor and give it the next round."""
    if _abort_group(sockets, backend, timeout_s):
        return
    _say(f"rank {rank}: the NCCL abort of round {round_}'s process group did not return within "
         f"{timeout_s:g}s (CKPTSTORE_INJOB_ABORT_TIMEOUT); this process kills itself and a spare takes rank {rank}")
    os.kill(os.getpid(), signal.SIGKILL)


class _Monitor(threading.Thread):
    """Waits (on its own store client: one client serialises its requests, and the main
    thread's store calls must not queue behind a wait) for round r's fault notice or
    the attempt's end; then aborts the group and interrupts the main thread."""

    def __init__(self, store, round_: int, sockets, backend: str, abort_timeout_s: float, rank):
        super().__init__(name=f"ckptstore-inprocess-monitor-{round_}", daemon=True)
        self.store, self.round_, self.sockets, self.rank = store, round_, sockets, rank
        self.backend, self.abort_timeout_s = backend, abort_timeout_s
        self.stop = threading.Event()
        self.fired = threading.Event()
        self.main_ident = threading.main_thread().ident

    def run(self) -> None:
        fault = injob.round_key(self.round_, "fault")
        tick = 0
        try:
            while not self.stop.is_set():
                if self.store.check([fault]) or (tick % 10 == 0 and self.store.check([injob.END_KEY])):
                    break
                tick += 1
                self.stop.wait(injob.POLL_S)
            else:
                return
        except Exception:  # the store is gone: the gloo timeout ends a blocked collective
            return
        if self.stop.is_set():
            return
        self.fired.set()
        _abort_or_die(self.sockets, self.backend, self.abort_timeout_s, self.round_, self.rank)
        _inject_abort(self.main_ident)

    def finish(self) -> None:
        self.stop.set()
        self.join()


# --- errors: machinery or the program's ----------------------------------------------

def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, first one last."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _is_machinery(exc: BaseException) -> bool:
    from .supervisor.classify import _MACHINERY

    return bool(_MACHINERY.search(f"{type(exc).__module__}.{type(exc).__name__}: {exc}"))


def _clear(exc: BaseException) -> None:
    for e in _chain(exc):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        e.__context__ = e.__cause__ = None


# --- run -----------------------------------------------------------------------------

def run(fn, /, *args, backend=None, timeout=None, warmup=None, **kwargs):
    """Call ``fn(*args, **kwargs)``; under ``ckptstore run --in-job``, call it again in
    this process after each in-job recovery, in a re-formed default process group.
    Elsewhere (torchrun, today's relaunch mode, python) call it once and return its
    result.

    ``backend``: the process group's (default gloo; nccl: one GPU per rank, cuda:LOCAL_RANK
    set before each round's group, ``NCCL_ENV`` applied, refused without torch's group
    abort, NCCL or a GPU); ``timeout``: its collectives' in
    seconds (default the agent's ``CKPTSTORE_INJOB_TIMEOUT``, else 60); ``warmup``: a
    spare calls it once before it is assigned a rank, in a one-rank group that is then
    destroyed: build the model and optimizer there, so their first-call costs are paid
    before a failure. ``fn`` must build everything that holds the group itself
    (docs/design/in-job-restart.md section 11) and let BaseException through."""
    if not callable(fn):
        raise TypeError(f"inprocess.run: fn must be a callable (a function that runs the training), "
                        f"got {type(fn).__name__} {fn!r:.80}")
    if warmup is not None and not callable(warmup):
        raise TypeError(f"inprocess.run: warmup must be a callable (a function that runs the training setup once "
                        f"in a spare), got {type(warmup).__name__} {warmup!r:.80}")
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise InJobUnsupportedError(
            f"inprocess.run: {getattr(fn, '__qualname__', fn)!r} is a generator or coroutine function; "
            "pass a plain function that runs the training and returns")
    if not os.environ.get(injob.ENV_STORE):
        return fn(*args, **kwargs)
    return _InJob(backend, timeout, warmup).run(fn, args, kwargs)


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def _say(line: str) -> None:
    sys.stderr.write(f"ckptstore.inprocess: {line}\n")
    sys.stderr.flush()


# NCCL settings of an in-job rank, unless the environment sets them (docs/training.md):
NCCL_ENV = {
    # 2 = CleanUpOnly: on a collective's timeout or an NCCL error, the watchdog aborts the
    # communicator and the waiting call raises; it does not end the process (torch's
    # default, 3, does: a survivor whose collective timed out would be lost). The
    # monitor's abort is the usual way out; this is the backstop when no notice comes.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # 0: a CUDA error the watchdog sees after an abort (a kernel ended by it) is no
    # reason to tear the process down (NVRx's setting for in-process restart).
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
}
# TORCH_NCCL_BLOCKING_WAIT stays torch's default (0): wait() then only orders streams and
# the main thread blocks in a CUDA synchronisation (loss.item(), a copy to the CPU), which
# should return once the abort has ended the NCCL kernels (they poll NCCL's abort flag;
# to be seen with two GPUs). 1 (wait() blocks on the CPU until the work ends) is untested.


def _check_nccl() -> None:
    """Refuse NCCL in-job when this torch cannot abort a group or has no NCCL/CUDA."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    # (only this is called: it reaches each backend's abort itself, whatever the version)
    if not hasattr(c10d, "_abort_process_group"):
        raise InJobUnsupportedError(
            "inprocess.run: backend 'nccl' needs torch's process-group abort (_abort_process_group), which "
            f"torch {torch.__version__} lacks: a survivor could not leave a collective whose peer died. Use "
            "torch 2.5 or later (checked against 2.13), or run without --in-job (the relaunch mode)")
    if not dist.is_nccl_available():
        raise InJobUnsupportedError(
            f"inprocess.run: backend 'nccl', but this torch ({torch.__version__}) is built without NCCL; "
            "install a CUDA build of torch, or use backend='gloo'")
    if not torch.cuda.is_available():
        raise InJobUnsupportedError(
            "inprocess.run: backend 'nccl', but no CUDA device is visible to this process "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use backend='gloo' on CPU")


def _local_rank(assignment: dict, rank: int, world: int) -> int:
    """The assigned local rank, or ``rank`` when the record's field is not an int in 0..world-1."""
    return injob.int_of(assignment.get("local_rank"), rank, 0, max(0, world - 1))


def _subgroup_refs() -> list:
    """Weak references to the groups other than the default one (new_group, a mesh's),
    taken before a failed round destroys them all: one still alive a round later is kept
    by the program (``_check_old_groups``)."""
    import torch.distributed as dist

    try:
        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        return [weakref.ref(g) for g in list(dist.distributed_c10d._world.pg_map) if g is not default]
    except Exception:  # (a private map: its absence costs only the warning)
        return []


def _set_cuda_device(local_rank: int) -> None:
    """One GPU per rank: ``cuda:LOCAL_RANK`` (NCCL refuses two ranks of one communicator
    on one device). Set before the group is made, so that its communicator, the
    program's ``torch.device("cuda")`` and a spare given this rank use that device."""
    import torch

    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise InJobUnsupportedError(
            f"inprocess.run: local rank {local_rank} has no GPU of its own: this node shows {count} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); NCCL needs one GPU "
            "per rank: start at most that many ranks per node (--nproc-per-node)")
    torch.cuda.set_device(local_rank)


class _InJob:
    def __init__(self, backend, timeout, warmup):
        import torch.distributed as dist

        backend = backend or "gloo"
        if backend not in ("gloo", "nccl"):
            raise InJobUnsupportedError(
                f"inprocess.run: backend {backend!r} cannot be restarted in-job (gloo or nccl); "
                "run without --in-job or use one of them")
        if dist.is_initialized():
            raise InJobUnsupportedError(
                "inprocess.run: a default process group exists already (created at import time or before run()); "
                "create it inside the training function (`if not dist.is_initialized(): "
                "dist.init_process_group(...)`): inprocess.run makes one per round")
        if backend == "nccl":
            _check_nccl()
            for name, value in NCCL_ENV.items():  # read when a group is made: before the first round's
                os.environ.setdefault(name, value)
        self.backend = backend
        self.timeout_s = float(timeout) if timeout is not None else _env_float(injob.ENV_TIMEOUT, DEFAULT_TIMEOUT_S)
        self.abort_timeout_s = _env_float(injob.ENV_ABORT_TIMEOUT, DEFAULT_ABORT_TIMEOUT_S)
        self.warmup = warmup
        self.worker = os.environ.get(injob.ENV_WORKER, f"pid{os.getpid()}")
        self.node = int(os.environ.get(injob.ENV_NODE, "0") or 0)
        self.warned = False
        self.old_groups: list = []  # (round, weak reference to its group), for _check_old_groups

    # -- set-up ------------------------------------------------------------------------
    def _connect(self):
        address, prefix = os.environ[injob.ENV_STORE], os.environ.get(injob.ENV_PREFIX, "")
        main = injob.connect(address, self.timeout_s)
        monitor = injob.connect(address, self.timeout_s)
        if prefix:
            return injob.attempt_store(main, prefix), injob.attempt_store(monitor, prefix)
        return main, monitor

    def _warm_up(self) -> float:
        """A spare's warm-up: ``warmup()`` in a one-rank gloo group over a HashStore,
        destroyed and collected afterwards; no progress file written for it."""
        if self.warmup is None:
            return 0.0
        import torch.distributed as dist

        began = time.monotonic()
        hidden = {k: os.environ.pop(k) for k in ("CKPTSTORE_PROGRESS_DIR",) if k in os.environ}
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                self.warmup()
            finally:
                dist.destroy_process_group()
        finally:
            os.environ.update(hidden)
        gc.collect()
        return time.monotonic() - began

    def _assignment(self, store) -> dict:
        """Round, rank, world, ...: the environment's for a member, ``assign/<worker>``
        for a spare (which waits, unbounded, until assigned or the attempt ends)."""
        if os.environ.get(injob.ENV_SPARE) == "1":
            warm_s = self._warm_up()
            injob.say_hello(store, self.worker, spare=True, node=self.node, warm_s=warm_s)
            key = injob.assign_key(self.worker)
            while True:
                if store.check([key]):
                    rec = injob.get(store, key)
                    if rec is not None:
                        return rec
                if store.check([injob.END_KEY]):
                    sys.exit(0)  # never assigned: nothing to say
                time.sleep(injob.POLL_S)
        injob.say_hello(store, self.worker, spare=False, node=self.node)
        env = os.environ
        try:
            return {"round": 0, "rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"]),
                    "local_rank": int(env.get("LOCAL_RANK", env["RANK"])),
                    "local_world": int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                    "node": int(env.get("GROUP_RANK", self.node))}
        except (KeyError, ValueError) as e:
            raise InJobUnsupportedError(f"inprocess.run: a member's environment lacks {e} "
                                        "(RANK and WORLD_SIZE come from the node agent)") from None

    # -- the rounds ----------------------------------------------------------------------
    def run(self, fn, args, kwargs):
        store, monitor_store = self._connect()
        a = self._assignment(store)
        # What exists now (torch, the program's modules, a spare's warm-up leftovers) is not
        # the rounds' garbage: out of the collector's sight, the gc.collect() of each leave
        # scans only what the rounds made (measured: 0.25-0.35 s down to a few ms).
        gc.freeze()
        rank, world = int(a["rank"]), int(a["world"])
        round_ = int(a["round"])
        previous_wake = None
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(_WAKE_SIGNAL)
            if current in (signal.SIG_DFL, signal.SIG_IGN, None):
                previous_wake = current
                signal.signal(_WAKE_SIGNAL, _wake)
        _state.store, _state.rank = store, rank
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
            import faulthandler

            faulthandler.register(signal.SIGUSR1, all_threads=True)  # the agent's hang watch asks for stacks
        try:
            while True:
                done, result = self._round(fn, args, kwargs, store, monitor_store, round_, rank, world, a)
                if done:
                    return result
                round_ = self._next_round(store, round_, rank)
        finally:
            _state.round = None
            if previous_wake is not None:
                with contextlib.suppress(Exception):
                    signal.signal(_WAKE_SIGNAL, previous_wake)

    def _export(self, round_: int, rank: int, world: int, a: dict) -> None:
        # (the assignment is a record of the in-job store: its fields are read as untrusted)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_RANK": str(_local_rank(a, rank, world)),
                           "LOCAL_WORLD_SIZE": str(injob.int_of(a.get("local_world"), world, 1, world)),
                           "GROUP_RANK": str(injob.int_of(a.get("node"), self.node, 0)), injob.ENV_ROUND: str(round_)})

    def _round(self, fn, args, kwargs, store, monitor_store, round_, rank, world, a):
        import torch.distributed as dist
        from datetime import timedelta

        self._export(round_, rank, world, a)
        _state.round, _state.first_posted, _state.last_step = round_, False, None
        if self.backend == "nccl":
            _set_cuda_device(_local_rank(a, rank, world))
        before = _socket_inodes()
        try:
            dist.init_process_group(self.backend, store=injob.round_pg_store(store, round_), rank=rank,
                                    world_size=world, timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:  # a failure to re-form is a failure of this round (a peer died meanwhile)
            cause = f"{type(e).__name__}: {e}"[:500]
            with contextlib.suppress(Exception):
                injob.post_fault(store, round_, ranks=[], cause=cause, detected_by="rank:init")
            del e
            self._leave(store, round_, rank, cause, time.monotonic(), lambda: None)
            return False, None
        group_ref = weakref.ref(dist.distributed_c10d._get_default_group())
        sockets = _GroupSockets(before) if self.backend == "gloo" else None

        monitor = _Monitor(monitor_store, round_, sockets, self.backend, self.abort_timeout_s, rank)
        monitor.start()
        failed = None
        try:
            try:
                with _state.lock:
                    _state.armed = True
                result = fn(*args, **kwargs)
            finally:
                _disarm()
        except BaseException as exc:
            caught = time.monotonic()
            chain = _chain(exc)
            aborted = any(isinstance(e, RoundAborted) for e in chain) or monitor.fired.is_set()
            machinery = _is_machinery(chain[-1])
            notice = aborted or _has(store, injob.round_key(round_, "fault"))
            if not (aborted or machinery or notice):
                monitor.finish()
                raise  # the program's own error: the process ends with it, as today
            if not notice:  # this rank saw the fault first: wake its other peers, then say so
                _abort_or_die(sockets, self.backend, self.abort_timeout_s, round_, rank)
                with contextlib.suppress(Exception):
                    injob.post_fault(store, round_, ranks=[], cause=f"{type(chain[-1]).__name__}: {chain[-1]}",
                                     detected_by="rank:collective")
            monitor.finish()
            failed = (f"{type(chain[-1]).__name__}: {chain[-1]}"[:500], caught)
            _clear(exc)
            del chain
        if failed is not None:  # (out of the except block: the exception and its frames are gone)
            self._leave(store, round_, rank, *failed, group_ref)
            return False, None
        monitor.finish()
        _round_ended()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.old_groups:  # (the earlier rounds' groups must be gone by now)
            gc.collect()
            self._check_old_groups()
        return True, result

    def _leave(self, store, round_, rank, cause, caught, group_ref) -> None:
        import torch.distributed as dist

        from . import lifecycle

        _round_ended()
        abandoned = lifecycle.abandon(f"in-job round {round_} failed: {cause}", self.abort_timeout_s)
        refs = [group_ref] + _subgroup_refs()  # (a subgroup kept across rounds blocks the next one)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        teardown_s = time.monotonic() - caught
        injob.post_left(store, round_, rank, step=_state.last_step, teardown_s=_round(teardown_s, 4),
                        abandoned=abandoned, cause=cause)
        began = time.monotonic()
        _drop_torch_caches()
        gc.collect()  # the largest cost of leaving: the leader decides meanwhile
        _state.stats = {"teardown_s": teardown_s, "gc_s": time.monotonic() - began}
        self._check_old_groups()
        self.old_groups.extend((round_, ref) for ref in refs)

    def _check_old_groups(self) -> None:
        """Warn (once) when the group of an earlier round is still alive. Checked a round
        later, not at the leave: a save abandoned then lets go of the state it holds
        (and so of the group) only when its commit thread next polls."""
        alive = [(r, ref) for r, ref in self.old_groups if ref() is not None]
        self.old_groups = alive
        if not alive or self.warned:
            return
        self.warned = True
        round_, group = alive[0][0], alive[0][1]()
        kinds = sorted(_referrer_kinds(group)) if group is not None else []
        del group
        warnings.warn(f"in-job round {round_}: its process group or a subgroup of it (dist.new_group, a "
                      f"DeviceMesh) is still referred to (by {', '.join(kinds) or 'unknown objects'}) a round "
                      "later: the model, mesh or group was built outside the training function (a global, a "
                      "cache, warmup=); build it inside: a destroyed group used again blocks the round until "
                      "its timeout, and its memory is never freed", RuntimeWarning, stacklevel=3)

    def _next_round(self, store, round_: int, rank: int) -> int:
        """Wait for the leader's verdict on ``round_``: the next round's number, or exit."""
        deadline = time.monotonic() + self.timeout_s
        key = injob.round_key(round_, "verdict")
        while True:
            if store.check([key]):
                v = injob.verdict(store, round_)
                if v is not None:
                    break
            if store.check([injob.END_KEY]):
                end = injob.ended(store) or {}
                raise InJobEnded(_ended(f"the attempt ended while rank {rank} waited for round {round_}'s "
                                        f"verdict: {end.get('reason', '?')}", end.get("code")))
            if time.monotonic() >= deadline:
                raise InJobEnded(_ended(f"no verdict on round {round_} within {self.timeout_s:g}s "
                                        f"(ckptstore run --reform-timeout, CKPTSTORE_INJOB_TIMEOUT); rank {rank} exits, the agent relaunches"))
            time.sleep(injob.POLL_S)
        action, reason = v["action"], v.get("reason", "")
        if action == "stop":
            why = reason or "a deterministic error on a peer"
            raise InJobEnded(_ended(f"the job stops after round {round_}: {why}", v.get("code")))
        if action == "cold":
            raise InJobEnded(_ended(f"in-job recovery gave up after round {round_} ({reason or 'no reason given'}); "
                                    "the agent relaunches the job cold", v.get("code")))
        next_round = v.get("next_round", round_ + 1)
        if not isinstance(next_round, int) or next_round <= round_:
            raise InJobEnded(_ended(f"round {round_}'s verdict names no next round ({next_round!r})"))
        members = injob.members(store, next_round)
        mine = members.get(rank)
        if members and mine is None:
            raise InJobEnded(_ended(f"rank {rank} is no member of round {next_round}; this process ({self.worker}) "
                                    "was dropped"))
        if mine is not None and mine.get("worker") not in (None, self.worker):
            raise InJobEnded(_ended(f"rank {rank} went to worker {mine.get('worker')} in round {next_round}; "
                                    f"this process ({self.worker}) was dropped"))
        return next_round


def _drop_torch_caches() -> None:
    """Torch's process-wide DTensor caches hold the round's DeviceMesh (sharding
    propagation: Python lru_caches and a C++ cache keyed by specs; the redistribute
    plans and planners; the mesh topology), and the mesh holds the group: emptied, or
    the old round's group, its sockets and its model's specs live on (found with the
    example's FSDP2 model). Rebuilt by the next round's first ops."""
    if "torch.distributed.tensor" not in sys.modules:
        return

    def module(name):
        return __import__(name, fromlist=["_"])

    steps = (
        lambda: module("torch.distributed.tensor.debug")._clear_sharding_prop_cache(),
        lambda: module("torch.distributed.tensor._redistribute").clear_redistribute_planner_cache(),
        lambda: module("torch.distributed.tensor._redistribute")._gen_transform_infos.cache_clear(),
        lambda: module("torch.distributed.tensor._sharding_prop").ShardingPropagator
        ._propagate_tensor_meta_cached.cache_clear(),
        lambda: module("torch.distributed.tensor._collective_utils").MeshTopoInfo.build_from_mesh.cache_clear(),
    )
    for step in steps:
        with contextlib.suppress(Exception):  # (private APIs of torch: each one best effort)
            step()


def _referrer_kinds(obj) -> set[str]:
    """The types of what refers to ``obj`` (an instance's ``__dict__`` named by its owner)."""
    kinds = set()
    here = sys._getframe()
    gc.unfreeze()  # (get_referrers does not see frozen objects: module-level caches made at import)
    try:
        referrers = gc.get_referrers(obj)
    finally:
        gc.freeze()
    for r in referrers:
        if r is here or isinstance(r, weakref.ref):
            continue
        if inspect.isframe(r):  # a live frame (another thread's, or one above this call)
            kinds.add(f"frame of {r.f_code.co_name} ({os.path.basename(r.f_code.co_filename)})")
            continue
        if isinstance(r, dict):
            owners = [o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
            if owners:
                kinds.update(type(o).__name__ for o in owners)
            else:
                kinds.add("dict")
        else:
            kinds.add(type(r).__name__)
    return kinds


def _ended(message: str, code=None) -> int:
    _say(message)
    return code if isinstance(code, int) and not isinstance(code, bool) and code != 0 else 1


def _has(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:
        return False
