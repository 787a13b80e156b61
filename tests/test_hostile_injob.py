"""Hostile input on the in-job surfaces (issue 36's memory tier and its helpers): what
anyone able to reach the in-job TCPStore, the replica server's port, the memory root or
the shared journal can make the supervisor, its agent or a rank do.

- storage/c10d.py: index entries are untrusted names (refused, never followed); an
  index whose children come and go stays bounded (compaction), never losing a
  concurrent writer's entry.
- supervisor/memory.py: a killed supervisor's memory directory is swept at the next
  start; a live one's never.
- supervisor/replica.py: bounded connections, headers, bodies' pace, files; garbage
  markers and requests refused with an error reply.
- supervisor/injob.py, peers.py: records of the wrong type or shape read as absent.
- supervisor/consensus.py: heartbeats with garbage content or impossible modification
  times read as absent, with a warning, never a crash or a node kept alive.

Every case asserts the refusal (or that the input was ignored) and that nothing outside
the root was written or read."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstore.errors import FormatError, ObjectTooLargeError
from ckptstore.hashing import digest
from ckptstore.storage import MemoryStorage, ObjectInfo
from ckptstore.storage import c10d
from ckptstore.storage.c10d import C10dStorage
from ckptstore.supervisor import consensus, injob, memory, replica
from ckptstore.supervisor.replica import ReplicaClient, ReplicaServer

ROOT = Path(__file__).resolve().parents[1]
VICTIM = b"outside the root: never read, changed or deleted"
ATTEMPT = "20261207T104500-0123456789ab"
PATH = f"step-000000000007/attempts/{ATTEMPT}/data-r00003-s00.bin"


# ---------------------------------------------------------------------------- c10d
@pytest.mark.parametrize("entry", ["+../victim", "+/abs", "+..", "+a\\b", "+a/b", "+" + "x" * 5000,
                                   "*plain", "+", "+./"],
                         ids=["dotdot", "absolute", "dotdot-only", "backslash", "two-parts", "huge", "no-sign",
                              "empty", "dot-dir"])
def test_c10d_an_index_entry_that_is_not_one_key_part_is_refused_not_followed(entry):
    store = torch.distributed.HashStore()
    store.set("victim", VICTIM)  # outside the storage's prefix: what "../victim" would reach
    storage = C10dStorage(store, "mem/")
    storage.put("a/ok.json", b"1")
    store.append("mem/i/", entry + c10d.SEP)  # a hostile writer with the store's address
    # (c/b.json: a new directory, so its parent's index is read)
    for call in (storage.list, lambda: list(storage.walk()), lambda: storage.put("c/b.json", b"2")):
        with pytest.raises(FormatError) as e:
            call()
        assert "index" in str(e.value) and "not followed" in str(e.value)
    store.append("mem/i/a", entry + c10d.SEP)  # a child view's index too
    with pytest.raises(FormatError):
        storage.child("a").list()
    assert store.get("victim") == VICTIM


def test_c10d_an_index_too_large_or_not_utf8_is_refused():
    store = torch.distributed.HashStore()
    storage = C10dStorage(store, "mem/")
    store.set("mem/i/", b"+a\xff\xfe\0")
    with pytest.raises(FormatError, match="not UTF-8"):
        storage.list()
    store.set("mem/i/", b"+a\0" * (c10d.MAX_INDEX_BYTES // 3 + 1))
    with pytest.raises(FormatError, match="more than"):
        storage.list()


def test_c10d_the_root_index_stays_bounded_over_many_steps():
    """A memory tier saving every step: the root index gains "+step-N/" and, once
    retention drops the step, "-step-N/" (about 40 bytes a step). Compaction keeps it
    near what is live, so each step's replay no longer grows with the job's length."""
    store = torch.distributed.HashStore()
    storage = C10dStorage(store, "mem/")
    sizes = []
    for step in range(600):
        storage.put(f"step-{step:012d}/manifest.json", b"m")
        if step >= 2:
            storage.delete(f"step-{step - 2:012d}/manifest.json")
        sizes.append(len(store.get("mem/i/")))
    assert storage.list() == [f"step-{598:012d}/", f"step-{599:012d}/"]
    # 600 steps unbounded: ~600 * 2 * 20 bytes = 24 KB; bounded: the threshold plus what is live.
    assert max(sizes) <= c10d.COMPACT_MIN_BYTES + 64, max(sizes)
    assert sizes[-1] < c10d.COMPACT_MIN_BYTES + 64


def test_c10d_compaction_never_loses_an_entry_appended_meanwhile():
    """A writer appends between the replay's read and the compaction's swap: the swap
    (compare_set against the replayed value) fails, the entry stays, the next replay
    compacts."""
    class Racing:
        def __init__(self):
            self.inner, self.raced = torch.distributed.HashStore(), 0

        def compare_set(self, key, expected, desired):
            if key == "mem/i/d" and expected not in (c10d.PROBE, b"") and not self.raced:
                self.raced += 1  # another client's put lands right now
                self.inner.set("mem/o/d/late.json", self.inner.compare_set("mem/o/d/x-0.json", c10d.PROBE, c10d.PROBE))
                self.inner.append(key, "+late.json" + c10d.SEP)
            return self.inner.compare_set(key, expected, desired)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    store = Racing()
    storage = C10dStorage(store, "mem/")
    for i in range(300):  # enough dead entries in d's index to pass the threshold (replayed at each delete)
        storage.put(f"d/x-{i}.json", b"x")
        if i:
            storage.delete(f"d/x-{i}.json")
    assert store.raced == 1
    assert storage.list("d") == ["late.json", "x-0.json"]
    assert len(store.inner.get("mem/i/d")) < c10d.COMPACT_MIN_BYTES + 64  # compacted on a later replay


def test_c10d_an_append_over_the_cap_is_refused_before_it_is_buffered():
    storage = C10dStorage(torch.distributed.HashStore(), "mem/")
    writer = storage.open_append("big.bin")
    writer.append(b"x" * 10)
    with pytest.raises(ObjectTooLargeError, match="commit records only"):
        writer.append(b"y" * c10d.MAX_OBJECT_BYTES)
    assert writer.close() == 10 and storage.read("big.bin") == b"x" * 10
    mem = MemoryStorage()
    w = mem.open_append("a.bin")  # the same writer class: memory's has no cap
    assert w.append(b"ab") == 0 and w.append(b"cd") == 2 and w.close() == 4 and mem.read("a.bin") == b"abcd"


# ---------------------------------------------------------------------------- memory dir
_OWNER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("memory", sys.argv[4])  # (stdlib only: no torch to import)
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
path = memory.claim_dir(sys.argv[1], sys.argv[2], sys.argv[3])
open(path + "/data-r00000-s00.bin", "wb").write(b"x" * 100)
print("ready", flush=True)
sys.stdin.read()
"""


