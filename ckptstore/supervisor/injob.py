"""The in-job recovery protocol (docs/design/in-job-restart.md, section 6): keys and
records in the in-job store that the node agents (agent.py) and the rank processes
(ckptstore/inprocess.py) exchange, so that a failed rank is replaced while the others
stay alive.

Every function takes the attempt's store (:func:`attempt_store`: a ``PrefixStore`` over
the job's TCPStore, ``ckptstore/<run>/<attempt>``) and works on a ``HashStore`` in one
process too (the protocol's tests). Like progress.py this imports nothing of the
package, so the rank side may use it without importing the supervisor.

Keys (values are small JSON objects; *create* = create-only, the first writer wins):

==========================  ============  ===============================================
``hello/<worker>``          each worker   pid, node, spare or member, warm-up seconds
``assign/<worker>``         leader        round, rank, local rank, world (a spare waits here)
``round/<r>/members``       leader        rank -> worker, node, pid
``round/<r>/fault``         create        ranks, cause, detected_by, t: the round failed
``round/<r>/left/<rank>``   each survivor step reached, teardown seconds, abandoned saves
``round/<r>/verdict``       leader create ``continue`` (round r+1), ``stop`` or ``cold``
``round/<r>/restored/<k>``  each member   step, tier, seconds (round r's restore)
``round/<r>/first/<k>``     each member   time of the rank's first step in round r
``pg/<r>/...``              torch         round r's process-group bootstrap
``fence``                   leader        the current round (the memory tier's commit fence)
``end``                     agents        the attempt is over: every worker exits
``replica/<node>``          each agent    its replica server's host:port (peer replicas)
==========================  ============  ===============================================

Invariants (kept by the callers, tested in tests/test_injob_protocol.py): a round's
verdict is written once; only the leader writes membership; no member of round r+1
starts before every survivor left round r; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import timedelta

# The environment the agent gives every worker (members and spares).
ENV_STORE = "CKPTSTORE_INJOB_STORE"          # host:port of the in-job TCPStore
ENV_PREFIX = "CKPTSTORE_INJOB_PREFIX"        # ckptstore/<run>/<attempt>
ENV_WORKER = "CKPTSTORE_WORKER_ID"           # <node>-<n>: unique within the attempt
ENV_SPARE = "CKPTSTORE_INJOB_SPARE"          # "1": a spare (no RANK until assigned)
ENV_NODE = "CKPTSTORE_INJOB_NODE"            # this worker's node rank
ENV_TIMEOUT = "CKPTSTORE_INJOB_TIMEOUT"      # seconds: collectives' and re-form's bound
ENV_ABORT_TIMEOUT = "CKPTSTORE_INJOB_ABORT_TIMEOUT"  # seconds a survivor may take to leave a round
ENV_MEMORY_DIR = "CKPTSTORE_MEMORY_DIR"      # node-local tmpfs directory owned by the supervisor
ENV_MEMORY_BUDGET = "CKPTSTORE_MEMORY_BUDGET"  # bytes the memory tier of this node may hold
ENV_ROUND = "CKPTSTORE_INJOB_ROUND"          # set by inprocess.run for fn: the current round
ENV_PEER_REPLICA = "CKPTSTORE_PEER_REPLICA"  # host:port of the partner node's replica server (replica.py)

VERDICTS = ("continue", "stop", "cold")
POLL_S = 0.005  # a wait's poll interval: store checks are ~0.1 ms round trips on loopback


def attempt_prefix(run_id: str, attempt: int) -> str:
    return f"ckptstore/{run_id}/{attempt}"


def attempt_store(base, prefix: str):
    """The attempt's view of the job's store ``base`` (a TCPStore or HashStore)."""
    from torch.distributed import PrefixStore

    return PrefixStore(prefix, base)


def round_pg_store(store, round_: int):
    """The store round ``round_``'s process group bootstraps in (one prefix per round: no
    key of an old round is read by a new one)."""
    from torch.distributed import PrefixStore

    return PrefixStore(f"pg/{round_}", store)


def connect(address: str, timeout_s: float = 60.0):
    """A client of the in-job TCPStore at ``host:port`` (each thread that waits on keys
    needs its own: one client serialises its requests)."""
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


# --- several nodes (agent.py, injob_nodes.py): the node agents' own records ------------
#
# ``agent/<node>``         each agent   host, pid, members (rank -> worker), live spares,
#                                       ``alive``: its probe port (injob_nodes.AliveListener)
# ``agent/<node>/beat``    each agent   a counter it bumps every BEAT_S: the leader's
#                                       clock, not the agent's, times its silence
# ``agent/<node>/done``    each agent   it ended its workers and is exiting
# ``exited/<worker>``      its agent    how a worker ended (results.exited's record)
# ``kill/<worker>``        leader       its agent must SIGKILL it (R3: a rank that did not leave)

BEAT_S = 0.5
NODE_SILENT_S = 3.0  # a node whose beat stood still this long is lost, with every rank on it
NODE_FAULT_SILENT_S = 1.5  # ... this long, after a fault notice, its agent not answering (injob_nodes.BeatWatch)
NODE_PROBE_TIMEOUT_S = 0.25  # how long the leader waits for an agent's probe port to answer


def agent_key(node: int, what: str | None = None) -> str:
    return f"agent/{node}" if what is None else f"agent/{node}/{what}"


def exited_key(worker: str) -> str:
    return f"exited/{worker}"


def kill_key(worker: str) -> str:
    return f"kill/{worker}"


# --- records -------------------------------------------------------------------------

MAX_RECORD_BYTES = 1 << 20  # a record larger than this is not one of ours: read as absent
MAX_FAULTS_BYTES = 4 << 20  # a round's notices (``faults``), every line one record


def _loads(raw) -> dict | None:
    """A record's JSON object, or None for anything else: not UTF-8 or JSON, NaN or
    Infinity, nesting deep enough to overflow the parser, larger than
    :data:`MAX_RECORD_BYTES`, or not an object (every value here is untrusted)."""
    if raw is None or len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def _no_constant(name: str):
    raise ValueError(f"JSON constant {name} is not allowed")


def int_of(value, default=None, lo: int | None = None, hi: int | None = None):
    """``value`` when it is an int (not a bool) within ``lo``..``hi``, else ``default``:
    how a field of a record (untrusted) is read as a number."""
    if not isinstance(value, int) or isinstance(value, bool):
        return default
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        return default
    return value


def rank_of(key) -> int | None:
    """A rank written as a JSON object's key (``"12"``), or None: ASCII digits only, at
    most 9 of them (``str.isdigit`` accepts '²', which ``int`` refuses)."""
    if isinstance(key, str) and 0 < len(key) <= 9 and key.isascii() and key.isdigit():
        return int(key)
    return None


def agent_members(record: dict | None) -> dict[int, str]:
    """``{rank: worker}`` of an agent's record (``agent/<node>``: ``members``), leaving
    out every malformed entry (a rank that is not digits, a worker that is not a
    non-empty string of at most 128 characters)."""
    found = record.get("members") if isinstance(record, dict) else None
    out = {}
    for r, m in (found.items() if isinstance(found, dict) else ()):
        rank, worker = rank_of(r), m.get("worker") if isinstance(m, dict) else m
        if rank is not None and isinstance(worker, str) and 0 < len(worker) <= 128:
            out[rank] = worker
    return out


def put(store, key: str, record: dict) -> None:
    store.set(key, json.dumps(record))


def get(store, key: str) -> dict | None:
    """The record at ``key``; None when absent or not a JSON object (never raises for
    bad content: every value here is read as untrusted)."""
    if not store.check([key]):
        return None
    return _loads(store.get(key))


def create(store, key: str, record: dict) -> tuple[bool, dict | None]:
    """Create ``key`` unless it exists. Returns (whether this call wrote it, the record
    the key holds). A nonce makes two writers' values differ, so the winner is known."""
    mine = json.dumps({**record, "_nonce": uuid.uuid4().hex})
    held = store.compare_set(key, "", mine)
    held = held.decode(errors="replace") if isinstance(held, bytes) else held
    value = _loads(held)
    if value is not None:
        value.pop("_nonce", None)
    return held == mine, value


