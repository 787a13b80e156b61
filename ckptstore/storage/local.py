"""Local filesystem backend with real durability, that never follows a symlink below
its root.

Files are fsynced before they count as written, and so is every directory whose
entries changed, since a rename or link is only durable once its directory is. A
create-only put writes a temporary file, fsyncs it, then ``os.link``s it into place:
link fails when the target exists, so a committed manifest can never be replaced (I1).

Symlinks and special files. The root path itself may be a symlink (roots point at
mounts); nothing below it is ever followed. Every operation reaches a key's directory
one component at a time from the root, ``os.open(name, O_DIRECTORY | O_NOFOLLOW,
dir_fd=parent)``, and then acts on the last component relative to that directory fd,
so a symlink (or a FIFO, socket, device) anywhere in the key is seen, never gone
through, and a swap during the walk cannot redirect it:

- ``readinto`` / ``read`` open the object ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never
  blocks the open) and ``fstat`` it; ``stat`` / ``exists`` ``lstat`` it. A symlink or
  non-regular object, or a symlink (or other non-directory that is not a regular file)
  in a directory component, raises :class:`NotRegularObjectError` naming the key. A
  directory where an object belongs, or a regular file where a directory belongs, is a
  missing object (:class:`ObjectNotFoundError`), as on object stores.
- ``put`` / ``open_append`` create missing directories the same way and refuse
  (:class:`NotRegularObjectError`) to create anything through a symlinked directory.
- ``delete`` unlinks relative to the key's directory fd: a key that is a symlink loses
  the link, never its target; a key below a symlinked directory raises
  :class:`NotRegularObjectError` and deletes nothing. It then removes the directories
  it left empty, climbing the key's own components only, never the root, never through
  a symlink.
- ``walk`` is a scandir walk over directory fds: regular files are ``kind="file"``;
  symlinks (``"symlink"``) and FIFOs, sockets, devices (``"other"``) are reported with
  size 0 and never descended into or followed; so ``delete_prefix`` (walk + delete)
  removes symlinks themselves, never what they point at.
- ``list`` / ``walk`` of a prefix that goes through a symlink (or names no directory)
  list nothing, as a missing prefix does. Symlinks are listed as plain names.
- ``child(prefix)`` is a view that keeps walking from this root: a symlink in the
  prefix is refused on use, never followed.

Names on disk that are not valid keys (a backslash in a name) are left out of ``list``
and ``walk``: no key could address them.
"""

from __future__ import annotations

import errno
import os
import stat as _stat
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ..errors import (
    AlreadyExistsError,
    CkptStoreError,
    NotRegularObjectError,
    ObjectNotFoundError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
    TruncatedObjectError,
)
from ..names import TMP_MARK, temp_name
from .base import AppendWriter, ObjectInfo, ReadHints, Storage, _check_limit

READ_PIECE = 4 << 20  # read (and hash) in pieces that stay in the CPU cache
WRITEBACK_MIN = 1 << 20
# Read coalescing (see storage/base.py). A read of its own costs a reader-pool job, an
# open, a preadv, a close and a hasher (~100 us per blob measured on 2 cores, page
# cache warm); a byte read as part of a merged read costs nothing more for a load,
# which scatters it into place (readinto_scatter), and one memcpy (~0.1 ns) for verify.
# So blobs up to 256 KiB are merged, in reads of up to READ_PIECE (verify's temporary
# buffer stays cache-sized). Only touching blobs (gap 0): a data file is tiled by its
# blobs, so a full load merges every run of small blobs anyway; gaps occur only in
# partial loads, where bridging one would save a single job and read bytes the load
# does not need (tests/test_sharded.py counts them).
# Loading 9,000 tensors of 4 B-16 KiB: 1.0 s of reads before, 0.24 s after.
MAX_WALK_DEPTH = 32  # walk never descends further (see LocalStorage._walk_fd)
COALESCE_BLOB = 256 << 10
COALESCE_GAP = 0
COALESCE_LIMIT = READ_PIECE
try:
    _IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers per preadv
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024
if _IOV_MAX <= 0:
    _IOV_MAX = 1024

