"""The S3 store, :class:`S3Storage`: the byte-store contract (storage/base.py) over a
boto3 client; how each method maps to requests is in the package docstring and
docs/s3.md."""

from __future__ import annotations

import functools
import os
import re
import secrets
import threading
import time

from ...config import config as process_config
from concurrent.futures import CancelledError
from contextlib import contextmanager
from typing import Iterable, Iterator

from botocore import exceptions as bexc

from ..._threads import run_all
from ...errors import (
    AlreadyExistsError,
    CkptStoreError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
    TruncatedObjectError,
)
from ..base import AppendWriter, ObjectInfo, ReadHints, Storage, _check_limit, check_key, redact_url
from ..urls import valid_bucket
from .client import (
    DEFAULT_COALESCE_BLOB,
    DEFAULT_COALESCE_GAP,
    DEFAULT_CONCURRENCY,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_PART_SIZE,
    DEFAULT_READ_PART_SIZE,
    DEFAULT_READ_TIMEOUT,
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    MiB,
    _Shared,
    check_checksums,
    new_client,
    sends_checksum_trailers,
)
from .errors import CONFLICT, EXISTS, NOT_IMPLEMENTED, _NOT_FOUND, _STREAM_ERRORS, _backoff, _client_error, _scrub_exception, translate
from .request_args import RequestArgs
from .writer import PartPlan, UploadTarget, _byte_view, _S3AppendWriter, plan_parts

_DELETE_BATCH = 1000  # DeleteObjects limit
CONDITIONAL_WRITES = ("probe", "trust", "single-writer")
CONFLICT_RETRIES = 5  # 409 ConditionalRequestConflict: retries of a create-only put before the read-back
# The conditional-write probe's verdict, per (endpoint, bucket), for the process.
_PROBED: dict[tuple, str] = {}
_PROBE_LOCKS: dict[tuple, threading.Lock] = {}
_PROBE_LOCK = threading.Lock()


def _fresh_probe_locks() -> None:  # a forked child must not inherit a lock a parent's thread held
    global _PROBE_LOCK
    _PROBE_LOCK = threading.Lock()
    _PROBE_LOCKS.clear()


os.register_at_fork(after_in_child=_fresh_probe_locks)
# Requests whose body botocore may send aws-chunked with a trailing checksum, and words
# in a store's refusal of that.
_STREAMING_OPS = {"PutObject", "UploadPart"}
_CHECKSUM_WORDS = re.compile(r"trailer|aws-chunked|checksum|streaming-unsigned", re.IGNORECASE)
CHECKSUM_HINT = ("this store may refuse botocore's request checksums (over HTTPS an aws-chunked body with a "
                 "trailing x-amz-checksum-crc32): pass storage_options={'checksums': 'when_required'} "
                 "(docs/s3.md, 'Checksums')")
_READ_BLOCK = 4 * MiB  # bytes read off a response body at a time (and handed to on_piece)


def _is_conflict(e: BaseException) -> bool:
    """A 409 ConditionalRequestConflict (retried by a create-only put)."""
    return isinstance(e, bexc.ClientError) and _client_error(e)[0] in CONFLICT


def _wants_content_md5(e: BaseException) -> bool:
    """A store refusing a DeleteObjects that carries no Content-MD5 (older MinIO:
    400 MissingContentMD5; others: 400 InvalidRequest naming Content-MD5)."""
    if not isinstance(e, bexc.ClientError):
        return False
    code, msg, _status, _tries = _client_error(e)
    return code == "MissingContentMD5" or (code == "InvalidRequest" and "content-md5" in msg.lower())