def wait_for(store, keys: list[str], timeout_s: float, stop: threading.Event | None = None) -> bool:
    """Whether every key of ``keys`` exists within ``timeout_s`` (False on timeout or when
    ``stop`` is set). Polls ``check`` rather than ``wait``: a timed-out ``wait`` logs a
    C++ warning, and a stop flag must be seen promptly."""
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check(keys):
            return True
        if (stop is not None and stop.is_set()) or time.monotonic() >= deadline:
            return False
        if stop is not None:
            stop.wait(POLL_S)
        else:
            time.sleep(POLL_S)


def wait_record(store, key: str, timeout_s: float, stop: threading.Event | None = None) -> dict | None:
    return get(store, key) if wait_for(store, [key], timeout_s, stop) else None


# --- the protocol's steps ------------------------------------------------------------

def hello_key(worker: str) -> str:
    return f"hello/{worker}"


def assign_key(worker: str) -> str:
    return f"assign/{worker}"


def round_key(round_: int, name: str, rank: int | None = None) -> str:
    return f"round/{round_}/{name}" if rank is None else f"round/{round_}/{name}/{rank}"


END_KEY = "end"
FENCE_KEY = "fence"


def say_hello(store, worker: str, *, spare: bool, node: int, warm_s: float = 0.0) -> None:
    put(store, hello_key(worker), {"pid": os.getpid(), "spare": spare, "node": node,
                                   "warm_s": round(warm_s, 4), "t": time.time()})


def assign(store, worker: str, *, round_: int, rank: int, local_rank: int, world: int,
           local_world: int, node: int) -> None:
    put(store, assign_key(worker), {"round": round_, "rank": rank, "local_rank": local_rank,
                                    "world": world, "local_world": local_world, "node": node})


