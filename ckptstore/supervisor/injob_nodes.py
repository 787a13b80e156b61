"""The in-job store across nodes (docs/design/in-job-restart.md, sections 5.1 and 9):
how the node agents of one attempt find the leader's store, and the beat by which the
leader knows that a node is still there.

The leader (``--node-rank 0``) hosts the attempt's in-job TCPStore in its agent, as on
one node; the address is agreed through torch's own rendezvous of the attempt (the
``--rdzv-backend``/``--rdzv-endpoint`` the job gives, and the rendezvous id the runner
sets per attempt): every agent joins it, the leader publishes ``host:port`` in the
rendezvous store, the others read it and connect. Why not the rendezvous store itself:
it lives in whichever agent bound the endpoint's port first (on one machine, any of
them), so the "leader's host" would not be a node the job names, and its lifetime would
be a race; with its own store the leader is node 0, a stable node across attempts (its
memory directory, its peer replica partner), and the store dies exactly with it.

Node ranks are the job's ``--node-rank`` (not the rendezvous' group rank, which changes
with process ids): a rank lives on the same node in every attempt. Two agents giving
the same node rank are refused.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

from . import injob

KEY = "ckptstore-injob"  # under the rendezvous store's own prefix (its run id: one attempt)


def advertised_host(endpoint_host: str) -> str:
    """The leader's host as the other nodes reach it: the loopback when the rendezvous
    endpoint is one (every node is on this machine), else this machine's name."""
    try:
        if ipaddress.ip_address(endpoint_host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        if endpoint_host == "localhost":
            return "127.0.0.1"
    return socket.getfqdn()


def _endpoint(args) -> str:
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port}"
    return args.rdzv_endpoint


class NodesStore:
    """Join the attempt's rendezvous, then host (leader) or connect to the in-job store.
    ``base``: the TCPStore (server or client); ``address``: its ``host:port``."""

    def __init__(self, args, node: int, nnodes: int, timeout_s: float):
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
        from torch.distributed.run import _parse_rendezvous_config

        self.node, self.nnodes = node, nnodes
        conf = _parse_rendezvous_config(args.rdzv_conf or "")
        if args.rdzv_backend == "static":
            conf["rank"] = node
        endpoint = _endpoint(args)
        # this node's address as the others reach it (its replica server's): as the leader's
        self.own_host = advertised_host(endpoint.rpartition(":")[0] or endpoint)
        params = RendezvousParameters(backend=args.rdzv_backend, endpoint=endpoint, run_id=args.rdzv_id,
                                      min_nodes=nnodes, max_nodes=nnodes, local_addr=args.local_addr, **conf)
        self.handler = get_rendezvous_handler(params)  # kept: its store (on one node) for the attempt
        info = self.handler.next_rendezvous()
        from torch.distributed import PrefixStore

        rdzv = PrefixStore(KEY, info.store)
        mine = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        held = rdzv.compare_set(f"node/{node}", "", mine)
        if (held.decode() if isinstance(held, bytes) else held) != mine:
            raise RuntimeError(f"two nodes gave --node-rank {node} to this in-job attempt: give each node its "
                               f"own --node-rank (0 .. {nnodes - 1}); node 0 hosts the in-job store")
        store_timeout = timedelta(seconds=max(30.0, timeout_s))
        from torch.distributed import TCPStore

        if node == 0:
            host = self.own_host
            self.base = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=store_timeout)
            self.address = f"{host}:{self.base.port}"
            rdzv.set("leader", self.address)
        else:
            if not injob.wait_for(rdzv, ["leader"], timeout_s):
                raise RuntimeError(f"node 0 never published its in-job store within {timeout_s:g}s")
            self.address = rdzv.get("leader").decode()
            self.base = injob.connect(self.address, max(30.0, timeout_s))
        self.host = self.address.rpartition(":")[0]
        # Torch's keep-alive of this rendezvous is not needed past this point (the attempt
        # never re-forms it; a node's liveness is our Beat), and its store lives in
        # whichever agent bound the endpoint: without this, that agent's end logs errors
        # in every other agent.
        stop = getattr(self.handler, "_stop_heartbeats", None)
        if callable(stop):
            stop()


class Beat(threading.Thread):
    """Bump ``agent/<node>/beat`` every BEAT_S on a client of its own (a waiting main
    loop, or one ending its workers, still beats). ``lost`` is set when the store fails:
    the leader's host is gone."""

    def __init__(self, address: str, prefix: str, node: int):
        super().__init__(daemon=True, name=f"ckptstore-beat-{node}")
        self.store = injob.attempt_store(injob.connect(address, 10.0), prefix)
        self.key = injob.agent_key(node, "beat")
        self.stop = threading.Event()
        self.lost = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - any failure of the store: it is gone with the leader
                self.lost.set()
                return
            self.stop.wait(injob.BEAT_S)


class BeatWatch:
    """The leader's view of the other nodes' beats, on its own monotonic clock."""

    def __init__(self, store, nodes: list[int]):
        self.store = store
        now = time.monotonic()
        self.seen = {k: (None, now) for k in nodes}

    def silent(self) -> list[int]:
        """The nodes whose beat has not moved for NODE_SILENT_S (each said once)."""
        out, now = [], time.monotonic()
        for k, (value, since) in list(self.seen.items()):
            key = injob.agent_key(k, "beat")
            current = self.store.get(key) if self.store.check([key]) else None
            if current != value:
                self.seen[k] = (current, now)
            elif now - since >= injob.NODE_SILENT_S:
                out.append(k)
                del self.seen[k]
        return out
