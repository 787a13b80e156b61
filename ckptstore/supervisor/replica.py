"""Peer replicas of the memory tier (docs/tiers.md, "Peer replicas"; design
docs/design/in-job-restart.md 7.1): a small threaded TCP server, run by each node's
agent, that stores the memory-tier data files of its partner node's ranks in this
node's memory directory, at the same relative path they have on the sender's node
(their names carry the rank: a node's own files and its partner's never collide). A
spare started on this node for a lost rank then finds that rank's files where the
memory tier's load looks for them: the restore reads no durable store.

Protocol (one request after another on a connection; every read bounded by the
server's timeout): a request is a 4-byte big-endian length and a JSON header; a reply
the same. ``put`` (``path``, ``length``, ``xxh3``): the server checks the path (a data
file name of the memory tier, ``step-N/attempts/<attempt>/data-rNNNNN-sNN.bin``: never
absolute, ``..``, or through a symlink), the budget, and replies ``{"ok": true}``; the
client then sends the ``length`` bytes, which the server writes to a temporary file
beside the target, renames into place only when their xxh3-128 matches, and replies
again. ``seal`` (``step``, ``rank``, ``attempt``, ``files``): every file of that rank's
replica arrived; the server writes its marker ``replicas/step-N/rNNNNN.json`` (the
loader's sign that a file came from a replica: ``LoadInfo.tier == "peer"``). ``retire``
(``rank``, ``below``): delete that rank's replicas (files and markers) of steps below
``below``, which the sender no longer needs. A malformed request gets an error reply
and its connection is closed; nothing of it is written.

This module imports only the package's names and hashing (no torch): the agent starts
a :class:`ReplicaServer` with one call and exports its address to the partner's workers
as ``CKPTSTORE_PEER_REPLICA=host:port`` (supervisor/injob.py, ``ENV_PEER_REPLICA``).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import socketserver
import struct
import threading
import time
import uuid

from .. import names
from ..hashing import Hasher

REPLICAS_DIR = "replicas"  # markers of complete replicas: replicas/step-N/rNNNNN.json
MAX_HEADER_BYTES = 64 << 10
PIECE_BYTES = 4 << 20
# Bounds on what a client (trusted or not) can make the server hold: connections served
# at once (a partner node's ranks keep one each; more are refused at accept), files in
# the memory directory, directories included (a flood of empty puts would exhaust inodes
# and slow each put's budget walk), files one replica marker names, and the pace of a put's body: after
# its first byte a request must arrive within the timeout, a body at MIN_BYTES_PER_S
# at least, so a stalled or trickling client ends its own connection, not the agent.
MAX_CONNECTIONS = 64
MAX_FILES = 100_000
MAX_REPLICA_FILES = 256
MIN_BYTES_PER_S = 1 << 20
_LEN = struct.Struct(">I")


class ReplicaError(Exception):
    """A replica request was refused or could not be carried out (the reason says which)."""


def marker_path(root: str, step: int, rank: int) -> str:
    """Where a node's memory directory ``root`` marks the complete replica of ``rank``'s
    files of ``step`` (written by this node's server)."""
    return os.path.join(root, REPLICAS_DIR, names.step_dir_name(step), f"r{rank:05d}.json")


def read_marker(root: str, step: int, rank: int) -> dict | None:
    """The marker of ``rank``'s replica of ``step`` in ``root``, or None."""
    try:
        with open(marker_path(root, step, rank), "rb") as f:
            found = json.loads(f.read(MAX_HEADER_BYTES))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def check_replica_path(path) -> tuple[int, str, int]:
    """(step, attempt, rank) of a replica's relative path, or ReplicaError: only a memory
    tier's data file name is accepted, nothing absolute, nothing with ``..``."""
    if not isinstance(path, str) or not path or len(path) > 512:
        raise ReplicaError(f"bad path {str(path)[:80]!r}")
    try:
        names.check_relative_name(path, "replica path")
    except Exception as e:
        raise ReplicaError(str(e)) from None
    head, _, rest = path.partition("/")
    step = names.parse_step_dir_name(head)
    parsed = names.parse_data_file(rest)
    if step is None or parsed is None:
        raise ReplicaError(f"{path!r} is not a memory-tier data file (step-N/attempts/<attempt>/data-rNNNNN-sNN.bin)")
    return step, parsed[0], parsed[1]


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None, base: float | None = None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        _bound(sock, deadline, base)
        piece = sock.recv(min(n - len(buf), PIECE_BYTES))
        if not piece:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += piece
    return bytes(buf)


def _bound(sock: socket.socket, deadline: float | None, base: float | None) -> None:
    """Make the next socket call end by ``deadline`` (monotonic; None: the socket's own
    timeout ``base`` only): a peer trickling a byte per timeout cannot hold a request
    open. The caller restores ``base`` after."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request did not arrive in time (a stalled or trickling client)")
    sock.settimeout(left if base is None else min(base, left))


def _send_json(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_json(sock: socket.socket, eof_ok: bool = False, within: float | None = None) -> dict | None:
    """One length-prefixed JSON object; None at a clean end of the connection when
    ``eof_ok``. ``within``: seconds the rest may take once its first byte came."""
    first = sock.recv(_LEN.size)
    if not first and eof_ok:
        return None
    deadline, base = (None if within is None else time.monotonic() + within), sock.gettimeout()
    try:
        raw = first + _recv_exact(sock, _LEN.size - len(first), deadline, base) if len(first) < _LEN.size else first
        (n,) = _LEN.unpack(raw)
        if n > MAX_HEADER_BYTES:
            raise ReplicaError(f"a header of {n} bytes (at most {MAX_HEADER_BYTES})")
        obj = json.loads(_recv_exact(sock, n, deadline, base))
    finally:
        if deadline is not None:
            sock.settimeout(base)
    if not isinstance(obj, dict):
        raise ReplicaError("a header that is not a JSON object")
    return obj


def _lexists(leaf: str, dir_fd: int) -> bool:
    try:
        os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _open_dir(root_fd: int, parts: list[str], create: bool) -> int:
    """An fd of the directory ``parts`` below ``root_fd``, each component opened without
    following a symlink (created with mode 0700 when missing and ``create``)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ReplicaError(f"{'/'.join(parts)}: a symlink or a file in the way") from None
        raise
    return fd


class ReplicaServer:
    """Stores replicas in ``memory_dir`` (the node's memory directory), at most
    ``budget_bytes`` in that directory in all (None: no limit; the node's own files
    count). ``start()`` returns the port; ``close()`` stops it."""

    def __init__(self, memory_dir: str, budget_bytes: int | None = None, host: str = "0.0.0.0",
                 port: int = 0, timeout_s: float = 30.0, max_connections: int = MAX_CONNECTIONS):
        self.root = os.path.abspath(os.fspath(memory_dir))
        self.budget = budget_bytes
        self.timeout_s = timeout_s
        self._addr = (host, port)
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # (budget checks and markers: one request at a time decides)
        self._reserved = 0  # bytes of puts accepted and not written yet
        self._open: set[socket.socket] = set()  # connections being served (closed by close())
        self.max_connections = max_connections
        self._active = 0  # connections accepted and not ended (bounded by max_connections)
        self.errors: list[str] = []  # the last refusals, newest last (for tests and logs)

    def start(self) -> int:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                owner._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request, client_address):
                if not owner._admit():  # (no thread for it: closed at once)
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    owner._leave()
                    raise

        self._server = Server(self._addr, Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="ckptstore-replica-server", daemon=True)
        self._thread.start()
        return self._server.server_address[1]

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        """Stop accepting, and end the connections being served (a put in progress is
        not written)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.drop_connections()

    def drop_connections(self) -> None:
        """End the connections being served (as the idle timeout does); clients reconnect."""
        with self._lock:
            live = list(self._open)
        for sock in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------------ a connection
    def _admit(self) -> bool:
        with self._lock:
            if self._active >= self.max_connections:
                admitted = False
            else:
                self._active += 1
                admitted = True
        if not admitted:
            self._note(f"a connection refused: {self.max_connections} are being served already")
        return admitted

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        with self._lock:
            self._open.add(sock)
        try:
            while True:
                request = _recv_json(sock, eof_ok=True, within=self.timeout_s)
                if request is None:
                    return
                op = request.get("op")
                try:
                    if op == "put":
                        reply = self._put(sock, request)
                    elif op == "seal":
                        reply = self._seal(request)
                    elif op == "retire":
                        reply = self._retire(request)
                    else:
                        raise ReplicaError(f"unknown op {str(op)[:40]!r}")
                except ReplicaError as e:
                    self._note(str(e))
                    _send_json(sock, {"ok": False, "error": str(e)})
                    return  # (the rest of the connection cannot be trusted to be in step)
                _send_json(sock, reply)
        except Exception as e:  # garbage, a timeout, a reset: this connection only
            self._note(f"connection dropped: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._open.discard(sock)
                self._active -= 1
            try:
                sock.close()
            except OSError:
                pass

    def _note(self, error: str) -> None:
        self.errors = (self.errors + [error])[-20:]

    def _usage(self) -> tuple[int, int]:
        """(bytes, files and directories) held in the memory directory."""
        total = count = 0
        for base, dirs, files in os.walk(self.root):
            count += len(files) + len(dirs)
            for name in files:
                try:
                    total += os.lstat(os.path.join(base, name)).st_size
                except OSError:
                    pass
        return total, count

    def _room(self) -> int:
        """Bytes a put may still take without a budget: what the file system has free."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _write_marker(self, step: int, rank: int, record: dict) -> None:
        marker = marker_path(self.root, step, rank)
        os.makedirs(os.path.dirname(marker), mode=0o700, exist_ok=True)
        tmp = f"{marker}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, marker)

    def _note_file(self, step: int, rank: int, attempt: str, path: str) -> None:
        """Name ``path`` in the replica's marker before it is written (unsealed): a
        replica abandoned halfway is deleted by ``retire`` all the same."""
        found = read_marker(self.root, step, rank) or {}
        if found.get("attempt") != attempt or not isinstance(found.get("files"), list):
            found = {"step": step, "rank": rank, "attempt": attempt, "files": [], "sealed": False,
                     "older": sorted(set(_names_of(found, "files")) | set(_names_of(found, "older")))}
        if path not in found["files"]:
            found["files"].append(path)
            found["sealed"] = False
            self._write_marker(step, rank, found)

    def _put(self, sock: socket.socket, request: dict) -> dict:
        path, length, want = request.get("path"), request.get("length"), request.get("xxh3")
        step, attempt, rank = check_replica_path(path)
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ReplicaError(f"{path}: bad length {length!r}")
        if not isinstance(want, str) or len(want) != 32:
            raise ReplicaError(f"{path}: bad xxh3 {str(want)[:40]!r}")
        parts = path.split("/")
        with self._lock:  # (one put at a time decides: the budget, the bounds, then its directories)
            held, count = self._usage()
            if self.budget is not None and held + self._reserved + length > self.budget:
                raise ReplicaError(f"{path}: {length} bytes would pass this node's memory budget "
                                   f"({self.budget} bytes, {held} held): the replica is refused")
            if self.budget is None and self._reserved + length > self._room():
                raise ReplicaError(f"{path}: {length} bytes do not fit in the {self._room()} bytes free "
                                   f"under {self.root}: the replica is refused")
            if count >= MAX_FILES:
                raise ReplicaError(f"{path}: {self.root} holds {count} files and directories already (at most "
                                   f"{MAX_FILES}): the replica is refused")
            found = read_marker(self.root, step, rank) or {}
            named = _names_of(found, "files") + _names_of(found, "older")
            if path not in named and len(named) >= MAX_REPLICA_FILES:
                raise ReplicaError(f"{path}: rank {rank}'s replica of step {step} names {len(named)} files "
                                   f"already (at most {MAX_REPLICA_FILES}): refused")
            dir_fd = self._dir_of(parts, create=True)  # (no symlink on the way: refused before anything is noted)
            try:
                if _lexists(parts[-1], dir_fd) and path not in _names_of(found, "files"):
                    raise ReplicaError(f"{path}: this node holds that file of its own (is CKPTSTORE_PEER_REPLICA "
                                       "this node's own server?): refused, nothing overwritten")
                self._note_file(step, rank, attempt, path)
            except BaseException:
                os.close(dir_fd)
                raise
            self._reserved += length
        try:
            _send_json(sock, {"ok": True})  # go on: send the bytes
            self._receive(sock, dir_fd, parts[-1], length, want, path)
        finally:
            os.close(dir_fd)
            with self._lock:
                self._reserved -= length
        return {"ok": True}

    def _dir_of(self, parts: list[str], create: bool) -> int:
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return _open_dir(root_fd, parts[:-1], create=create)
        finally:
            os.close(root_fd)

    def _receive(self, sock: socket.socket, dir_fd: int, leaf: str, length: int, want: str, path: str) -> None:
        tmp = names.temp_name(leaf)  # (a name gc knows for a temporary: deleted after the grace if left)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        done = False
        try:
            hasher, left = Hasher(), length
            deadline = time.monotonic() + self.timeout_s + length / MIN_BYTES_PER_S
            with os.fdopen(fd, "wb", closefd=False) as out:
                while left:
                    _bound(sock, deadline, self.timeout_s)
                    piece = sock.recv(min(left, PIECE_BYTES))
                    if not piece:
                        raise ConnectionError(f"{path}: connection closed with {left} of {length} bytes to come")
                    hasher.update(piece)
                    out.write(piece)
                    left -= len(piece)
            got = hasher.hexdigest()
            if got != want:
                raise ReplicaError(f"{path}: the bytes received hash to {got}, not {want}: nothing written")
            os.replace(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            done = True
        finally:
            os.close(fd)
            sock.settimeout(self.timeout_s)  # (the body's deadline ends with it: idle again)
            if not done:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except OSError:
                    pass

    def _seal(self, request: dict) -> dict:
        step, rank, attempt, files = (request.get(k) for k in ("step", "rank", "attempt", "files"))
        if not isinstance(files, list) or not files or len(files) > MAX_REPLICA_FILES:
            raise ReplicaError(f"seal: no files, or more than {MAX_REPLICA_FILES}")
        for path in files:
            if check_replica_path(path) != (step, attempt, rank):
                raise ReplicaError(f"seal: {path!r} is not a file of rank {rank}'s attempt {attempt} of step {step}")
            if not os.path.isfile(os.path.join(self.root, path)):
                raise ReplicaError(f"seal: {path} has not arrived")
        with self._lock:
            found = read_marker(self.root, step, rank) or {}
            if found.get("attempt") != attempt or not set(files) <= set(_names_of(found, "files")):
                raise ReplicaError(f"seal: rank {rank}'s files of step {step} were not all sent as a replica")
            self._write_marker(step, rank, {**found, "files": files, "sealed": True,
                                            "older": sorted(set(_names_of(found, "files")) - set(files)
                                                            | set(_names_of(found, "older")))})
        return {"ok": True}

    def _retire(self, request: dict) -> dict:
        rank, below = request.get("rank"), request.get("below")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (rank, below)):
            raise ReplicaError(f"retire: rank and below must be ints >= 0, got {str(rank)[:20]!r}, {str(below)[:20]!r}")
        deleted = 0
        top = os.path.join(self.root, REPLICAS_DIR)
        with self._lock:
            for entry in sorted(os.listdir(top)) if os.path.isdir(top) else []:
                step = names.parse_step_dir_name(entry)
                if step is None or step >= below:
                    continue
                found = read_marker(self.root, step, rank) or {}
                for path in _names_of(found, "files") + _names_of(found, "older"):
                    try:
                        check_replica_path(path)
                    except ReplicaError:
                        continue  # (never from this server: its markers name checked paths only)
                    parts = path.split("/")
                    try:  # (through directories opened without following a symlink, as a put)
                        dir_fd = self._dir_of(parts, create=False)
                    except (OSError, ReplicaError):
                        continue
                    try:
                        os.unlink(parts[-1], dir_fd=dir_fd)
                        deleted += 1
                    except OSError:
                        pass
                    finally:
                        os.close(dir_fd)
                    try:  # its attempt's directory, once empty (unique to that save: no writer races it)
                        parent = self._dir_of(parts[:-1], create=False)
                        try:
                            os.rmdir(parts[-2], dir_fd=parent)
                        finally:
                            os.close(parent)
                    except (OSError, ReplicaError):
                        pass
                for leftover in (marker_path(self.root, step, rank),):
                    try:
                        os.unlink(leftover)
                    except OSError:
                        pass
                try:
                    os.rmdir(os.path.join(top, entry))  # (when no other rank's marker is left)
                except OSError:
                    pass
        return {"ok": True, "deleted": deleted}


