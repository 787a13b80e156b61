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

import errno
import ipaddress
import os
import select
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


class AliveListener:
    """A listening socket that accepts and closes at once: the leader's probe of this
    agent (:class:`Prober`). While the agent process lives, the kernel completes a
    connect to it whatever the agent is doing; once the process is dead, the port is
    closed and a connect is refused (RST) at once: evidence that its node is lost, for
    which the leader need not wait out the beat timeout."""

    def __init__(self, host: str):
        # every interface (as the replica server): a host name may resolve, here, to a
        # loopback alias (127.0.1.1) that the leader's connects would never reach
        self.sock = socket.create_server(("127.0.0.1" if host == "127.0.0.1" else "0.0.0.0", 0), backlog=64)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True, name="ckptstore-alive").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept on Linux)
        except OSError:
            pass
        self.sock.close()


ACCEPTED, REFUSED, NO_ANSWER = "accepted", "refused", "no answer"


class Prober:
    """Non-blocking connects to the agents' :class:`AliveListener` ports, never blocking
    the leader's loop: :meth:`start` one, :meth:`poll` for the answers. A node's answer is
    ``accepted`` (its agent lives), ``refused`` (nothing listens: its agent is dead; on a
    real network too when the host is up) or ``no answer`` within ``timeout_s`` (a host
    powered off or cut off: no verdict). ``trusted``: the nodes whose port once accepted;
    a refusal from any other (a firewall that rejects the port) is no evidence, and the
    silence rule still needs a silent beat."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.inflight: dict[int, tuple[socket.socket, float]] = {}
        self.answer: dict[int, tuple[str, float]] = {}  # node -> (answer, when its probe started)
        self.trusted: set[int] = set()
        self.resolved: dict[str, tuple[int, tuple]] = {}

    def start(self, node: int, address: str) -> None:
        if node in self.inflight or self.timeout_s <= 0:
            return
        started = time.monotonic()
        try:
            family, sockaddr = self._resolve(address)
        except (OSError, ValueError, UnicodeError):  # (a name that does not resolve: no verdict)
            self.answer[node] = (NO_ANSWER, started)
            return
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            err = s.connect_ex(sockaddr)
        except OSError:
            s.close()
            self.answer[node] = (NO_ANSWER, started)
            return
        if err in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            self.inflight[node] = (s, started)
            return
        s.close()
        self._done(node, err, started)

    def _resolve(self, address: str) -> tuple[int, tuple]:
        """``host:port`` -> (family, socket address), looked up once per address (the
        first probe is the start's, off the fault path: no name lookup delays a verdict)."""
        if address not in self.resolved:
            host, _, port = address.rpartition(":")
            info = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
            self.resolved[address] = (info[0], info[4])
        return self.resolved[address]

    def poll(self) -> None:
        if not self.inflight:
            return
        now = time.monotonic()
        waiting = select.poll()
        for s, _ in self.inflight.values():
            waiting.register(s, select.POLLOUT)
        ready = {fd for fd, _ in waiting.poll(0)}
        for node, (s, started) in list(self.inflight.items()):
            if s.fileno() in ready:
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            elif now - started >= self.timeout_s:
                err = errno.ETIMEDOUT
            else:
                continue
            s.close()
            del self.inflight[node]
            self._done(node, err, started)

    def _done(self, node: int, err: int, started: float) -> None:
        answer = ACCEPTED if err == 0 else REFUSED if err == errno.ECONNREFUSED else NO_ANSWER
        if answer == ACCEPTED:
            self.trusted.add(node)
        self.answer[node] = (answer, started)

    def close(self) -> None:
        for s, _ in self.inflight.values():
            s.close()
        self.inflight.clear()


MAX_PROBES = 32  # the leader's probes in flight at once

# What decided that a node is lost (the ``node_lost`` field of the recovery event)
BY_BEAT = "beat"              # its beat stood still for the beat timeout: no other evidence needed
BY_REFUSED = "refused"        # a round's fault notice, then its agent's port refused a connect
BY_FAULT_SILENCE = "fault+silence"  # a fault notice and the shorter silence, its agent not answering


class BeatWatch:
    """The leader's view of the other nodes' beats, on its own monotonic clock, and of
    the corroborating evidence that decides a node lost before the beat timeout.

    Without a fault notice in the current round, a node is lost when its beat stood
    still for ``silent_s`` (every cause: a host powered off, a hung agent). With one (a
    surviving rank's collective failed, or an agent reported a dead rank), the leader
    probes every node's agent (:class:`Prober`) once, then again every beat interval
    each node whose beat is late, and a node is lost when

    - its agent's port refused the connect (``refused``; only from a port that once
      accepted): the agent process is dead, so is every rank on the node with it; or
    - its beat stood still for ``fault_silent_s`` (a few beat intervals) and its agent
      did not accept the latest probe (``fault+silence``): a host that gives no answer.

    A node whose agent accepts is never lost before ``silent_s``: a rank that crashed on
    a live node is that rank's fault, replaced by its own node's spare. ``fault_silent_s``
    0 turns the fault rules off; ``probe_timeout_s`` 0 turns probing off (then a fault
    and ``fault_silent_s`` of silence decide)."""

    def __init__(self, store, nodes: list[int], silent_s: float = injob.NODE_SILENT_S,
                 fault_silent_s: float = 0.0, probe_timeout_s: float = 0.0):
        self.store = store
        self.silent_s, self.fault_silent_s = silent_s, fault_silent_s
        self.prober = Prober(probe_timeout_s if fault_silent_s > 0 else 0.0)
        now = time.monotonic()
        self.seen = {k: (None, now) for k in nodes}
        self.probed: dict[int, float] = {}  # node -> when it was last probed under the current fault

    def silent(self, fault: bool = False, addresses: dict[int, str] | None = None) -> list[tuple[int, str, float]]:
        """The nodes now lost, each said once: (node, what decided it, seconds its beat
        stood still). ``fault``: the current round has a fault notice; ``addresses``:
        node -> its agent's :class:`AliveListener` address."""
        addresses = addresses or {}
        if not fault:
            self.probed.clear()
        now, ages = time.monotonic(), {}
        for k, (value, since) in list(self.seen.items()):
            key = injob.agent_key(k, "beat")
            current = self.store.get(key) if self.store.check([key]) else None
            if current != value:
                self.seen[k] = (current, now)
            ages[k] = now - self.seen[k][1]
        if fault and self.fault_silent_s > 0:
            self._probe(ages, addresses, now)
        self.prober.poll()  # (a refusal on one machine is immediate)
        out = []
        for k, age in ages.items():
            decided = BY_BEAT if age >= self.silent_s else self._with_fault(k, age, addresses) if fault else None
            if decided is not None:
                out.append((k, decided, age))
                del self.seen[k]
        return out

    def _probe(self, ages: dict[int, float], addresses: dict[int, str], now: float) -> None:
        """This fault's probes: every node once, then each whose beat is late again every
        beat interval; the longest silent first, at most MAX_PROBES in flight (a job of
        many nodes: bounded sockets, the likely dead first)."""
        due = [k for k, age in ages.items() if k in addresses and k not in self.prober.inflight and
               (k not in self.probed or (age >= injob.BEAT_S and now - self.probed[k] >= injob.BEAT_S))]
        room = max(0, MAX_PROBES - len(self.prober.inflight))
        for k in sorted(due, key=lambda k: -ages[k])[:room]:
            self.probed[k] = now
            self.prober.start(k, addresses[k])

    def _with_fault(self, k: int, age: float, addresses: dict[int, str]) -> str | None:
        if self.fault_silent_s <= 0:
            return None
        answer, started = self.prober.answer.get(k, (None, -1.0))
        fresh = k in self.probed and started >= self.probed[k]  # an answer to this fault's latest probe
        if fresh and answer == REFUSED and k in self.prober.trusted:
            return BY_REFUSED
        if self.prober.timeout_s > 0 and k in addresses and (not fresh or answer == ACCEPTED):
            return None  # not asked yet, still asking, or its agent lives: the beat timeout decides
        return BY_FAULT_SILENCE if age >= self.fault_silent_s else None

    def watch(self, k: int) -> None:
        """Node k is back (a returning agent admitted): its beat is timed from now, and
        nothing known of its lost agent's port counts (the new one must accept first)."""
        self.seen[k] = (None, time.monotonic())
        self.probed.pop(k, None)
        self.prober.answer.pop(k, None)
        self.prober.trusted.discard(k)
        old = self.prober.inflight.pop(k, None)
        if old is not None:
            old[0].close()

    def close(self) -> None:
        self.prober.close()


# ------------------------------------------------------------------ a lost node's return
#
# A node restarted while its run's in-job attempt still runs joins that attempt as a node
# of spares only (agent.py, ``InJobAgent._rejoin``). It finds the leader's store through
# the run's shared records (node 0's supervisor publishes the address there:
# :func:`publish_store`), since the attempt's rendezvous is closed. In the leader's store:
#
# ``rejoin/<node>/n``          the returning agent   a counter: its join number j (1, 2, ...)
# ``rejoin/<node>``            the returning agent   its request: join, host, pid, alive, spares
# ``rejoined/<node>/<j>``      create-only           the leader's admission (``round``), or the
#                                                    returning agent's ``gave_up``: whoever is first

STORE_LEAF = "injob-store.json"  # in journal/.shared/<run>/attempt-<n>/: the leader's in-job store


def rejoin_key(node: int, what: str | None = None) -> str:
    return f"rejoin/{node}" if what is None else f"rejoin/{node}/{what}"


def rejoined_key(node: int, join: int) -> str:
    return f"rejoined/{node}/{join}"


def rejoin_prefix(node: int, join: int) -> str:
    """The worker ids of a returning agent's join ``join``: never an id of the lost agent's."""
    return f"n{node}-r{join}-"


def publish_store(storage, run: str, attempt: int, address: str) -> None:
    """Node 0's supervisor: where the attempt's in-job store listens (create-only)."""
    import json

    from ..errors import AlreadyExistsError
    from .consensus import attempt_dir

    data = json.dumps({"run": run, "attempt": attempt, "address": address, "t": time.time()}).encode()
    try:
        storage.put(f"{attempt_dir(run, attempt)}/{STORE_LEAF}", data, if_absent=True)
    except AlreadyExistsError:
        pass


def published_store(storage, run: str, attempt: int) -> str | None:
    """The in-job store address node 0 published for ``attempt`` of ``run`` (``host:port``),
    or None: none published, unreadable, or not this run's and attempt's."""
    from .. import format as fmt
    from ..checkpoint.manifests import read_capped
    from ..errors import CkptStoreError
    from .consensus import attempt_dir

    try:
        rec = fmt.loads_json(read_capped(storage, f"{attempt_dir(run, attempt)}/{STORE_LEAF}", 4096,
                                         "in-job store record"), "in-job store record")
    except (CkptStoreError, OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("run") != run or rec.get("attempt") != attempt:
        return None
    address = rec.get("address")
    if not isinstance(address, str) or len(address) > 300:
        return None
    host, _, port = address.rpartition(":")
    return address if host and port.isdigit() and 0 < int(port) < 65536 else None


def answers(address: str, timeout_s: float) -> str | None:
    """None when something accepts a connection at ``host:port``, else why not."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return None
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