def _owner(root, run, node):
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(root), run, node, memory.__file__],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    return proc


def test_a_killed_supervisors_memory_dir_is_swept_and_a_live_ones_never(tmp_path):
    root, outside = tmp_path / "shm", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(VICTIM)
    killed = _owner(root, "run1-abcd", "0")
    other = _owner(root, "run2-abcd", "0")  # another run's, killed too
    live = _owner(root, "run3-abcd", "0")
    try:
        # While its owner lives, the same run and node is refused, and nothing is swept.
        with pytest.raises(memory.MemoryDirBusy, match="live supervisor"):
            memory.claim_dir(str(root), "run1-abcd", "0")
        assert (root / "run1-abcd" / "0" / "data-r00000-s00.bin").exists()
        (root / "legacy-abcd" / "0").mkdir(parents=True)  # no owner file: whose it is cannot be told
        (root / "link-abcd").symlink_to(outside)
        for proc in (killed, other):
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        said, swept = [], []
        path = memory.claim_dir(str(root), "run1-abcd", "0", say=said.append, swept=swept)
        assert sorted(swept) == [str(root / "run1-abcd" / "0"), str(root / "run2-abcd" / "0")]
        assert os.listdir(path) == [] and not (root / "run2-abcd").exists()
        assert len(said) == 2 and all("removed" in line and "killed" in line for line in said), said
        assert f"pid {killed.pid}" in " ".join(said)
        assert (root / "run3-abcd" / "0" / "data-r00000-s00.bin").exists()  # live: untouched
        assert (root / "legacy-abcd" / "0").is_dir()
        assert (outside / "victim").read_bytes() == VICTIM and sorted(os.listdir(outside)) == ["victim"]
        memory.release_dir(str(root), "run1-abcd", "0")
        assert not (root / "run1-abcd").exists()
    finally:
        live.kill()
        live.wait(timeout=60)