_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the root itself may be a symlink
_DIR_FLAGS = _ROOT_FLAGS | os.O_NOFOLLOW
# O_NONBLOCK: opening a FIFO for reading never waits for a writer (fstat then refuses it);
# O_NOCTTY: a terminal device in the store never becomes our controlling terminal.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_RETRIES = 3  # a concurrent delete may prune a directory we are about to create in


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _what(mode: int) -> str:
    if _stat.S_ISLNK(mode):
        return "a symlink"
    if _stat.S_ISFIFO(mode):
        return "a FIFO"
    if _stat.S_ISSOCK(mode):
        return "a socket"
    if _stat.S_ISCHR(mode) or _stat.S_ISBLK(mode):
        return "a device"
    if _stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def _kind(mode: int) -> str:
    """ObjectInfo.kind of a non-directory."""
    if _stat.S_ISREG(mode):
        return "file"
    return "symlink" if _stat.S_ISLNK(mode) else "other"


def _valid_name(name: str) -> bool:
    return "\\" not in name  # scandir never returns "", "." or ".."; "/" and NUL cannot occur


def translate(e: OSError, where: str, reading: bool = False) -> StorageError:
    """The package's storage error for ``e``, naming the location. ``reading``: a regular
    file where a directory belongs (ENOTDIR) means the object is missing."""
    if isinstance(e, FileNotFoundError) or e.errno == errno.ENOENT or (reading and e.errno == errno.ENOTDIR):
        return ObjectNotFoundError(f"{where}: not found")
    if isinstance(e, FileExistsError):
        return AlreadyExistsError(f"{where}: already exists")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StoragePermissionError(f"{where}: permission denied ({e.strerror})")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"{where}: no space left on device")
    return StorageError(f"{where}: {e.strerror or e}")


@contextmanager
def os_errors(where: str, reading: bool = False):
    """Translate OSError into the package's storage errors, naming the location."""
    try:
        yield
    except OSError as e:
        raise translate(e, where, reading) from e