def post_fault(store, round_: int, *, ranks: list[int], cause: str, detected_by: str,
               t: float | None = None) -> bool:
    """Say that round ``round_`` failed. Returns whether this was the first notice (the
    record kept is the first one; later notices add their ranks to ``faults``)."""
    record = {"ranks": sorted(set(int(r) for r in ranks)), "cause": cause[:4000],
              "detected_by": detected_by, "t": time.time() if t is None else t}
    won, _ = create(store, round_key(round_, "fault"), record)
    store.append(round_key(round_, "faults"), json.dumps(record) + "\n")
    return won


def faults(store, round_: int) -> list[dict]:
    """Every notice of round ``round_`` (first one first)."""
    key = round_key(round_, "faults")
    if not store.check([key]):
        return []
    out = []
    for line in store.get(key)[:MAX_FAULTS_BYTES].decode(errors="replace").splitlines():
        value = _loads(line)
        if value is not None:
            out.append(value)
    return out


def failed_ranks(store, round_: int) -> set[int]:
    return {r for f in faults(store, round_) for r in (f.get("ranks") if isinstance(f.get("ranks"), list) else [])
            if int_of(r, lo=0) is not None}


def post_left(store, round_: int, rank: int, **info) -> None:
    put(store, round_key(round_, "left", rank), {"t": time.time(), **info})


def wait_left(store, round_: int, ranks: list[int], timeout_s: float,
              stop: threading.Event | None = None) -> dict[int, dict]:
    """The ``left`` records of ``ranks`` that arrive within ``timeout_s`` (a rank missing
    from the result did not leave in time: the leader counts it failed)."""
    deadline = time.monotonic() + timeout_s
    pending = set(ranks)
    got: dict[int, dict] = {}
    while pending:
        for r in list(pending):
            rec = get(store, round_key(round_, "left", r))
            if rec is not None:
                got[r] = rec
                pending.discard(r)
        if not pending or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            break
        time.sleep(POLL_S)
    return got


def post_verdict(store, round_: int, action: str, reason: str = "", **fields) -> dict:
    """The verdict on failed round ``round_`` (create-only: the first one stands, and it
    is returned). ``continue`` carries ``next_round``."""
    if action not in VERDICTS:
        raise ValueError(f"verdict {action!r} is not one of {VERDICTS}")
    _, held = create(store, round_key(round_, "verdict"), {"action": action, "reason": reason,
                                                            "t": time.time(), **fields})
    return held or {}


def verdict(store, round_: int) -> dict | None:
    rec = get(store, round_key(round_, "verdict"))
    return rec if rec is not None and rec.get("action") in VERDICTS else None


def post_members(store, round_: int, members: dict[int, dict]) -> None:
    put(store, round_key(round_, "members"), {str(r): m for r, m in members.items()})


def members(store, round_: int) -> dict[int, dict]:
    rec = get(store, round_key(round_, "members")) or {}
    out = {}
    for r, m in rec.items():
        if isinstance(m, dict) and rank_of(r) is not None:
            out[rank_of(r)] = m
    return out


def post_mark(store, round_: int, kind: str, rank: int, **info) -> None:
    """``restored`` or ``first``: a member's restore, or its first step, in round ``round_``."""
    put(store, round_key(round_, kind, rank), {"t": time.time(), **info})


def marks(store, round_: int, kind: str, ranks) -> dict[int, dict]:
    out = {}
    for r in ranks:
        rec = get(store, round_key(round_, kind, r))
        if rec is not None:
            out[int(r)] = rec
    return out


def set_fence(store, round_: int) -> None:
    store.set(FENCE_KEY, str(int(round_)))


def fence(store) -> int | None:
    if not store.check([FENCE_KEY]):
        return None
    raw = store.get(FENCE_KEY)
    if len(raw) > 20:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def end(store, reason: str, code: int = 0) -> None:
    """The attempt is over (finished, stopped, or going cold): workers waiting on any key
    give up at once."""
    create(store, END_KEY, {"reason": reason, "code": code, "t": time.time()})


def ended(store) -> dict | None:
    return get(store, END_KEY)


# --- peer replicas (supervisor/replica.py) -------------------------------------------

def replica_key(node: int) -> str:
    return f"replica/{node}"


def post_replica_server(store, node: int, host: str, port: int) -> None:
    """Node ``node``'s agent says where its replica server listens."""
    put(store, replica_key(node), {"address": f"{host}:{port}"})


def partner_replica(store, node: int, nnodes: int, timeout_s: float) -> str | None:
    """The ``host:port`` of the replica server of node ``node``'s partner (node rank
    (node+1) mod nnodes), the value of ``CKPTSTORE_PEER_REPLICA`` for node ``node``'s
    workers; None on one node, or when the partner has not said within ``timeout_s``."""
    if nnodes < 2:
        return None
    record = wait_record(store, replica_key((node + 1) % nnodes), timeout_s)
    address = record.get("address") if record else None
    return address if isinstance(address, str) else None