def test_a_garbage_owner_file_is_never_taken_for_this_hosts(tmp_path):
    root = tmp_path / "shm"
    (root / "r-abcd" / "0").mkdir(parents=True)
    (root / "r-abcd" / "0.owner").write_bytes(b"\xff" * 10000)  # unlocked, unreadable as JSON
    (root / "r-abcd" / "1").mkdir()
    (root / "r-abcd" / "1.owner").write_text(json.dumps({"pid": 1, "host": "another-host"}))
    assert memory.sweep_stale(str(root)) == []
    assert (root / "r-abcd" / "0").is_dir() and (root / "r-abcd" / "1").is_dir()


# ---------------------------------------------------------------------------- replica server
@pytest.fixture
def server(tmp_path):
    srv = ReplicaServer(tmp_path / "node1", budget_bytes=1 << 20, host="127.0.0.1", timeout_s=1.0,
                        max_connections=2)
    port = srv.start()
    yield srv, port
    srv.close()


def _trickle(s: socket.socket, data: bytes) -> int:
    """Send ``data`` one byte per 0.3 s (a slow client: each recv of the server is within
    its 1 s timeout) until the server closes the connection; the bytes sent."""
    sent = 0
    try:
        while sent < len(data):
            s.sendall(data[sent:sent + 1])
            sent += 1
            time.sleep(0.3)  # (the attack's pace, not a wait for anything)
    except OSError:  # the server closed it: a reset
        pass
    return sent


def _ended_by_server(s: socket.socket) -> bytes:
    """What the server sent before it closed ``s`` (the socket's timeout bounds the wait)."""
    got = b""
    while True:
        try:
            piece = s.recv(1 << 16)
        except ConnectionResetError:
            piece = b""
        if not piece:
            return got
        got += piece


def _request(port: int, header: dict) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        raw = json.dumps(header).encode()
        s.sendall(len(raw).to_bytes(4, "big") + raw)
        got = _ended_by_server(s) if header.get("op") != "ok" else b""
        n = int.from_bytes(got[:4], "big")
        return json.loads(got[4:4 + n])


def test_replica_connections_past_the_bound_are_closed_at_once(server, tmp_path):
    srv, port = server
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as third:
            assert _ended_by_server(third) == b""  # closed unserved, before any timeout
        assert any("refused" in e for e in srv.errors)
    finally:
        for s in idle:
            s.close()
    # The idle ones end (closed here, or by the server's timeout): the server serves again.
    deadline = time.monotonic() + 30
    while srv._active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ReplicaClient("127.0.0.1", port).put_file(PATH, b"fine") == digest(b"fine")