class LocalStorage(Storage):
    """Files below ``root`` (see the module docstring for the symlink rules)."""

    read_hints = ReadHints(COALESCE_BLOB, COALESCE_GAP, COALESCE_LIMIT)
    keeps_empty_dirs = True  # (a save killed before its first file leaves some: gc removes them)

    def __init__(self, root: str | os.PathLike, _sub: tuple[str, ...] = ()):
        # _base is the root the user gave (followed, symlink or not); _sub the checked
        # components of a child view below it, walked like any key's directories.
        self._base = os.path.abspath(os.fspath(root))
        self._sub = _sub
        self._top = os.path.join(self._base, "")  # + a name: the path of a top-level entry
        self.root = os.path.join(self._base, *_sub)
        self.url = self.root

    # -- helpers
    def _parts(self, key: str, prefix: bool = False) -> list[str]:
        """The path components below the base root of a (checked) key or prefix."""
        name = self._check(key, prefix)
        return [*self._sub, *name.split("/")] if name else [*self._sub]

    def _rel(self, parts: list[str]) -> str:
        return "/".join(parts[len(self._sub):])

    def _makedirs(self, path: str) -> None:
        """Create the missing directories of the root path (not below it: see _dirs) and
        fsync each parent whose entries changed."""
        missing = []
        p = path
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue
            _fsync_dir(os.path.dirname(d))

    def _open_root(self, create: bool = False) -> int:
        try:
            return os.open(self._base, _ROOT_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        self._makedirs(self._base)
        return os.open(self._base, _ROOT_FLAGS)

    def _refuse(self, e: OSError, name: str, dir_fd: int | None, key: str, parts: list[str]) -> None:
        """After ``e`` (ELOOP, ENOTDIR) opening ``name``: raise NotRegularObjectError when
        it is a symlink or special file, else re-raise ``e``."""
        if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EOPNOTSUPP):
            raise e
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            raise e from None
        if _stat.S_ISREG(st.st_mode) or _stat.S_ISDIR(st.st_mode):
            raise e
        # Name the component as a key below this root, or (in a child view's own prefix)
        # by its path.
        name = self._rel(parts) if len(parts) > len(self._sub) else os.path.join(self._base, *parts)
        raise NotRegularObjectError(
            f"{self.describe(key)}: {name!r} is {_what(st.st_mode)}, never followed or opened through") from e

    def _dirs(self, parts: list[str], key: str, *, root_fd: int | None = None,
              create: bool = False) -> list[int]:
        """fds of the directories ``parts[:1]``, ``parts[:2]``, ... below the base root,
        each opened O_NOFOLLOW relative to the one before; the first relative to
        ``root_fd``, or (None) by its path under the root. ``create``: make missing ones
        (``root_fd`` required), fsyncing their parents. The caller closes the fds."""
        fds: list[int] = []
        try:
            for i, name in enumerate(parts):
                parent = fds[-1] if fds else root_fd
                at = name if parent is not None else self._top + name
                try:
                    fds.append(os.open(at, _DIR_FLAGS, dir_fd=parent))
                    continue
                except FileNotFoundError:
                    if not create:
                        raise
                except OSError as e:
                    self._refuse(e, at, parent, key, parts[:i + 1])
                try:
                    os.mkdir(at, 0o777, dir_fd=parent)
                    os.fsync(parent)
                except FileExistsError:
                    pass  # made by someone else meanwhile: open (and check) theirs
                try:
                    fds.append(os.open(at, _DIR_FLAGS, dir_fd=parent))
                except OSError as e:
                    if isinstance(e, FileNotFoundError):
                        raise
                    self._refuse(e, at, parent, key, parts[:i + 1])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _parent(self, parts: list[str], key: str) -> int:
        """An fd of the directory that is to hold ``parts[-1]``, its missing directories
        created on the way, none through a symlink. The caller closes it."""
        for tries in range(_CREATE_RETRIES):
            root_fd = self._open_root(create=True)
            if len(parts) == 1:
                return root_fd
            try:
                fds = self._dirs(parts[:-1], key, root_fd=root_fd, create=True)
            except FileNotFoundError:
                # A concurrent delete pruned a directory between our mkdir and open.
                if tries == _CREATE_RETRIES - 1:
                    raise
                continue
            finally:
                os.close(root_fd)
            for d in fds[:-1]:
                os.close(d)
            return fds[-1]
        raise AssertionError("unreachable")

    def _open_object(self, key: str) -> tuple[int, os.stat_result]:
        """(fd, fstat) of the regular file ``key``, opened without following a symlink.
        The hot path of every load: plain try blocks, messages built only on errors."""
        parts = self._parts(key)
        try:
            if len(parts) == 1:
                at, parent, fds = self._top + parts[0], None, ()
            else:
                fds = self._dirs(parts[:-1], key)
                at, parent = parts[-1], fds[-1]
            try:
                fd = os.open(at, _READ_FLAGS, dir_fd=parent)
            except OSError as e:
                self._refuse(e, at, parent, key, parts)
            finally:
                for d in fds:
                    os.close(d)
        except OSError as e:
            raise translate(e, self.describe(key), reading=True) from e
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not _stat.S_ISREG(st.st_mode):
            os.close(fd)
            where = self.describe(key)
            if _stat.S_ISDIR(st.st_mode):
                raise ObjectNotFoundError(f"{where}: not found (a directory, not an object)")
            raise NotRegularObjectError(f"{where}: {_what(st.st_mode)}, not a regular file: never read")
        return fd, st

    # -- interface
    def child(self, prefix: str) -> "LocalStorage":
        return type(self)(self._base, tuple(self._parts(prefix, prefix=True)))  # subclasses keep their kind

    def sibling(self, name: str) -> "LocalStorage":
        if self._sub:
            return type(self)(self._base, self._sub[:-1]).child(name)
        real = os.path.realpath(self._base)  # a checkpoint reached through a symlink: beside the real one
        parent = os.path.dirname(real)
        if parent == real:
            return super().sibling(name)
        return type(self)(parent).child(name)

    def put(self, key: str, data, *, if_absent: bool = False) -> None:
        parts = self._parts(key)
        name = parts[-1]
        tmp = temp_name(name)
        with os_errors(self.describe(key)):
            dfd = self._parent(parts, key)
            try:
                fd = os.open(tmp, _CREATE_FLAGS, 0o644, dir_fd=dfd)
                try:
                    try:
                        _write_all(fd, data, 0)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    if if_absent:
                        # EEXIST when the key exists (a symlink too): never replaces
                        os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                        os.unlink(tmp, dir_fd=dfd)
                    else:
                        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # a symlink there: replaced, not followed
                except BaseException:
                    _silent_unlink(tmp, dfd)
                    raise
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def open_append(self, key: str, *, size_hint: int | None = None, writers: int = 1) -> AppendWriter:
        parts = self._parts(key)
        with os_errors(self.describe(key)):
            dfd = self._parent(parts, key)
            try:
                fd = os.open(parts[-1], _CREATE_FLAGS, 0o644, dir_fd=dfd)
            except BaseException:
                os.close(dfd)
                raise
        return _LocalAppendWriter(self, key, parts[-1], dfd, fd)

    def readinto(self, key: str, offset: int, out: memoryview, on_piece=None) -> None:
        fd, _st = self._open_object(key)
        try:
            self._read_fd(fd, key, offset, out, on_piece)
        finally:
            os.close(fd)

    def readinto_scatter(self, key: str, offset: int, outs: list[memoryview]) -> None:
        fd, _st = self._open_object(key)
        try:
            pending = [o for o in outs if len(o)]
            pos, i = offset, 0
            while i < len(pending):
                n = os.preadv(fd, pending[i:i + _IOV_MAX], pos)
                if n == 0:
                    raise TruncatedObjectError(f"{self.describe(key)}: short read, wanted "
                                               f"{sum(len(o) for o in outs)} bytes at offset {offset}, "
                                               f"object ends after {pos - offset}")
                pos += n
                while n:  # past the buffers this call filled, into the one it filled in part
                    if n >= len(pending[i]):
                        n -= len(pending[i])
                        i += 1
                    else:
                        pending[i] = pending[i][n:]
                        n = 0
        except OSError as e:
            raise translate(e, self.describe(key)) from e
        finally:
            os.close(fd)

    def read(self, key: str, offset: int = 0, length: int | None = None, *, limit: int | None = None) -> bytes:
        fd, st = self._open_object(key)  # one open: the size comes from its fstat
        try:
            if length is None and offset > st.st_size:
                raise TruncatedObjectError(f"{self.describe(key)}: short read at offset {offset}, "
                                           f"object holds {st.st_size} bytes")
            if length is None:
                _check_limit(self, key, st.st_size - offset, limit)
            buf = bytearray(st.st_size - offset if length is None else length)
            self._read_fd(fd, key, offset, memoryview(buf), None)
        finally:
            os.close(fd)
        return bytes(buf)

    def _read_fd(self, fd: int, key: str, offset: int, out: memoryview, on_piece) -> None:
        done = 0
        try:
            while done < len(out):
                piece = out[done:done + READ_PIECE]
                got = 0
                while got < len(piece):
                    n = os.preadv(fd, [piece[got:]], offset + done + got)
                    if n == 0:
                        raise TruncatedObjectError(
                            f"{self.describe(key)}: short read, wanted {len(out)} bytes at "
                            f"offset {offset}, object ends after {done + got}"
                        )
                    got += n
                if on_piece is not None:
                    on_piece(piece)
                done += got
        except OSError as e:
            raise translate(e, self.describe(key)) from e

    def _open_prefix(self, prefix: str) -> tuple[str, int | None]:
        """(the prefix without '/', fd of its directory), None when it names no directory
        reached without a symlink: such a prefix has no children."""
        parts = self._parts(prefix, prefix=True)
        name = self._rel(parts)
        with os_errors(self.describe(prefix)):
            try:
                fds = self._dirs(parts, prefix) if parts else [os.open(self._base, _ROOT_FLAGS)]
            except (FileNotFoundError, NotADirectoryError, NotRegularObjectError):
                return name, None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    return name, None
                raise
        for d in fds[:-1]:
            os.close(d)
        return name, fds[-1]

    def list(self, prefix: str = "") -> list[str]:
        """The children of ``prefix``: sub-directories end in '/', everything else
        (symlinks, special files included) is a plain name. A prefix that goes through a
        symlink lists nothing, like a missing one."""
        _, fd = self._open_prefix(prefix)
        if fd is None:
            return []
        try:
            with os_errors(self.describe(prefix)):
                entries = list(os.scandir(fd))
        finally:
            os.close(fd)
        out = []
        for e in entries:
            if TMP_MARK in e.name or not _valid_name(e.name):
                continue
            out.append(e.name + "/" if e.is_dir(follow_symlinks=False) else e.name)
        return sorted(out)

    def walk(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below ``prefix``, recursively, in name order: regular files
        (``kind="file"``) and, never descended into or followed, symlinks
        (``"symlink"``) and FIFOs, sockets, devices (``"other"``), size 0. A prefix
        that goes through a symlink walks nothing, like a missing one."""
        name, fd = self._open_prefix(prefix)  # checked now, not at the first next()
        if fd is None:
            return iter(())
        return self._walk_fd(fd, f"{name}/" if name else "", 0)

    def _walk_fd(self, fd: int, rel: str, depth: int) -> Iterator[ObjectInfo]:
        """Walk the directory ``fd`` (closed at the end) whose key prefix is ``rel``.
        A directory ``MAX_WALK_DEPTH`` levels down is reported as an ``"other"`` entry,
        not descended: no tree a store holds is that deep, and a planted one must cost
        neither the stack nor one open fd per level."""
        try:
            try:
                entries = sorted(os.scandir(fd), key=lambda e: e.name)
            except OSError as e:
                with os_errors(self.describe(rel)):
                    raise e
            for e in entries:
                if not _valid_name(e.name):
                    continue
                key = rel + e.name
                if e.is_dir(follow_symlinks=False) and depth < MAX_WALK_DEPTH:
                    try:
                        sub = os.open(e.name, _DIR_FLAGS, dir_fd=fd)
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # deleted or replaced while we walked
                    except OSError as err:
                        if err.errno != errno.ELOOP:
                            with os_errors(self.describe(key)):
                                raise err
                        sub = None  # swapped for a symlink meanwhile: report it as one, below
                    if sub is not None:
                        yield from self._walk_fd(sub, key + "/", depth + 1)
                        continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted while we walked
                if _stat.S_ISDIR(st.st_mode) and depth < MAX_WALK_DEPTH:
                    continue  # replaced by a directory meanwhile: not an object
                kind = _kind(st.st_mode)
                yield ObjectInfo(key, st.st_size if kind == "file" else 0, st.st_mtime, kind)
        finally:
            os.close(fd)

    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of the regular file ``key`` (lstat: a symlink, FIFO, socket or
        device raises NotRegularObjectError; a directory is not an object)."""
        parts = self._parts(key)
        where = self.describe(key)
        with os_errors(where, reading=True):
            fds = self._dirs(parts[:-1], key)
            try:
                if fds:
                    st = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
                else:
                    st = os.stat(self._top + parts[-1], follow_symlinks=False)
            finally:
                for d in fds:
                    os.close(d)
        if _stat.S_ISDIR(st.st_mode):
            raise ObjectNotFoundError(f"{where}: not found (a directory, not an object)")
        if not _stat.S_ISREG(st.st_mode):
            raise NotRegularObjectError(f"{where}: {_what(st.st_mode)}, not a regular file")
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def remove_empty_dirs(self, prefixes, older_than: float, dry_run: bool = False) -> list[str]:
        """See :meth:`Storage.remove_empty_dirs`. Each directory is opened from the root
        one component at a time, ``O_NOFOLLOW`` (a prefix through a symlink names no
        directory), read and ``fstat``ed through that fd; ``rmdir`` runs relative to its
        parent's fd, and refuses a directory that gained an entry meanwhile."""
        rels = [self._check(p, prefix=True) for p in prefixes]  # every prefix, before anything is touched
        cutoff = time.time() - older_than
        chosen: list[str] = []  # in the caller's order; judged before any removal
        gone: set[str] = set()
        for name in rels:
            if not name:
                continue  # the root: never
            try:
                _, fd = self._open_prefix(name)
            except CkptStoreError:
                continue  # (cannot be opened: not ours to judge)
            if fd is None:
                continue
            try:
                old = os.fstat(fd).st_mtime <= cutoff
                entries = list(os.scandir(fd))
            except OSError:
                continue
            finally:
                os.close(fd)
            if old and all(e.is_dir(follow_symlinks=False) and f"{name}/{e.name}" in gone for e in entries):
                chosen.append(name)
                gone.add(name)
        if dry_run:
            return chosen
        removed = []
        for rel in chosen:  # children first; rmdir refuses one that is no longer empty
            try:
                parts = self._parts(rel)
                fds = self._dirs(parts[:-1], rel)
            except (OSError, CkptStoreError):  # (a name no key may have: not ours to touch)
                continue
            try:
                os.rmdir(parts[-1] if fds else self._top + parts[-1], dir_fd=fds[-1] if fds else None)
                removed.append(rel)
            except OSError:
                pass
            finally:
                for d in fds:
                    os.close(d)
        return removed

    def delete(self, key: str) -> None:
        """Remove ``key`` (missing: nothing to do). A symlink is unlinked itself, never
        its target. A key below a symlinked directory raises NotRegularObjectError and
        nothing is deleted. Then removes the directories the delete left empty, up the
        key's own components only (never the root, never through a symlink)."""
        parts = self._parts(key)
        where = self.describe(key)
        try:
            fds = self._dirs(parts[:-1], key)
        except (FileNotFoundError, NotADirectoryError):
            return  # its directory is missing (or a file): so is the key
        except OSError as e:
            with os_errors(where):
                raise e
        try:
            parent = fds[-1] if fds else None
            at = parts[-1] if fds else self._top + parts[-1]
            try:
                os.unlink(at, dir_fd=parent)
            except FileNotFoundError:
                return
            except OSError as e:
                with os_errors(where):
                    raise e
            # Best effort: drop directories the delete left empty, each relative to its
            # parent's fd (the first by its path below the root); rmdir never follows a
            # symlink, and the loop ends at the root's child.
            for i in range(len(parts) - 2, len(self._sub) - 1, -1):
                at = parts[i] if i else self._top + parts[0]
                try:
                    os.rmdir(at, dir_fd=fds[i - 1] if i else None)
                except OSError:
                    break
        finally:
            for d in fds:
                os.close(d)

    def is_dir(self) -> bool:
        """Whether the root is a directory, empty or not (a child view's: reached from
        the base root without a symlink)."""
        _, fd = self._open_prefix("")
        if fd is None:
            return False
        os.close(fd)
        return True


def _write_all(fd: int, data, offset: int) -> None:
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)


