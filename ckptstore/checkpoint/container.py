"""The single-stream container: a checkpoint written to, or read from, one file-like
object (``ckptstore.save(obj, buffer)``).

A save to a stream goes through the normal write path into an in-memory store; the
container then lays that store's objects end to end::

    MAGIC  ("CKPTSTR\\x01", 8 bytes)
    repeated: u32 name length | name (UTF-8) | u64 data length | data
    END    ("CKPTEND\\x01", 8 bytes)

all integers little-endian. The manifest is the last object, so a stream cut short
has no END and no manifest, and does not load. Loading parses it back into a memory
store and reads that as any other checkpoint.

A save to a path that holds a plain file (say an old ``torch.save`` output) writes a
container too, replacing the file atomically (:func:`replace_file`).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import tempfile

from .. import format as fmt
from ..errors import FormatError, NotACheckpointError
from ..storage import MemoryStorage

MAGIC = b"CKPTSTR\x01"
END = b"CKPTEND\x01"


def write_container(store: MemoryStorage, f) -> None:
    items = store.items()
    # Manifests last: the stream is only complete once its commit record is in it.
    items.sort(key=lambda kv: fmt.parse_manifest_name(kv[0]) is not None)
    f.write(MAGIC)
    for name, data in items:
        raw = name.encode()
        f.write(struct.pack("<I", len(raw)))
        f.write(raw)
        f.write(struct.pack("<Q", len(data)))
        f.write(data)
    f.write(END)
    if hasattr(f, "flush"):
        f.flush()


def replace_file(store: MemoryStorage, path: str | os.PathLike) -> None:
    """Replace the regular file at ``path`` by the container of ``store``, atomically:
    a temporary file beside it, fsynced, renamed over it, then the directory fsynced.
    A crash or error leaves the old file or the new one, never a torn file. OS errors
    propagate as they are (as from torch.save)."""
    path = os.path.realpath(path)  # through a symlink, as torch.save writes through it
    where = os.path.dirname(path)
    prefix = _temp_prefix(path)
    _remove_dead_writers_temps(where, prefix)
    fd, tmp = tempfile.mkstemp(dir=where, prefix=prefix + f"{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write_container(store, fh)
            os.fsync(fh.fileno())
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))  # mkstemp made it 0600: keep the old mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)  # the rename is durable once its directory is
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _pid_space() -> str:
    """This host and PID namespace: where a pid names one process. (Containers sharing a
    host name have PID namespaces of their own: a pid of theirs says nothing here.)"""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0  # unknown: no temporary file is ever judged dead
    return f"{socket.gethostname()}-{ns}"


def _temp_prefix(path: str) -> str:
    # ".<name>.<host>-<pid namespace>.<pid>.<random>.tmp": whose it is, so a later save
    # can tell one a killed writer left (as large as the checkpoint) from one being written.
    return f".{os.path.basename(path)}.{_pid_space()}."


def _remove_dead_writers_temps(where: str, prefix: str) -> None:
    """Delete the temporary files named ``prefix``<pid>... in directory ``where`` that
    writers of this host and PID namespace, now dead (SIGKILL, power), left; a live
    process's, another host's or namespace's, and names of another form stay."""
    if prefix.endswith("-0."):  # the PID namespace is unknown: no pid can be judged
        return
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid, dot, rest = name[len(prefix):].partition(".")
        if not (pid.isdigit() and dot):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to signal): maybe writing it now
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, ValueError):
            continue
        try:
            os.unlink(os.path.join(where, name))
        except OSError:
            pass


_READ_PIECE = 64 << 20


def _read_exact(f, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes, read in bounded pieces: a length field that lies costs at
    most what the stream really holds, never an allocation of what it claims."""
    pieces, got = [], 0
    while got < n:
        data = f.read(min(n - got, _READ_PIECE))
        if not data:
            raise FormatError(f"checkpoint stream ends inside {what} ({got} of {n} bytes)")
        pieces.append(data)
        got += len(data)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def read_container_file(path) -> MemoryStorage | None:
    """The container in the regular file ``path`` as a memory store whose messages name
    the file, or None when the file is something else (a torch.save file, say)."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
        if head != MAGIC:
            return None
        store = read_container(f, head)
    store.url = os.path.abspath(path)
    return store


def read_container(f, head: bytes = b"") -> MemoryStorage:
    """Parse a container whose first bytes (``head``, up to 8) were already read."""
    magic = head + _read_exact(f, len(MAGIC) - len(head), "the header")
    if magic != MAGIC:
        raise NotACheckpointError("stream is not a ckptstore container")
    store = MemoryStorage()
    while True:
        tag = _read_exact(f, 4, "an object header")
        if tag + _peek4(f, tag) == END:
            return store
        (n,) = struct.unpack("<I", tag)
        try:
            name = _read_exact(f, n, "an object name").decode()
        except UnicodeDecodeError as e:
            raise FormatError(f"checkpoint stream holds an object name that is not UTF-8: {e}") from None
        fmt.check_relative_name(name, "container object name")
        (size,) = struct.unpack("<Q", _read_exact(f, 8, "an object length"))
        store.put(name, _read_exact(f, size, f"object {name!r}"))


def _peek4(f, tag: bytes) -> bytes:
    # END is 8 bytes and starts with "CKPT": only then read its second half.
    if tag != END[:4]:
        return b""
    rest = _read_exact(f, 4, "the end marker")
    if tag + rest != END:
        raise FormatError("checkpoint stream holds a corrupt end marker")
    return rest
