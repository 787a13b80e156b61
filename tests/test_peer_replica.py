"""Peer replicas of the memory tier (docs/tiers.md, "Peer replicas"; issue 36): the
replica server (supervisor/replica.py) stores a partner node's data files at their own
relative paths, refusing what does not belong there; the ranks of a 2-node job copy
their files of each committed step to the partner; when a node is lost, a spare on the
partner node restores the lost rank from the replica, without the durable store."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.hashing import digest
from ckptstore.supervisor import injob
from ckptstore.supervisor.replica import ReplicaClient, ReplicaError, ReplicaServer, marker_path

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 240
ATTEMPT = "20261207T104500-0123456789ab"
PATH = f"step-000000000007/attempts/{ATTEMPT}/data-r00003-s00.bin"


@pytest.fixture
def server(tmp_path):
    srv = ReplicaServer(tmp_path / "node1", budget_bytes=1 << 20, host="127.0.0.1")
    port = srv.start()
    yield srv, port
    srv.close()


def test_a_put_lands_at_its_relative_path_and_a_seal_marks_it(server, tmp_path):
    srv, port = server
    client = ReplicaClient("127.0.0.1", port)
    data = os.urandom(300_000)
    assert client.put_file(PATH, data) == digest(data)
    assert (tmp_path / "node1" / PATH).read_bytes() == data
    source = tmp_path / "src.bin"  # from a file too, over the same connection
    source.write_bytes(data[:1000])
    client.put_file(PATH.replace("-s00", "-s01"), str(source))
    assert (tmp_path / "node1" / PATH.replace("-s00", "-s01")).read_bytes() == data[:1000]
    marker = Path(marker_path(str(tmp_path / "node1"), 7, 3))
    assert json.loads(marker.read_text())["sealed"] is False  # named before written, not sealed yet
    both = [PATH, PATH.replace("-s00", "-s01")]
    client.seal(7, 3, ATTEMPT, both)
    record = json.loads(marker.read_text())
    assert record["attempt"] == ATTEMPT and record["files"] == both and record["sealed"] is True
    with pytest.raises(ReplicaError, match="not a file of rank"):
        client.seal(7, 4, ATTEMPT, [PATH])
    client.put_file(PATH, data)  # a resend of a replica's file: allowed (named in its marker)
    srv.drop_connections()  # as the server's idle timeout would between two steps
    client.seal(7, 3, ATTEMPT, both)  # the client reconnects once
    # A replica abandoned halfway (never sealed) is retired all the same.
    half = PATH.replace("000000000007", "000000000006")
    ReplicaClient("127.0.0.1", port).put_file(half, b"half")
    # retire: the rank's replicas of steps below 8 go, with their markers
    assert ReplicaClient("127.0.0.1", port).retire(3, 8) == 3
    assert not [p for p in (tmp_path / "node1").rglob("*") if p.is_file()]


def _raw_put(port: int, header: dict, body: bytes) -> dict:
    """A put by hand: (the go reply or a refusal) then the body and the final reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        raw = json.dumps(header).encode()
        s.sendall(len(raw).to_bytes(4, "big") + raw)
        replies = []
        for _ in range(2):
            n = int.from_bytes(_exact(s, 4), "big")
            replies.append(json.loads(_exact(s, n)))
            if not replies[-1]["ok"]:
                return replies[-1]
            if len(replies) == 1:
                s.sendall(body)
        return replies[-1]


def _exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        piece = s.recv(n - len(buf))
        assert piece, "the server closed the connection"
        buf += piece
    return buf


def test_bad_hash_path_escapes_and_the_budget_are_refused_and_nothing_is_written(server, tmp_path):
    srv, port = server
    root = tmp_path / "node1"
    data = b"x" * 5000
    reply = _raw_put(port, {"op": "put", "path": PATH, "length": len(data), "xxh3": digest(b"other")}, data)
    assert not reply["ok"] and "hash" in reply["error"]
    assert not (root / PATH).exists()
    assert not [p for p in root.rglob("*") if p.is_file() and "replicas" not in p.parts]  # no temporary either
    for bad in ("/etc/passwd", f"../{PATH}", f"step-000000000007/../../x/{PATH}", "tier-binding.json",
                f"step-000000000007/attempts/{ATTEMPT}/vote-r00003.json"):
        reply = _raw_put(port, {"op": "put", "path": bad, "length": 1, "xxh3": digest(b"a")}, b"a")
        assert not reply["ok"], bad
    # A symlink planted where a directory of the path goes: refused, nothing written through it.
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "step-000000000008").symlink_to(outside)
    link_path = PATH.replace("000000000007", "000000000008")
    reply = _raw_put(port, {"op": "put", "path": link_path, "length": 1, "xxh3": digest(b"a")}, b"a")
    assert not reply["ok"] and "symlink" in reply["error"]
    assert list(outside.iterdir()) == [] and not Path(marker_path(str(root), 8, 3)).exists()
    own = PATH.replace("r00003", "r00001")  # a file of this node's own ranks: never overwritten
    (root / own).parent.mkdir(parents=True, exist_ok=True)
    (root / own).write_bytes(b"mine")
    reply = _raw_put(port, {"op": "put", "path": own, "length": 1, "xxh3": digest(b"a")}, b"a")
    assert not reply["ok"] and "of its own" in reply["error"] and (root / own).read_bytes() == b"mine"
    (root / own).unlink()
    big = 2 << 20  # over the 1 MiB budget
    reply = _raw_put(port, {"op": "put", "path": PATH, "length": big, "xxh3": "0" * 32}, b"")
    assert not reply["ok"] and "budget" in reply["error"]
    # The server still serves.
    assert ReplicaClient("127.0.0.1", port).put_file(PATH, data) == digest(data)
    assert (root / PATH).read_bytes() == data