def _as_bytes(data) -> bytes:
    if isinstance(data, bytes):
        return data
    return bytes(memoryview(data).cast("B"))


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix``.

    ``client``: a ready boto3 S3 client (its own retry and timeout settings then apply;
    ``endpoint_url``, ``region_name``, ``profile_name``, ``max_attempts``, ``retry_mode``
    and the timeouts are ignored). Otherwise a client is made from boto3's standard
    configuration, overridden by the arguments given here.

    ``part_size`` (>= 5 MiB, default 16 MiB): multipart part size for appended objects;
    ``open_append``'s size hint and writer count may make one upload's parts larger (all
    equal), and parts past the plan grow (:meth:`part_plan`). ``read_part_size`` (default
    8 MiB): a ``readinto`` larger than this is split into ranged GETs of this size, run
    concurrently. ``max_concurrency`` (default 10): parts or ranges in flight per object.
    ``max_attempts``: total attempts per request (default: ``AWS_MAX_ATTEMPTS`` or the
    profile's ``max_attempts``, else 10). ``retry_mode``: ``"standard"`` or
    ``"adaptive"`` (default: ``AWS_RETRY_MODE`` or the profile's, else standard).
    ``connect_timeout`` / ``read_timeout``: seconds per attempt (10, 60).

    Loads coalesce the GETs of small blobs close together in one object (``read_hints``,
    storage/base.py): ``read_coalesce_blob`` (default 1 MiB): only blobs at most this large are merged;
    ``read_coalesce_gap`` (64 KiB): the most unneeded bytes fetched between two of them;
    ``read_coalesce_limit`` (default ``read_part_size``): the largest merged GET, 0 to
    turn coalescing off.

    ``conditional_writes``: how create-only puts (votes, manifests: I1) are made safe
    (default: ``CKPTSTORE_S3_CONDITIONAL_WRITES``, else ``"probe"``). ``"probe"``: before the first one, put a probe key twice with
    ``If-None-Match: *`` and require the store to refuse the second (once per process,
    endpoint and bucket); a store that ignores the header or answers 501 is refused with
    an error naming this option. ``"trust"``: no probe (AWS S3 and stores known to
    honour it). ``"single-writer"``: a store without conditional writes, used by one
    writer per checkpoint location at a time: a create-only put checks that the key is
    absent, then puts (two committers of one location could then both win).

    ``expected_bucket_owner`` (a 12-digit account id), ``request_payer`` and
    ``sse_kms_key_id``: added to every request that takes them (request_args.py).

    ``checksums``: botocore's request checksums (docs/s3.md, "Checksums"). None (default):
    botocore's own setting (``AWS_REQUEST_CHECKSUM_CALCULATION``, the profile's
    ``request_checksum_calculation``, else "when_supported" since botocore 1.36, which
    over HTTPS sends every PutObject / UploadPart aws-chunked with a trailing CRC32 that
    some S3-compatible stores refuse). ``"when_required"``: only where an operation
    requires one (R2, GCS, B2, Wasabi); ``"when_supported"``: always. Not with
    ``client`` (set it on that client's Config). Transport checksums are an extra: load
    checks every blob's xxh3-128 whatever this says.
    """

    opens_remotely = True  # a HEAD and CreateMultipartUpload

    def __init__(self, bucket: str, prefix: str = "", *, client=None, endpoint_url: str | None = None,
                 region_name: str | None = None, profile_name: str | None = None,
                 part_size: int = DEFAULT_PART_SIZE, max_concurrency: int = DEFAULT_CONCURRENCY,
                 max_attempts: int | None = None, retry_mode: str | None = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, read_timeout: float = DEFAULT_READ_TIMEOUT,
                 read_part_size: int | None = None, read_coalesce_blob: int = DEFAULT_COALESCE_BLOB,
                 read_coalesce_gap: int = DEFAULT_COALESCE_GAP, read_coalesce_limit: int | None = None,
                 conditional_writes: str | None = None, expected_bucket_owner: str | None = None,
                 request_payer: bool = False, sse_kms_key_id: str | None = None, checksums: str | None = None,
                 _parts_per_tier: int = MAX_PARTS // 10, _shared: _Shared | None = None):
        if not bucket or not valid_bucket(bucket):  # (never echoed: s3://KEY:SECRET@bucket gives "KEY:SECRET")
            raise ValueError("invalid S3 bucket name (not shown: it may hold a credential): letters, digits, '.', "
                             "'-' and '_' only, at most 255; credentials do not belong in an s3:// URL "
                             "(boto3's configuration provides them)")
        self.bucket = bucket
        # The root prefix obeys the key grammar too: "a/../victim" would be literal on
        # AWS but normalised by some S3-compatible servers and proxies.
        self.prefix = check_key(prefix.strip("/"), f"S3 prefix of bucket {bucket!r}", prefix=True) if prefix.strip("/") else ""
        self.url = redact_url(f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}")
        if _shared is not None:
            self._shared = _shared
            return
        part_size = int(part_size)
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be between 5 MiB and 5 GiB (S3's limits), got {part_size}")
        if int(max_concurrency) < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        read_part_size = int(read_part_size or DEFAULT_READ_PART_SIZE)
        coalesce = (int(read_coalesce_blob), int(read_coalesce_gap),
                    read_part_size if read_coalesce_limit is None else int(read_coalesce_limit))
        if min(coalesce) < 0:
            raise ValueError(f"read_coalesce_blob, _gap and _limit must be >= 0, got {coalesce}")
        hints = ReadHints(*coalesce)
        if conditional_writes is None:
            conditional_writes = process_config().s3_conditional_writes
        if conditional_writes not in CONDITIONAL_WRITES:
            raise ValueError(f"conditional_writes must be one of {', '.join(CONDITIONAL_WRITES)}, "
                             f"got {conditional_writes!r}")
        check_checksums(checksums)
        if checksums is not None and client is not None:
            raise ValueError("checksums applies to the clients S3Storage makes; for a ready client, set "
                             "botocore Config(request_checksum_calculation=...) on it")
        if retry_mode is not None and retry_mode not in ("standard", "adaptive", "legacy"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
        if client is None:
            client, max_attempts = new_client(
                profile_name=profile_name, endpoint_url=endpoint_url, region_name=region_name,
                max_attempts=max_attempts, retry_mode=retry_mode, connect_timeout=connect_timeout,
                read_timeout=read_timeout, max_concurrency=max_concurrency, checksums=checksums)
        elif max_attempts is None:
            max_attempts = client.meta.config.retries.get("total_max_attempts") or DEFAULT_MAX_ATTEMPTS
        self._shared = _Shared(bucket, client, part_size, int(max_concurrency), int(max_attempts),
                               read_part_size, max(1, int(_parts_per_tier)), hints)
        self._shared.conditional_writes = conditional_writes
        args = RequestArgs(bucket, expected_bucket_owner=expected_bucket_owner, request_payer=request_payer,
                           sse_kms_key_id=sse_kms_key_id)
        if args:
            args.register(client)

    # -- helpers
    @property
    def client(self):
        """The boto3 S3 client (e.g. to register botocore event hooks)."""
        return self._shared.client

    @property
    def part_size(self) -> int:
        return self._shared.part_size

    @property
    def read_hints(self) -> ReadHints:
        """Read coalescing, from ``read_coalesce_blob`` / ``_gap`` / ``_limit``."""
        return self._shared.read_hints

    def _join(self, name: str) -> str:
        """prefix/name, unchecked (for messages and checked names)."""
        return f"{self.prefix}/{name}" if self.prefix and name else (name or self.prefix)

    def _k(self, key: str) -> str:
        """The full S3 key of a checked ``key``: always below the store's prefix."""
        return self._join(self._check(key))

    def _dir(self, prefix: str) -> str:
        """The S3 prefix that lists what lies below a checked ``prefix`` (ends in '/', or '')."""
        p = self._join(self._check(prefix, prefix=True))
        return f"{p}/" if p else ""

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1:] if self.prefix else full_key

    def _listed(self, full_key: str) -> str | None:
        """The key of a listed object relative to this root; None when it is not a valid
        key (no method could address it)."""
        rel = self._rel(full_key)
        try:
            return check_key(rel)
        except ValueError:
            return None

    def describe(self, key: str = "") -> str:
        where = f"s3://{self.bucket}/{self._join(key.strip('/'))}" if (key or self.prefix) else f"s3://{self.bucket}"
        return self._shared.redact(where) if hasattr(self, "_shared") else redact_url(where)

    def __repr__(self) -> str:
        endpoint = self._shared.endpoint
        return f"S3Storage({self.url!r}" + (f", endpoint_url={endpoint!r})" if endpoint else ")")

    def part_plan(self, size_hint: int | None = None, writers: int = 1) -> PartPlan:
        """How ``open_append(key, size_hint=, writers=)`` cuts its object into parts
        (writer.py, :func:`~.writer.plan_parts`)."""
        sh = self._shared
        return plan_parts(sh.part_size, sh.max_concurrency, sh.parts_per_tier, size_hint, writers)

    def part_size_for(self, part_number: int) -> int:
        """Size of part ``part_number`` (1-based) of an object appended without hints:
        ``part_size`` for the first tenth of S3's 10,000 parts, then doubling every tenth,
        at most 5 GiB, so an object may reach 12.7 TiB at 16 MiB."""
        return self.part_plan().part_size(part_number)

    def _translate(self, e: BaseException, key: str = "") -> CkptStoreError:
        """A storage error naming the URL, classed as the interface wants it."""
        return self._translate_at(e, self.describe(key))

    def _refuses_checksums(self, e: BaseException) -> bool:
        """Whether ``e`` may be the store refusing botocore's request checksums: a 400 or
        501 to a PutObject / UploadPart whose text names them, or that was sent with a
        checksum trailer (R2 answers 501 "STREAMING-UNSIGNED-PAYLOAD-TRAILER not
        implemented"; others a 400)."""
        if not isinstance(e, bexc.ClientError) or e.operation_name not in _STREAMING_OPS:
            return False
        code, msg, status, _tries = _client_error(e)
        if status not in (400, 501) and code not in NOT_IMPLEMENTED:
            return False
        return bool(_CHECKSUM_WORDS.search(f"{code} {msg}")) or sends_checksum_trailers(self.client)

    @contextmanager
    def _errors(self, key: str = ""):
        try:
            yield
        except CkptStoreError:
            raise
        except Exception as e:
            raise self._translate(e, key) from e

    # -- interface
    def child(self, prefix: str) -> "S3Storage":
        return S3Storage(self.bucket, self._join(self._check(prefix, prefix=True)), _shared=self._shared)

    def sibling(self, name: str) -> "S3Storage":
        if not self.prefix:
            return super().sibling(name)
        parent = self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else ""
        return S3Storage(self.bucket, parent, _shared=self._shared).child(name)

    def put(self, key: str, data, *, if_absent: bool = False) -> None:
        full = self._k(key)
        body = _as_bytes(data)
        create_only = if_absent
        if if_absent and self._conditional_mode() == "single-writer":
            if self.exists(key):
                if self._holds(key, body) == "ours":  # our own earlier try landed
                    return
                raise AlreadyExistsError(f"{self.describe(key)}: already exists (conditional_writes='single-writer')")
            if_absent = False  # (a plain put; the read-back below still tells a landed write)
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        conflicts = 0
        while True:
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=body, **extra)
                return
            except Exception as e:
                cause, err = e, self._translate(e, key)
            # 409 ConditionalRequestConflict: another conditional write of the key was in
            # flight (perhaps our own earlier attempt); AWS says to retry. Then a 412 may be
            # our own write: resolved by the read-back below.
            if not _is_conflict(cause):
                break
            if conflicts == CONFLICT_RETRIES:
                err = TransientStorageError(f"{self.describe(key)}: create-only write met a concurrent write of "
                                            f"the key {conflicts + 1} times (409 ConditionalRequestConflict)")
                break
            conflicts += 1
            _backoff(conflicts)
        # A create-only PUT whose response was lost (reset, stall past the read timeout, a
        # 5xx after the write) may have been stored: botocore's retry then meets its own
        # first attempt (412), or every retry fails too. Either way, read the key back:
        # holding exactly our bytes means the write landed (a manifest names its attempt
        # and commit time, so no other writer produces the same bytes).
        if create_only and (isinstance(err, TransientStorageError) or (
                isinstance(err, AlreadyExistsError) and isinstance(cause, bexc.ClientError)
                and (_client_error(cause)[3] > 1 or conflicts))):
            held = self._holds(key, body)
            if held == "ours":
                return
            if held is None:
                raise TransientStorageError(
                    f"{self.describe(key)}: create-only write failed ({err}) and reading the key back "
                    "failed too: whether this write landed is unknown") from cause
            if held == "other":  # another writer's bytes: a lost race, whatever the last answer was
                raise AlreadyExistsError(f"{self.describe(key)}: already exists, written by another writer "
                                         f"(after: {err})") from cause
        raise err from cause

    def _conditional_mode(self) -> str:
        """"header" (the store honours If-None-Match: *) or "single-writer", per the
        ``conditional_writes`` setting; a probe's verdict is kept per process, endpoint
        and bucket. Raises StorageError for a store that ignores the header."""
        setting = getattr(self._shared, "conditional_writes", "probe")
        if setting != "probe":
            return "header" if setting == "trust" else setting
        ident = (self._shared.endpoint, self.bucket)
        with _PROBE_LOCK:  # (held only to find this store's own lock)
            lock = _PROBE_LOCKS.setdefault(ident, threading.Lock())
        with lock:  # one probe per store at a time; other stores do not wait on it
            verdict = _PROBED.get(ident)
            if verdict is None:
                verdict = _PROBED[ident] = self._probe()
        if verdict != "ok":
            raise StorageError(f"{self.describe()}: this store {verdict}, so two committers of one checkpoint could "
                               "both win (invariants I1, I6). Use a store that honours it, or pass "
                               "storage_options={'conditional_writes': 'single-writer'} if only one job writes "
                               "each checkpoint location (docs/s3.md, 'Conditional writes')")
        return "header"

    def _probe(self) -> str:
        """Put a fresh probe key twice, create-only; "ok" when the second is refused,
        else what the store did. The probe key is deleted again. A first put refused
        (a retry that met its own lost first attempt) tells nothing: TransientStorageError,
        never AlreadyExistsError (the caller's own put was not tried), and nothing is kept."""
        name = f".ckptstore-probe-{os.getpid()}-{secrets.token_hex(6)}"
        full = self._join(name)
        try:
            for n in (1, 2):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=b"ckptstore conditional-write probe",
                                           IfNoneMatch="*")
                except bexc.ClientError as e:
                    code, _, status, _ = _client_error(e)
                    if self._refuses_checksums(e):  # not a verdict on If-None-Match: nothing is kept
                        raise self._translate(e, name) from e
                    if code in NOT_IMPLEMENTED or status == 501:
                        return "answers 501 NotImplemented to a create-only put (If-None-Match: *)"
                    refused = code in EXISTS or code in CONFLICT or status in (409, 412)
                    if n == 2 and refused:
                        return "ok"
                    err = self._translate(e, name)
                    if refused:  # a fresh key refused: our own retry met its lost first try; tells nothing
                        err = TransientStorageError(f"{self.describe(name)}: the conditional-write probe was "
                                                    f"inconclusive ({err}); retry")
                    raise err from e
                except Exception as e:
                    raise self._translate(e, name) from e
            return "accepted a second create-only put of one key: it ignores If-None-Match: *"
        finally:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=full)
            except Exception:  # a leftover probe object is harmless: tools skip names they do not know
                pass

    def _holds(self, key: str, body: bytes) -> str | None:
        """What ``key`` holds: "ours" (exactly ``body``), "other", "absent", or None
        when it could not be read to tell."""
        for _ in range(3):  # each read has botocore's retries already; this is for the verdict
            try:
                return "ours" if self.read(key) == body else "other"
            except ObjectNotFoundError:
                return "absent"
            except CkptStoreError:
                continue
        return None

    def open_append(self, key: str, *, size_hint: int | None = None, writers: int = 1) -> AppendWriter:
        """A streamed upload (writer.py); ``size_hint`` and ``writers`` choose its part
        size (:meth:`part_plan`)."""
        self._check(key)
        plan = self.part_plan(size_hint, writers)
        if self.exists(key):
            raise AlreadyExistsError(f"{self.describe(key)}: already exists")
        return _S3AppendWriter(self._upload_target(key), plan, size_hint)

    def _upload_target(self, key: str) -> UploadTarget:
        """What the append writer of the checked ``key`` needs of this store."""
        return UploadTarget(client=self._shared.client, bucket=self._shared.bucket, key=key, full_key=self._k(key),
                            where=self.describe(key), translate=lambda e: self._translate(e, key),
                            put=lambda data: self.put(key, data), delete=lambda: self.delete(key))

    def readinto(self, key: str, offset: int, out, on_piece=None) -> None:
        self._check(key)
        out = _byte_view(out)
        n = out.nbytes
        if n == 0:
            self.stat(key)  # a missing object is still an error
            return
        piece = self._shared.read_part_size
        if n <= piece or self._shared.max_concurrency <= 1:
            self._get_into(key, offset, out, on_piece)
            return
        # Large ranges: the caller's thread reads the first part (handing it to on_piece
        # block by block), the pool the others; on_piece then sees each part in order as
        # soon as it and all before it have arrived, while later parts still download.
        bounds = [(a, min(a + piece, n)) for a in range(0, n, piece)]
        pool = self._shared.pool()
        futures = [pool.submit(self._get_into, key, offset + a, out[a:b]) for a, b in bounds[1:]]
        error: BaseException | None = None
        try:
            self._get_into(key, offset, out[:bounds[0][1]], on_piece)
        except BaseException as e:
            error = e
        for (a, b), f in zip(bounds[1:], futures):
            if error is not None:
                f.cancel()
            try:
                f.result()
            except CancelledError:
                continue
            except BaseException as e:
                error = error or e
                continue
            if error is None and on_piece is not None:
                for c in range(a, b, _READ_BLOCK):
                    on_piece(out[c:min(b, c + _READ_BLOCK)])
        if error is not None:
            raise error

    def _get_into(self, key: str, offset: int, out: memoryview, on_piece=None) -> None:
        """One ranged GET into ``out``; re-requests the remainder when the body breaks."""
        where, n, full = self.describe(key), out.nbytes, self._k(key)
        pos, failures = 0, 0
        while pos < n:
            start = offset + pos
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{offset + n - 1}")
            except bexc.ClientError as e:
                code, _msg, status, _tries = _client_error(e)
                if code == "InvalidRange" or status == 416:
                    size = (e.response.get("Error") or {}).get("ActualObjectSize", "fewer")
                    raise TruncatedObjectError(f"{where}: short read, wanted {n} bytes at offset {offset}, "
                                               f"object holds {size} bytes") from e
                raise self._translate(e, key) from e
            except Exception as e:
                raise self._translate(e, key) from e
            body = resp["Body"]
            try:
                if "ContentRange" not in resp and start != 0:
                    raise StorageError(f"{where}: the server ignored the Range header")
                if resp["ContentLength"] < n - pos:
                    total = (resp.get("ContentRange") or "").rpartition("/")[2] or "fewer"
                    raise TruncatedObjectError(f"{where}: short read, wanted {n} bytes at offset {offset}, "
                                               f"object holds {total} bytes")
                # botocore retried the request; it cannot retry a body that breaks after
                # the response arrived (reset, stall past the read timeout). That is the
                # one loop of our own: re-request what is still missing, bounded.
                while pos < n:
                    block = out[pos:min(n, pos + _READ_BLOCK)]
                    got = 0
                    while got < len(block):
                        k = body.readinto(block[got:])
                        if not k:
                            raise bexc.IncompleteReadError(actual_bytes=pos + got, expected_bytes=n)
                        got += k
                    if on_piece is not None:
                        on_piece(block)  # whole blocks only: a retry never re-sends bytes
                    pos += got
            except _STREAM_ERRORS as e:
                failures += 1
                if failures >= self._shared.max_attempts:
                    _scrub_exception(e, self._shared.redact)
                    raise TransientStorageError(self._shared.redact(
                        f"{where}: reading {n} bytes at offset {offset} failed {failures} times "
                        f"mid-stream: {type(e).__name__}: {e}")) from e
                _backoff(failures)
            finally:
                body.close()

    def read(self, key: str, offset: int = 0, length: int | None = None, *, limit: int | None = None) -> bytes:
        if length is not None:
            buf = bytearray(length)
            self.readinto(key, offset, memoryview(buf))
            return bytes(buf)
        where, failures, full = self.describe(key), 0, self._k(key)
        # With a limit, one byte more than it is asked for: the answer's ContentRange
        # gives the object's size, so a too large one is refused in the same request.
        ranged = f"bytes={offset}-{offset + limit}" if limit is not None else (f"bytes={offset}-" if offset else None)
        extra = {"Range": ranged} if ranged else {}
        while True:  # one GET for the whole object (manifests, votes): no HEAD first
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=full, **extra)
            except bexc.ClientError as e:
                code, _msg, status, _tries = _client_error(e)
                if code == "InvalidRange" or status == 416:
                    size = int((e.response.get("Error") or {}).get("ActualObjectSize") or -1)
                    if size == offset:
                        return b""
                    raise TruncatedObjectError(f"{where}: short read at offset {offset}, object holds {size} bytes") from e
                raise self._translate(e, key) from e
            except Exception as e:
                raise self._translate(e, key) from e
            try:
                if limit is not None:
                    total = (resp.get("ContentRange") or "").rpartition("/")[2]
                    size = int(total) - offset if total.isdigit() else resp["ContentLength"]
                    _check_limit(self, key, size, limit)
                return resp["Body"].read()  # botocore checks the length it got
            except _STREAM_ERRORS as e:  # see _get_into
                failures += 1
                if failures >= self._shared.max_attempts:
                    _scrub_exception(e, self._shared.redact)
                    raise TransientStorageError(
                        self._shared.redact(f"{where}: reading failed {failures} times mid-stream: {e}")) from e
                _backoff(failures)
            finally:
                resp["Body"].close()

    def list(self, prefix: str = "") -> list[str]:
        base = self._dir(prefix)
        names: set[str] = set()
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/")
            for page in pages:
                for obj in page.get("Contents", ()):
                    name = obj["Key"][len(base):]
                    if name and self._listed(obj["Key"]) is not None:  # "": a console-made folder marker
                        names.add(name)
                for cp in page.get("CommonPrefixes", ()):
                    name = cp["Prefix"][len(base):]
                    if name.strip("/") and self._listed(cp["Prefix"][:-1]) is not None:
                        names.add(name)
        return sorted(names)

    def walk(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._dir(prefix)  # checked now, not at the first next()
        return self._walk(prefix, base)

    def _walk(self, prefix: str, base: str) -> Iterator[ObjectInfo]:
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = self._listed(obj["Key"])  # folder markers ("a/") included
                    if key is None:
                        continue
                    yield ObjectInfo(key, int(obj["Size"]), obj["LastModified"].timestamp())

    def stat(self, key: str) -> ObjectInfo:
        full = self._k(key)
        with self._errors(key):
            resp = self.client.head_object(Bucket=self.bucket, Key=full)
        return ObjectInfo(key, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def delete(self, key: str) -> None:
        full = self._k(key)
        with self._errors(key):
            try:
                self.client.delete_object(Bucket=self.bucket, Key=full)
            except bexc.ClientError as e:
                if _client_error(e)[0] not in _NOT_FOUND:
                    raise

    def delete_many(self, keys: Iterable[str]) -> None:
        """DeleteObjects of up to 1,000 keys each (every key checked before any request);
        per-key DeleteObject calls on a store that refuses those (below)."""
        self._delete_full_keys([self._k(k) for k in keys])

    def delete_prefix(self, prefix: str) -> None:
        """Every object under ``prefix``, in batched DeleteObjects (1,000 keys each)."""
        keys, base = [], self._dir(prefix)
        with self._errors(prefix):  # every key, folder markers and invalid names included
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
            for page in pages:
                keys += [obj["Key"] for obj in page.get("Contents", ())]
        self._delete_full_keys(keys)

    def _delete_full_keys(self, full_keys: list[str]) -> None:
        for i in range(0, len(full_keys), _DELETE_BATCH):
            batch = full_keys[i:i + _DELETE_BATCH]
            if self._shared.batch_deletes:
                self._delete_batch(batch)
            else:
                self._delete_each(batch)

    def _delete_batch(self, full_keys: list[str]) -> None:
        """One DeleteObjects. botocore >= 1.36 sends it with a CRC32 checksum instead of
        Content-MD5, which some stores (older MinIO releases) refuse: then per-key
        deletes, for this and every later batch of the store (the verdict is shared)."""
        where = f"s3://{self.bucket}/{full_keys[0]}"
        try:
            resp = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in full_keys], "Quiet": True})
        except bexc.ClientError as e:
            if not _wants_content_md5(e):
                raise self._translate_at(e, where) from e
            self._shared.batch_deletes = False
            self._delete_each(full_keys)
            return
        except Exception as e:
            raise self._translate_at(e, where) from e
        failed = [(e.get("Key"), f"{e.get('Code')}: {e.get('Message')}") for e in resp.get("Errors", ())
                  if e.get("Code") not in _NOT_FOUND]
        self._raise_delete_failures(failed)

    def _delete_each(self, full_keys: list[str]) -> None:
        """A DeleteObject per key, on the read pool; every key is tried."""
        def delete(full: str) -> tuple[str, str] | None:  # (key, why) when it failed
            try:
                self.client.delete_object(Bucket=self.bucket, Key=full)
            except bexc.ClientError as e:
                code, msg, status, _tries = _client_error(e)
                if code not in _NOT_FOUND:
                    return full, f"{code or status}: {msg}"
            except Exception as e:  # (after botocore's retries)
                _scrub_exception(e, self._shared.redact)
                return full, f"{type(e).__name__}: {e}"
            return None

        results = run_all(self._shared.pool(), [functools.partial(delete, k) for k in full_keys])
        self._raise_delete_failures([r for r in results if r is not None])

    def _raise_delete_failures(self, failed: list[tuple[str, str]]) -> None:
        if failed:
            key, why = failed[0]
            raise StorageError(self._shared.redact(
                f"s3://{self.bucket}/{key}: delete failed ({why}); {len(failed)} key(s) not deleted"))

    def _translate_at(self, e: BaseException, where: str) -> CkptStoreError:
        """As ``_translate``, for a full key (or a URL) rather than one of this root's keys."""
        if isinstance(e, CkptStoreError):
            return e
        _scrub_exception(e, self._shared.redact)
        err = translate(e, self._shared.redact(where), self.bucket, self._shared.max_attempts)
        if self._refuses_checksums(e):
            err.args = (f"{err.args[0]}; {CHECKSUM_HINT}", *err.args[1:])
        err.args = tuple(self._shared.redact(a) if isinstance(a, str) else a for a in err.args)
        return err

    def abort_stale_uploads(self, older_than: float, dry_run: bool = False) -> list[str]:
        """Abort multipart uploads under this root started ``older_than`` seconds ago or
        earlier (an upload whose writer died keeps its parts, and their cost, forever)."""
        cutoff = time.time() - older_than
        found = []
        with self._errors():
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._dir(""))
            for page in pages:
                for up in page.get("Uploads", ()):
                    if up["Initiated"].timestamp() > cutoff:
                        continue
                    found.append(self._rel(up["Key"]))
                    if dry_run:
                        continue
                    try:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    except bexc.ClientError as e:
                        if _client_error(e)[0] != "NoSuchUpload":  # someone else finished it
                            raise
        return found

    def is_dir(self) -> bool:
        """Whether anything lies under this root (the bucket root: whether it exists)."""
        with self._errors():
            resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._dir(""), MaxKeys=1)
        return not self.prefix or resp.get("KeyCount", 0) > 0