class ReplicaClient:
    """A connection to a partner node's :class:`ReplicaServer` (``host``, ``port``);
    reconnects after an error. Not thread-safe: one per sending thread."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0):
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self._sock: socket.socket | None = None

    @classmethod
    def from_address(cls, address: str, timeout_s: float = 30.0) -> "ReplicaClient":
        host, sep, port = address.rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdigit() and 0 < len(port) <= 5
                                        and 0 < int(port) < 65536):
            raise ValueError(f"a replica server address must be host:port, got {address!r}")
        return cls(host.strip("[]"), int(port), timeout_s)

    def _connect(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            self._sock.settimeout(self.timeout_s)
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _request(self, header: dict, body=None) -> dict:
        for retry in (True, False):  # a kept connection the server ended (its idle timeout): once more, anew
            reused = retry and self._sock is not None
            try:
                sock = self._connect()
                _send_json(sock, header)
                reply = _recv_json(sock)
                if reply.get("ok") and body is not None:
                    body(sock)
                    reply = _recv_json(sock)
                break
            except (OSError, ValueError) as e:
                self.close()
                if reused and isinstance(e, OSError):
                    continue
                raise ReplicaError(f"the replica server at {self.host}:{self.port}: {type(e).__name__}: {e}") from e
        if not reply.get("ok"):
            self.close()  # (the server closed its side)
            raise ReplicaError(f"the replica server at {self.host}:{self.port} refused: {reply.get('error')}")
        return reply

    def put_file(self, rel_path: str, data) -> str:
        """Send ``data`` (bytes, or the path of a file to read) as ``rel_path``; returns
        its xxh3-128. The server writes it only when the hash matches."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            hasher = Hasher()
            hasher.update(view)
            digest, length = hasher.hexdigest(), len(view)

            def body(sock):
                sock.sendall(view)
        else:
            digest, length = _file_digest(data)

            def body(sock):
                with open(data, "rb") as f:
                    sent, check = 0, Hasher()
                    while True:
                        piece = f.read(PIECE_BYTES)
                        if not piece:
                            break
                        check.update(piece)
                        sock.sendall(piece)
                        sent += len(piece)
                if sent != length or check.hexdigest() != digest:  # (the file changed under us)
                    raise OSError(f"{data}: changed while it was sent")
        self._request({"op": "put", "path": rel_path, "length": length, "xxh3": digest}, body)
        return digest

    def seal(self, step: int, rank: int, attempt: str, files: list[str]) -> None:
        self._request({"op": "seal", "step": step, "rank": rank, "attempt": attempt, "files": files})

    def retire(self, rank: int, below: int) -> int:
        return self._request({"op": "retire", "rank": rank, "below": below}).get("deleted", 0)


def _names_of(marker: dict, field: str) -> list[str]:
    """The paths a marker's ``field`` lists (a marker is read as untrusted: anything
    that is not a list of strings names nothing)."""
    value = marker.get(field)
    return [p for p in value if isinstance(p, str)] if isinstance(value, list) else []


def _file_digest(path) -> tuple[str, int]:
    hasher, n = Hasher(), 0
    with open(path, "rb") as f:
        while True:
            piece = f.read(PIECE_BYTES)
            if not piece:
                return hasher.hexdigest(), n
            hasher.update(piece)
            n += len(piece)