def test_a_connection_sending_garbage_is_dropped_and_the_server_keeps_serving(server, tmp_path):
    srv, port = server
    for garbage in (b"\xff\xff\xff\xff" + b"z" * 100, b"\x00\x00\x00\x05hello", b"GET / HTTP/1.0\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(garbage)
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:  # (the server reset it already)
                pass
            got = b""
            while True:  # until the server closes it (the socket's timeout bounds the wait)
                try:
                    piece = s.recv(1 << 16)
                except ConnectionResetError:  # (closed with our bytes unread)
                    piece = b""
                if not piece:
                    break
                got += piece
            assert got == b"" or b'"ok": false' in got, got[:200]
    # A client that stops halfway through a body: its connection is dropped, no file.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        raw = json.dumps({"op": "put", "path": PATH, "length": 1000, "xxh3": "0" * 32}).encode()
        s.sendall(len(raw).to_bytes(4, "big") + raw + b"half" * 10)
    assert ReplicaClient("127.0.0.1", port).put_file(PATH, b"fine") == digest(b"fine")
    assert (tmp_path / "node1" / PATH).read_bytes() == b"fine"
    assert srv.errors  # each bad connection was noted


def test_each_node_finds_its_partners_replica_server_in_the_in_job_store():
    store = torch.distributed.HashStore()
    for node in range(3):
        injob.post_replica_server(store, node, f"10.0.0.{node}", 7000 + node)
    assert [injob.partner_replica(store, node, 3, 1.0) for node in range(3)] == \
        ["10.0.0.1:7001", "10.0.0.2:7002", "10.0.0.0:7000"]
    assert injob.partner_replica(store, 0, 1, 1.0) is None  # one node: no partner
    assert injob.partner_replica(torch.distributed.HashStore(), 0, 2, 0.05) is None  # never said


def test_retention_keeps_the_newest_replicated_step_and_the_partner_drops_older_replicas(tmp_path, monkeypatch):
    """One process, records in a HashStore as on several nodes: steps 1-3 replicated,
    then the partner gone; step 4 commits but is not replicated, so step 3 (the newest
    replicated one) stays in the memory tier beside it, and the partner holds only the
    replica of step 3."""
    from ckptstore.peers import PeerReplicaWarning
    from ckptstore.storage.c10d import C10dStorage

    partner = ReplicaServer(tmp_path / "partner", host="127.0.0.1")
    monkeypatch.setenv(injob.ENV_PEER_REPLICA, f"127.0.0.1:{partner.start()}")
    monkeypatch.delenv(injob.ENV_ROUND, raising=False)
    records = C10dStorage(torch.distributed.HashStore(), "mem/")
    store = ckptstore.Store(tmp_path / "durable", memory=tmp_path / "mine", local_shared=records,
                            durable_every=1000)
    replicator = store._tiers.replicator
    try:
        for step in (1, 2, 3):
            store.save(step, {"w": torch.full((1000,), float(step))}).result()
        assert replicator.wait_for(3, 60) and replicator.wait_idle(60)
    finally:
        partner.close()
    assert Path(marker_path(str(tmp_path / "partner"), 3, 0)).is_file()
    left = sorted(p.relative_to(tmp_path / "partner").parts[0] for p in (tmp_path / "partner").rglob("*.bin"))
    assert left == ["step-000000000003"], left  # older replicas retired
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.save(4, {"w": torch.full((1000,), 4.0)}).result()
        store.save(5, {"w": torch.full((1000,), 5.0)}).result()
        assert replicator.wait_idle(60)
    assert any(issubclass(w.category, PeerReplicaWarning) for w in caught)
    assert store.memory.steps()[0] == 3 and store.memory.steps()[-1] == 5  # 3: the newest replicated
    assert store.load(3)["w"][0].item() == 3.0


# ---------------------------------------------------------------------------- two nodes, one lost
def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().numpy().tobytes()).hexdigest()[:16]


