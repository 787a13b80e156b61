"""S3 test helpers: a moto server over real HTTP, and a fault-injecting HTTP proxy.

* :func:`moto_endpoint` starts (once per process) ``moto.server.ThreadedMotoServer`` on
  127.0.0.1 and a free port, and returns its URL.
* :func:`aws_env` is the environment that points boto3's standard configuration at it
  (``AWS_ENDPOINT_URL``, dummy credentials, no profile files), for this process or a
  subprocess.
* :func:`s3_storage_factory` is the ``(request, tmp_path) -> Storage`` factory for
  ``tests/conftest.py``'s ``STORAGE_BACKENDS``: a fresh bucket on the moto server, an
  :class:`~ckptstore.storage.s3.S3Storage` under a prefix in it, emptied afterwards.
* :class:`FaultProxy` sits between boto3 and moto, forwards every request and, at
  seeded rates, answers 503 SlowDown or 500 InternalError, resets the connection,
  stalls past the client's read timeout (before or after forwarding, so a fault may
  hide a write that happened), cuts a response body short, or denies access. It logs
  every request (operation, botocore attempt number, range, bytes, status, headers) and
  can hold chosen operations until released, so tests synchronise on what the wire saw.
  ``FaultProxy(endpoint, tls=self_signed_cert(dir))`` speaks HTTPS to boto3 (and plain
  HTTP to moto), so tests see what botocore sends over TLS only (checksum trailers).

Run as a script (``python tests/s3util.py race ...``) it is one side of the two-process
commit race in ``tests/test_s3.py``.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import select
import socket
import struct
import sys
import threading
import urllib.parse
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

MiB = 1 << 20

# ---------------------------------------------------------------------------- moto server
_server = None
_server_url: str | None = None
_server_lock = threading.Lock()
_admin: dict[str, object] = {}


def moto_endpoint() -> str:
    """URL of this process's moto server (started on first call, a daemon thread)."""
    global _server, _server_url
    with _server_lock:
        if _server_url is None:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            _server, _server_url = server, f"http://{host}:{port}"
        return _server_url


def aws_env(endpoint: str) -> dict[str, str]:
    """Variables that point boto3's standard configuration at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


# Variables from the caller's environment that would steer boto3 elsewhere.
UNSET_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_ROLE_ARN",
             "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CA_BUNDLE")


def point_boto3_at(endpoint: str, monkeypatch) -> dict[str, str]:
    """This process's boto3 standard configuration (environment) points at ``endpoint``
    for the test (monkeypatch undoes it); returns the variables set."""
    for k in UNSET_ENV:
        monkeypatch.delenv(k, raising=False)
    env = aws_env(endpoint)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def subprocess_env(endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET_ENV}
    env.update(aws_env(endpoint))
    env.update(extra)
    return env


def admin_client(endpoint: str | None = None):
    """A plain boto3 client on the moto server, for setting up and inspecting buckets."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint or moto_endpoint()
    with _server_lock:
        if endpoint not in _admin:
            _admin[endpoint] = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                aws_secret_access_key="testing",
                config=Config(retries={"mode": "standard", "total_max_attempts": 3}, max_pool_connections=16))
        return _admin[endpoint]


def new_bucket(endpoint: str | None = None) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:16]}"
    admin_client(endpoint).create_bucket(Bucket=name)
    return name


def empty_bucket(bucket: str, endpoint: str | None = None, delete: bool = True) -> None:
    client = admin_client(endpoint)
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for up in page.get("Uploads", ()):
            client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    if delete:
        client.delete_bucket(Bucket=bucket)