def test_replica_a_trickling_header_is_cut_off_by_the_request_deadline(server):
    srv, port = server
    raw = json.dumps({"op": "put", "path": PATH, "length": 1, "xxh3": "0" * 32}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(len(raw).to_bytes(4, "big"))
        started = time.monotonic()
        sent = _trickle(s, raw)
        assert _ended_by_server(s) == b""
    assert sent < len(raw) and time.monotonic() - started < 20
    assert any("Timeout" in e for e in srv.errors), srv.errors  # (each byte came within the 1 s timeout)
    assert not (Path(srv.root) / PATH).exists()


def test_replica_a_length_past_the_free_space_is_refused_without_a_budget(tmp_path):
    srv = ReplicaServer(tmp_path / "node1", None, host="127.0.0.1")
    port = srv.start()
    try:
        reply = _request(port, {"op": "put", "path": PATH, "length": 1 << 62, "xxh3": "0" * 32})
        assert not reply["ok"] and "do not fit" in reply["error"]
        assert not [p for p in Path(srv.root).rglob("*") if p.is_file()]
    finally:
        srv.close()


def test_replica_files_per_replica_are_bounded(server, monkeypatch):
    srv, port = server
    monkeypatch.setattr(replica, "MAX_REPLICA_FILES", 2)
    client = ReplicaClient("127.0.0.1", port)
    client.put_file(PATH, b"")
    client.put_file(PATH.replace("-s00", "-s01"), b"")
    with pytest.raises(replica.ReplicaError, match="at most 2"):
        ReplicaClient("127.0.0.1", port).put_file(PATH.replace("-s00", "-s02"), b"")
    assert not (Path(srv.root) / PATH.replace("-s00", "-s02")).exists()


def test_replica_a_garbage_marker_and_wrong_typed_requests_are_refused_not_a_crash(server, tmp_path):
    srv, port = server
    marker = Path(replica.marker_path(srv.root, 7, 3))
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"attempt": ATTEMPT, "files": 5, "older": "abc"}))
    client = ReplicaClient("127.0.0.1", port)
    assert client.put_file(PATH, b"data") == digest(b"data")  # the marker is rebuilt, not trusted
    client.seal(7, 3, ATTEMPT, [PATH])
    from ckptstore import peers

    assert peers.is_replica(srv.root, 7, 3, ATTEMPT)
    for bad in ({"op": "retire", "rank": True, "below": 9}, {"op": "retire", "rank": 3, "below": -1},
                {"op": "retire", "rank": "3", "below": 9}, {"op": "seal", "step": "7", "rank": 3,
                                                               "attempt": ATTEMPT, "files": [PATH]},
                {"op": "seal", "step": 7, "rank": 3, "attempt": ATTEMPT, "files": [PATH] * 300},
                {"op": "seal", "step": 7, "rank": 3, "attempt": ATTEMPT, "files": "x"},
                {"op": ["put"]}, {"op": "put", "path": PATH, "length": True, "xxh3": "0" * 32},
                {"op": "put", "path": PATH, "length": 1.5, "xxh3": "0" * 32}):
        reply = _request(port, bad)
        assert reply["ok"] is False and reply["error"], bad
    assert (Path(srv.root) / PATH).read_bytes() == b"data"  # nothing retired by a bad request
    marker.write_text(json.dumps({"sealed": "true", "attempt": [ATTEMPT]}))
    assert not peers.is_replica(srv.root, 7, 3, ATTEMPT)


@pytest.mark.parametrize("address", ["h:99999", "h:0", "h:\u00b2", "h:" + "9" * 30, "h:-1", ":80", "h"])
def test_replica_addresses_with_a_bad_port_are_refused(address):
    with pytest.raises(ValueError, match="host:port"):
        ReplicaClient.from_address(address)


# ---------------------------------------------------------------------------- injob records
@pytest.mark.parametrize("raw", ['{"a": NaN}', '{"a": Infinity}', "[" * 100000, "[]", '"x"', "\xff",
                                 '{"a": "' + "x" * (injob.MAX_RECORD_BYTES + 1) + '"}', '{"a": 1'],
                         ids=["nan", "inf", "deep", "list", "string", "not-utf8", "huge", "truncated"])
def test_injob_records_that_are_not_small_finite_objects_read_as_absent(raw):
    store = torch.distributed.HashStore()
    store.set("k", raw)
    assert injob.get(store, "k") is None
    store.set(injob.round_key(0, "fault"), raw)
    won, held = injob.create(store, injob.round_key(0, "fault"), {"ranks": [1]})
    assert not won and held is None