def child(phase: str, rank: int, durable: str) -> None:
    """One rank of a 2-rank gloo job, each rank a node of its own. ``save``: steps 1-3 to
    the memory tier, each replicated to the partner node; ``resume``: restore and say
    from which tier."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    model = torch.nn.Linear(16, 8)
    store = ckptstore.Store(durable, memory="auto", durable_every=1000)
    ck = ckptstore.Checkpointer(store, model=model, every=1, rng=False)
    if phase == "save":
        start = ck.resume()
        for step in range(start, 4):
            with torch.no_grad():
                model.weight.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank)))
            ck.save(step).result()
        print(f"rank {rank}: committed 3 {_digest(model.weight)}", flush=True)
        replicator = store._tiers.replicator
        ok = replicator.wait_for(3, 120)
        print(f"rank {rank}: replicated {ok} {replicator.replicated}", flush=True)
        sys.stdin.readline()  # the test stops the replica servers: step 4 is committed, never replicated
        ck.save(4).result()
        print(f"rank {rank}: committed 4", flush=True)
        dist.barrier()
        # (no ck.close(): it would promote step 4 to the durable tier, and this job stands
        # for one whose node is lost before its end)
        dist.destroy_process_group()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the durable tier cannot be listed: said once per listing)
        nxt = ck.resume()
    print(f"rank {rank}: restored {nxt - 1} {_digest(model.weight)} tier={ck.info.tier}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _ranks(phase: str, durable: Path, dirs: list[Path], job: dict, round_: int, peers=None) -> list:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                   RANK=str(rank), LOCAL_RANK="0",
                   **{injob.ENV_MEMORY_DIR: str(dirs[rank]), injob.ENV_ROUND: str(round_)}, **job)
        for name in (injob.ENV_MEMORY_BUDGET, injob.ENV_PEER_REPLICA, "CKPTSTORE_PROGRESS_DIR"):
            env.pop(name, None)
        if peers is not None:
            env[injob.ENV_PEER_REPLICA] = peers[rank]
        procs.append(subprocess.Popen([sys.executable, "-W", "ignore", __file__, phase, str(rank), str(durable)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env))
    return procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finish(procs) -> list[str]:
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=HANG_GUARD_S)
            assert proc.returncode == 0, out[-4000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _line(proc: subprocess.Popen, word: str) -> str:
    seen = []
    for line in proc.stdout:  # (the hang guard: the test's timeout, and the kill in the callers' finally)
        seen.append(line)
        if word in line:
            return line.strip()
    raise AssertionError(f"no {word!r} line; output:\n{''.join(seen)[-4000:]}")


def _said(out: str, word: str) -> str:
    lines = [line for line in out.splitlines() if word in line]
    assert lines, f"no {word!r} line; output:\n{out[-4000:]}"
    return lines[-1].strip()


def test_a_lost_node_restores_from_its_partners_replica_without_the_durable_store(tmp_path):
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    prefix = injob.attempt_prefix("run", 0)
    injob.set_fence(injob.attempt_store(server, prefix), 0)
    job = {injob.ENV_STORE: f"127.0.0.1:{server.port}", injob.ENV_PREFIX: prefix}
    durable = tmp_path / "durable"
    node_a, node_b = tmp_path / "shm" / "node0", tmp_path / "shm" / "node1"
    replicas = [ReplicaServer(d, budget_bytes=64 << 20, host="127.0.0.1") for d in (node_a, node_b)]
    ports = [r.start() for r in replicas]
    # node k's partner is node (k+1) mod 2: rank 0 (node A) replicates to B, rank 1 to A
    procs = _ranks("save", durable, [node_a, node_b], job, 0,
                   peers=[f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[0]}"])
    saved = {}
    try:
        for rank, proc in enumerate(procs):
            saved[rank] = _line(proc, "committed 3").split()[-1]
            assert "replicated True" in _line(proc, "replicated")
        for r in replicas:  # the servers go (their live connections too): step 4 is never replicated
            r.close()
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        outs = _finish(procs)
    finally:
        for r in replicas:
            r.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all("committed 4" in out for out in outs), outs
    assert Path(marker_path(str(node_b), 3, 0)).is_file() and Path(marker_path(str(node_a), 3, 1)).is_file()
    assert not Path(marker_path(str(node_b), 4, 0)).exists()
    assert list(node_b.rglob("data-r00000-*.bin")), "rank 0's replica is not on node B"
    assert not [p for p in durable.rglob("*") if "step-" in p.name]  # nothing promoted: memory only

    shutil.rmtree(node_a)  # node A lost, with its memory
    durable.rename(tmp_path / "durable-gone")  # and the durable store unreadable
    durable.write_text("not a store")
    # Rank 0 is a spare on node B now (the partner); rank 1 a survivor there. Step 4 was
    # never replicated: the retention kept step 3, the newest replicated one, its records
    # and rank 1's files of it, so both ranks resume step 3.
    outs = _finish(_ranks("resume", durable, [node_b, node_b], job, 1))
    assert _said(outs[0], "restored") == f"rank 0: restored 3 {saved[0]} tier=peer"
    assert _said(outs[1], "restored") == f"rank 1: restored 3 {saved[1]} tier=memory"


if __name__ == "__main__":
    child(sys.argv[1], int(sys.argv[2]), sys.argv[3])