def s3_storage(bucket: str, prefix: str = "store", endpoint: str | None = None, *, use_env: bool = False,
               verify: str | None = None, **options):
    """An S3Storage on the moto server (or on ``endpoint``, e.g. a proxy) with small parts
    and few attempts, so tests stay fast.

    By default it gets a client with explicit test credentials, so it does not depend on
    the process environment; ``use_env=True`` builds it from boto3's standard
    configuration instead (the caller has set :func:`aws_env`). Its create-only puts
    trust the server's If-None-Match (``conditional_writes="trust"``: moto honours it),
    so tests that count requests see no probe; tests/test_s3_conditional.py covers the
    probe. ``verify``: the CA bundle for an HTTPS endpoint (a :class:`FaultProxy` with
    ``tls``); ``checksums`` goes into the client's Config, as S3Storage would put it."""
    import boto3
    from botocore.config import Config

    from ckptstore.storage.s3 import S3Storage

    opts = {"part_size": 5 * MiB, "read_part_size": 5 * MiB, "max_concurrency": 4, "max_attempts": 3,
            "connect_timeout": 5.0, "read_timeout": 30.0, "conditional_writes": "trust", **options}
    from ckptstore.storage.s3.client import check_checksums, checksum_config

    endpoint = endpoint or moto_endpoint()
    if use_env:
        return S3Storage(bucket, prefix, endpoint_url=endpoint, **opts)
    retries = {"mode": opts.pop("retry_mode", "standard"), "total_max_attempts": opts.pop("max_attempts")}
    config = Config(retries=retries, connect_timeout=opts.pop("connect_timeout"),
                    read_timeout=opts.pop("read_timeout"), max_pool_connections=32,
                    **checksum_config(check_checksums(opts.pop("checksums", None))))
    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
        aws_secret_access_key="testing", config=config, verify=verify)
    return S3Storage(bucket, prefix, client=client, **opts)


def s3_storage_factory(request, tmp_path):
    """``tests/conftest.py`` hook: ``STORAGE_BACKENDS["s3"] = s3util.s3_storage_factory``."""
    import pytest

    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        pytest.skip(f"S3 backend tests need boto3 and moto[server]: {e}")
    endpoint = moto_endpoint()
    bucket = new_bucket(endpoint)
    request.addfinalizer(lambda: empty_bucket(bucket, endpoint))
    return s3_storage(bucket, "store", endpoint)


# ---------------------------------------------------------------------------- TLS
def self_signed_cert(directory) -> tuple[str, str]:
    """(certificate path, key path): a fresh self-signed certificate for 127.0.0.1 and
    localhost, valid for a day; the certificate is its own CA bundle (boto3 ``verify=``,
    ``AWS_CA_BUNDLE``)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ckptstore test proxy")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(directory, "proxy-cert.pem"), os.path.join(directory, "proxy-key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


class _TLSServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer whose connections are TLS, the handshake made on each
    connection's own thread (a client that never finishes one blocks nobody else)."""

    ssl_context = None

    def finish_request(self, request, client_address):
        try:
            request = self.ssl_context.wrap_socket(request, server_side=True)
        except OSError:  # a failed handshake: nothing to answer
            return
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address):  # quiet: clients that reset are tests' business
        pass


# ---------------------------------------------------------------------------- fault proxy
FAULTS = ("slowdown", "error500", "reset", "stall", "truncate", "deny")
_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
        "trailers", "transfer-encoding", "upgrade", "expect"}


@dataclass
class Request:
    op: str
    method: str
    path: str
    query: str
    attempt: int  # botocore's attempt number (amz-sdk-request header), 1 = first try
    range: str | None
    sent: int  # request body bytes
    status: int | None  # what the client got; None: reset or stalled
    fault: str | None  # "slowdown", "reset-after", ...
    received: int = 0  # response body bytes delivered
    headers: dict = field(default_factory=dict)  # the request's headers, names in lower case

    @property
    def part_number(self) -> int | None:
        q = urllib.parse.parse_qs(self.query)
        return int(q["partNumber"][0]) if "partNumber" in q else None

    @property
    def byte_range(self) -> tuple[int, int] | None:
        """The requested (first, last) byte, both inclusive; None without a Range."""
        if not self.range:
            return None
        first, _, last = self.range.partition("=")[2].partition("-")
        return int(first), int(last) if last else -1

    @property
    def key(self) -> str:
        return urllib.parse.unquote(self.path.split("?", 1)[0].lstrip("/").partition("/")[2])