def test_injob_faults_members_fence_with_wrong_types_are_left_out():
    store = torch.distributed.HashStore()
    for record in ({"ranks": None}, {"ranks": 5}, {"ranks": "12"}, {"ranks": {"3": 1}},
                   {"ranks": [-1, True, 2.0, "4", 2]}):
        store.append(injob.round_key(0, "faults"), json.dumps(record) + "\n")
    store.append(injob.round_key(0, "faults"), "[" * 100000 + "\n")
    assert injob.failed_ranks(store, 0) == {2}
    store.set(injob.round_key(0, "members"), json.dumps({"\u00b2": {"worker": "w"}, "9" * 5000: {"worker": "w"},
                                                         "1": {"worker": "w1"}, "2": "w2", "x": {}}))
    assert injob.members(store, 0) == {1: {"worker": "w1"}}
    for raw in ("9" * 5000, "one", "\xff"):
        store.set(injob.FENCE_KEY, raw)
        assert injob.fence(store) is None
    assert injob.agent_members({"members": {"0": {"worker": "w0"}, "1": {"worker": 5}, "\u00b2": {"worker": "w"},
                                            "3": "w3", "4": {"worker": "x" * 500}}}) == {0: "w0", 3: "w3"}
    assert injob.agent_members({"members": [1, 2]}) == {} and injob.agent_members(None) == {}
    assert injob.int_of("1", 7) == 7 and injob.int_of(True, 7) == 7 and injob.int_of(3, 7, lo=0) == 3


def test_peer_records_with_names_that_are_not_ranks_are_ignored():
    from ckptstore import peers

    storage = MemoryStorage()

    class Tier:
        def location(self, step):
            return storage.child(f"step-{step}")

    for name in ("done-00001", "done-\u00b2", "done-" + "9" * 40, "sending-abc", "sending-00002", "other-00003"):
        storage.put(f"step-5/peer/{name}", b"{}")
    assert peers.records_of(Tier(), 5) == {"sending": {2}, "done": {1}}


# ---------------------------------------------------------------------------- heartbeats
class _Beats:
    """A store whose heartbeat listing is scripted: node "a" (this one) beats anew at
    every look; node "b"'s object has the modification time the test gives."""

    def __init__(self, b_mtime):
        self.b_mtime, self.looks = b_mtime, 0

    def walk(self, prefix=""):
        self.looks += 1
        return iter([ObjectInfo(f"{prefix}/a.json", 10, 1000.0 + self.looks),
                     ObjectInfo(f"{prefix}/b.json", 10, self.b_mtime)])

    def put(self, key, data, if_absent=False):
        pass


@pytest.mark.parametrize("mtime", [math.nan, math.inf, -math.inf])
def test_a_heartbeat_with_an_impossible_mtime_reads_as_absent_and_its_node_is_judged(mtime, capsys):
    now = [0.0]
    beats = consensus.Heartbeats(_Beats(mtime), "run1", "a", beat_s=1.0, timeout_s=10.0, monotonic=lambda: now[0])
    for t in range(0, 30, 2):  # each look: "a" changed; "b" never counts as a beat (NaN != NaN)
        now[0] = float(t)
        beats.refresh()
    assert "b" in beats.stopped(["a", "b"])
    assert "heartbeat ignored" in capsys.readouterr().err


def test_a_heartbeat_with_an_mtime_out_of_the_calendar_is_reported_not_a_crash():
    now = [0.0]
    beats = consensus.Heartbeats(_Beats(1e20), "run1", "a", beat_s=1.0, timeout_s=10.0, monotonic=lambda: now[0])
    beats.refresh()
    now[0] = 30.0
    stopped = beats.stopped(["a", "b"])
    assert "b" in stopped and "t=1e+20" in stopped["b"]