def _silent_unlink(name: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


class _LocalAppendWriter(AppendWriter):
    """Appends from several threads, each written whole under one lock, so the file
    only ever grows at its end. Concurrent pwrites at interleaved offsets past the end
    were several times slower than the same writes in order (ext4, 2 threads, 4 MiB
    each: 64 MiB in 128 ms against 17 ms; docs/performance.md, "Appends write in order"),
    and a page-cache write is a memcpy that gains nothing from a second thread. Holds an
    fd of the object's directory until close, to fsync it (and to unlink on abort)
    without resolving the path again."""

    def __init__(self, storage: LocalStorage, key: str, name: str, dir_fd: int, fd: int):
        self.key = key
        self._storage = storage
        self._name = name
        self._dir_fd = dir_fd
        self._fd = fd
        self._size = 0
        self._lock = threading.Lock()

    def append(self, data) -> int:
        n = memoryview(data).nbytes
        with os_errors(self._storage.describe(self.key)):
            with self._lock:
                offset = self._size
                _write_all(self._fd, data, offset)
                self._size += n  # only once written: a failed write leaves no hole
            if n >= WRITEBACK_MIN:
                # Start writing this range to disk now: the fsync at close() then waits
                # for the tail only, instead of flushing the whole file at the end.
                os.posix_fadvise(self._fd, offset, n, os.POSIX_FADV_DONTNEED)
        return offset

    def close(self) -> int:
        with os_errors(self._storage.describe(self.key)):
            try:
                os.fsync(self._fd)
                os.fsync(self._dir_fd)
            finally:
                os.close(self._fd)
                self._fd = -1
                os.close(self._dir_fd)
                self._dir_fd = -1
        return self._size

    def abort(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        if self._dir_fd >= 0:
            _silent_unlink(self._name, self._dir_fd)
            try:
                os.close(self._dir_fd)
            except OSError:
                pass
            self._dir_fd = -1
            return
        try:  # closed already: remove it by key (never through a symlink either)
            self._storage.delete(self.key)
        except Exception:
            pass

    def __del__(self):
        for fd in (self._fd, self._dir_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