def operation(method: str, path: str, query: str) -> str:
    """The S3 operation a request is, from its method, path and query (enough for tests)."""
    q = urllib.parse.parse_qs(query, keep_blank_values=True)
    has_key = bool(path.split("?", 1)[0].lstrip("/").partition("/")[2])
    if method == "PUT":
        if "partNumber" in q:
            return "UploadPart"
        return "PutObject" if has_key else "CreateBucket"
    if method == "POST":
        if "uploads" in q:
            return "CreateMultipartUpload"
        if "uploadId" in q:
            return "CompleteMultipartUpload"
        if "delete" in q:
            return "DeleteObjects"
        return "Post"
    if method == "DELETE":
        if "uploadId" in q:
            return "AbortMultipartUpload"
        return "DeleteObject" if has_key else "DeleteBucket"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "GET":
        if has_key:
            return "GetObject"
        if "uploads" in q:
            return "ListMultipartUploads"
        return "ListObjectsV2" if "list-type" in q else "ListObjects"
    return method


def _error_xml(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>fault-proxy</RequestId></Error>").encode()


_CANNED = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
}


class FaultProxy:
    """A threaded HTTP proxy in front of an S3 endpoint that injects faults.

    ``configure(seed=, slowdown=, error500=, reset=, stall=, truncate=, deny=, ops=)`` sets
    the probability of each fault per request (``ops``: only these operations are
    faulted). ``script(*faults)`` queues faults for the next matching requests, e.g.
    ``script(("GetObject", "truncate"))`` or ``script(("PutObject", "canned:409:Code"))``
    (``canned:STATUS:CODE[:MESSAGE]``). ``answer(when, fault)`` answers every request for
    which ``when(request)`` holds with ``fault`` until ``reset()`` (e.g. ``lambda r:
    "x-amz-trailer" in r.headers``: a store that refuses checksum trailers). ``hold(ops)``
    makes matching requests wait (forwarded only after ``release()``). ``tls=(cert,
    key)``: boto3 talks HTTPS to it (:func:`self_signed_cert`). Faults that take a "-before"/"-after" phase:
    error500, reset and stall act before forwarding or after moto already executed the
    request (so its effect happened but the client never hears of it).
    """

    def __init__(self, upstream: str, seed: int = 0, tls: tuple[str, str] | None = None):
        u = urllib.parse.urlsplit(upstream)
        self._upstream = (u.hostname, u.port)
        self._lock = threading.Condition()
        self._rng = random.Random(seed)
        self._rates: dict[str, float] = {}
        self._ops: set[str] | None = None
        self._script: list[tuple[str, str]] = []
        self._answers: list[tuple] = []  # (when(request), fault): standing answers
        self._held_ops: set[str] = set()
        self._gate = threading.Event()
        self._gate.set()
        self.held = 0
        self.deny_code = ("AccessDenied", "Access Denied")
        self.strip_headers: set[str] = set()  # dropped before forwarding (lower case): a store that ignores them
        self.log: list[Request] = []
        self._closing = threading.Event()
        proxy = self

        class Handler(_Handler):
            pass

        Handler.proxy = proxy
        if tls is None:
            self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        else:
            import ssl

            self._httpd = _TLSServer(("127.0.0.1", 0), Handler)
            self._httpd.ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._httpd.ssl_context.load_cert_chain(*tls)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self._httpd.server_address[1]}"

    # -- control
    def configure(self, seed: int | None = None, ops=None, **rates: float) -> "FaultProxy":
        unknown = set(rates) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        with self._lock:
            if seed is not None:
                self._rng = random.Random(seed)
            self._rates = {k: float(v) for k, v in rates.items() if v}
            self._ops = set(ops) if ops else None
        return self

    def script(self, *faults: tuple) -> None:
        """Queue faults: ``(op, fault)`` hits the next request of ``op``; ``(op, fault,
        when)`` the next one for which ``when(proxy)`` holds (e.g. once the log shows a
        manifest was written). Called with the proxy's lock held: read ``proxy.log``."""
        with self._lock:
            self._script.extend(faults)

    def answer(self, when, fault: str) -> None:
        """Answer every request for which ``when(request)`` holds with ``fault`` (until
        :meth:`reset`)."""
        with self._lock:
            self._answers.append((when, fault))

    def hold(self, *ops: str) -> None:
        with self._lock:
            self._held_ops = set(ops)
            self._gate.clear()

    def release(self) -> None:
        with self._lock:
            self._held_ops = set()
            self._gate.set()

    def clear(self) -> None:
        with self._lock:
            self.log = []

    def reset(self) -> None:
        """Back to a plain proxy: no log, faults, scripts, answers or stripped headers."""
        self.release()
        with self._lock:
            self.log, self._script, self._answers, self._rates, self._ops = [], [], [], {}, None
            self.strip_headers = set()

    def requests(self, op: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if op is None or r.op == op]

    def wait_for(self, predicate, timeout: float = 60.0) -> bool:
        """Wait until ``predicate(proxy)`` holds (re-checked at every request event)."""
        with self._lock:
            return self._lock.wait_for(lambda: predicate(self), timeout)

    def close(self) -> None:
        self._closing.set()
        self.release()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- used by the handler
    def _decide(self, req: Request) -> str | None:
        op = req.op
        with self._lock:
            for when, fault in self._answers:
                if when(req):
                    return fault
            for i, entry in enumerate(self._script):
                sop, fault = entry[0], entry[1]
                if sop == op and (len(entry) < 3 or entry[2](self)):
                    del self._script[i]
                    return fault
            if self._ops is not None and op not in self._ops:
                return None
            x = self._rng.random()
            phase = self._rng.random() < 0.5
            for name in FAULTS:
                p = self._rates.get(name, 0.0)
                if x < p:
                    if name in ("error500", "reset", "stall"):
                        return f"{name}-{'after' if phase else 'before'}"
                    return name
                x -= p
            return None

    def _record(self, req: Request) -> None:
        with self._lock:
            self.log.append(req)
            self._lock.notify_all()

    def _wait_gate(self, op: str) -> None:
        with self._lock:
            if op not in self._held_ops:
                return
            self.held += 1
            self._lock.notify_all()
        self._gate.wait()
        with self._lock:
            self.held -= 1
            self._lock.notify_all()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self):
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass

    def _read_body(self) -> tuple[bytes, int]:
        """(the body, without HTTP chunked framing; the payload's size). An aws-chunked
        body (botocore's checksum trailers) keeps its own framing, which the server
        decodes: its payload is ``x-amz-decoded-content-length``."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                out += self.rfile.read(size)
                self.rfile.readline()
            body = bytes(out)
        else:
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
        decoded = self.headers.get("x-amz-decoded-content-length")
        return body, int(decoded) if decoded else len(body)

    def _handle(self) -> None:
        proxy = self.proxy
        body, payload = self._read_body()
        path, _, query = self.path.partition("?")
        op = operation(self.command, path, query)
        attempt_hdr = self.headers.get("amz-sdk-request", "")
        try:
            attempt = int(attempt_hdr.split(";")[0].split("=")[1])
        except (IndexError, ValueError):
            attempt = 0
        req = Request(op, self.command, path, query, attempt, self.headers.get("Range"), payload, None, None,
                      headers={k.lower(): v for k, v in self.headers.items()})
        fault = proxy._decide(req)
        req.fault = fault
        if fault == "deny":
            code, msg = proxy.deny_code
            return self._canned(req, 403, code, msg)
        if fault and fault.startswith("canned:"):  # e.g. "canned:409:ConditionalRequestConflict[:message]"
            _, status, code, *message = fault.split(":", 3)
            return self._canned(req, int(status), code, message[0] if message else code)
        if fault in _CANNED:
            return self._canned(req, *_CANNED[fault])
        if fault == "error500-before":
            return self._canned(req, *_CANNED["error500"])
        if fault == "reset-before":
            return self._reset(req)
        if fault == "stall-before":
            return self._stall(req)
        proxy._wait_gate(op)
        try:
            status, reason, headers, data = self._forward(body)
        except OSError:
            return self._reset(req)
        if fault == "error500-after":
            return self._canned(req, *_CANNED["error500"])
        if fault == "reset-after":
            return self._reset(req)
        if fault == "stall-after":
            return self._stall(req)
        if fault == "truncate" and self.command == "GET" and len(data) >= 2:
            req.received = len(data) // 2
            self._send(status, reason, headers, data[: len(data) // 2], length=len(data))
            return self._reset(req)
        req.status, req.received = status, len(data)
        proxy._record(req)  # before the client can see the response
        self._send(status, reason, headers, data)

    def _forward(self, body: bytes):
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in _HOP and k.lower() not in self.proxy.strip_headers}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        for tries in range(3):  # moto closes connections after a response: fresh ones
            conn = http.client.HTTPConnection(*self.proxy._upstream, timeout=120)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            except (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError):
                if tries == 2:
                    raise
            finally:
                conn.close()

    def _send(self, status, reason, headers, data: bytes, length: int | None = None) -> None:
        self.send_response_only(status, reason)
        upstream_length = None
        for k, v in headers:
            lk = k.lower()
            if lk == "content-length":
                upstream_length = v
            elif lk not in _HOP:
                self.send_header(k, v)
        if self.command == "HEAD":
            self.send_header("Content-Length", upstream_length or "0")
        else:
            self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and data:
            self.wfile.write(data)
        self.wfile.flush()

    def _canned(self, req: Request, status: int, code: str, message: str) -> None:
        body = _error_xml(code, message)
        req.status = status
        self.proxy._record(req)
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def _reset(self, req: Request) -> None:
        """Close with RST (SO_LINGER 0): the client sees a connection reset."""
        self.proxy._record(req)
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass
        self.close_connection = True

    def _stall(self, req: Request) -> None:
        """Answer nothing until the client gives up (closes the connection)."""
        self.proxy._record(req)
        sock = self.connection
        while not self.proxy._closing.is_set():
            ready, _, _ = select.select([sock], [], [], 0.05)
            if ready:
                try:
                    if not sock.recv(65536):
                        break
                except OSError:
                    break
        try:
            self.connection.close()
        except OSError:
            pass
        self.close_connection = True


# ---------------------------------------------------------------------------- race helper
def _race_main(argv: list[str]) -> int:
    """``race BUCKET PREFIX ROUNDS NAME``: for each round, wait for "go KEY" on stdin, try
    a create-only put of KEY, print "won KEY" or "lost KEY". Then "save URL" lines:
    ckptstore.save a state tagged NAME to URL, print "committed GEN" or "conflict"."""
    from ckptstore.errors import AlreadyExistsError, CommitConflictError
    from ckptstore.storage import open_storage

    bucket, prefix, name = argv[0], argv[1], argv[2]
    storage = open_storage(f"s3://{bucket}/{prefix}")
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "go":
            try:
                storage.put(arg, f"{name}:{arg}".encode(), if_absent=True)
                print(f"won {arg}", flush=True)
            except AlreadyExistsError:
                print(f"lost {arg}", flush=True)
        elif cmd == "save":
            import torch

            import ckptstore

            try:
                m = ckptstore.save({"who": name, "t": torch.full((4,), float(len(name)))}, arg).result()
                print(f"committed {m.generation}", flush=True)
            except CommitConflictError:
                print("conflict", flush=True)
        elif cmd == "quit":
            break
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "race":
        sys.exit(_race_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} race BUCKET PREFIX NAME")


# ---------------------------------------------------------------------------- fixtures
# A test module uses them by importing them: ``from s3util import bucket, endpoint, proxy``.
@pytest.fixture(scope="session")
def endpoint():
    return moto_endpoint()


@pytest.fixture
def bucket(endpoint):
    name = new_bucket(endpoint)
    yield name
    empty_bucket(name, endpoint)


@pytest.fixture
def proxy(endpoint):
    with FaultProxy(endpoint) as p:
        yield p