def test_a_heartbeat_with_garbage_content_gives_no_step_times_and_a_warning(capsys):
    storage = MemoryStorage()
    beats = consensus.Heartbeats(storage, "run1", "a", beat_s=1.0, timeout_s=100.0)
    folder = consensus.beats_dir("run1")
    storage.put(f"{folder}/b.json", b'{"attempt": 0, "step_times": {"1": NaN}}')
    storage.put(f"{folder}/c.json", b"[1, 2]")
    storage.put(f"{folder}/d.json", json.dumps({"attempt": 0, "step_times_seq": 1, "host": 5, "step_times": {
        "\u00b2": 1.0, "2": -1.0, "3": 1e300, "4": True, "5": 0.5}}).encode())
    out = beats.cross_node(0, {0: 0.25})
    assert out[0][1] == {0: 0.25} and out[1:] == [(None, {5: 0.5})]
    err = capsys.readouterr().err
    assert "node b's heartbeat ignored" in err and "node c's heartbeat ignored" in err


def test_the_supervisor_says_and_journals_what_it_swept(tmp_path, capsys):
    from ckptstore.supervisor import runner
    from ckptstore.supervisor.decide import Policy

    root = tmp_path / "shm"
    sup = runner.Supervisor(str(tmp_path / "store"), ["train.py"], policy=Policy(in_job=True, memory_dir=str(root)),
                            run_id="20261207T131500-0123ab")
    killed = _owner(root, sup._memory_run(), "0")  # this run and node, killed before it could clean up
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    sup._claim_memory()
    try:
        assert sup._memory_path and os.listdir(sup._memory_path) == []
        assert "memory tier: removed" in capsys.readouterr().err
        events = [e for e in sup.journal.events() if e["kind"] == "memory_swept"]
        assert len(events) == 1 and events[0]["paths"] == [sup._memory_path] and events[0]["count"] == 1
    finally:
        sup._release_memory()
    assert not (root / sup._memory_run()).exists()


@pytest.mark.parametrize("value", [b"", b"ab", b"XYZ" + b"\0" * 16 + b"data",
                                   c10d._HEADER.pack(c10d._MAGIC, b"n" * 8, math.nan) + b"data"],
                         ids=["empty", "short", "other-magic", "nan-mtime"])
def test_c10d_a_value_not_written_by_this_store_is_refused_on_read_and_left_out_of_listings(value):
    store = torch.distributed.HashStore()
    storage = C10dStorage(store, "mem/")
    storage.put("a/vote-r00001.json", b"{}")
    store.set("mem/o/a/vote-r00002.json", value)  # a hostile writer: the object and its index entry
    store.append("mem/i/a", "+vote-r00002.json" + c10d.SEP)
    assert storage.list("a") == ["vote-r00001.json"]
    assert [i.key for i in storage.walk()] == ["a/vote-r00001.json"]
    for call in (storage.read, storage.stat):
        with pytest.raises(FormatError, match="not an object of this store"):
            call("a/vote-r00002.json")


def test_replica_a_refused_put_creates_no_directory(server, monkeypatch):
    srv, port = server
    ReplicaClient("127.0.0.1", port).put_file(PATH, b"one")
    monkeypatch.setattr(replica, "MAX_FILES", 3)  # (the first put made more than 3 files and directories)
    other = PATH.replace("000000000007", "000000000009")
    with pytest.raises(replica.ReplicaError, match="at most 3"):
        ReplicaClient("127.0.0.1", port).put_file(other, b"two")
    assert not (Path(srv.root) / "step-000000000009").exists()


def test_replica_a_trickling_body_is_cut_off_and_leaves_no_file(server):
    srv, port = server
    body = b"z" * 100  # a deadline of the 1 s timeout + 100 bytes at MIN_BYTES_PER_S: about 1 s
    raw = json.dumps({"op": "put", "path": PATH, "length": len(body), "xxh3": digest(body)}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(len(raw).to_bytes(4, "big") + raw)
        n = int.from_bytes(s.recv(4), "big")
        assert json.loads(s.recv(n)) == {"ok": True}
        sent = _trickle(s, body)
        _ended_by_server(s)
    assert sent < len(body)
    assert any("Timeout" in e for e in srv.errors), srv.errors
    assert not [p for p in Path(srv.root).rglob("*") if p.is_file() and "replicas" not in p.parts]  # no temporary
