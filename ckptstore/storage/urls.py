"""Paths and URLs: which store a location names, and how a location is shown.

Every place that opens a location (``open_storage``, hence ``save``, ``load``,
``Store``, the CLI) and every message that shows one goes through this module, so the
rule below and the redaction hold everywhere (docs/operations.md, "Paths and URLs").

The rule. A location is a **URL** when it starts with a scheme (a letter, then letters,
digits, ``+``, ``-`` or ``.``: two characters at least, as ``C:`` is a Windows drive)
and a colon, and either the scheme is one ckptstore knows (``s3``, ``file``,
``memory``) or a ``/`` follows the colon. Anything else is a **local path**, colons
included (``runs/exp:1``, ``ckpt:v1/model.pt``); a ``PathLike`` is always a path.

- Supported: ``s3://bucket/prefix``, ``file://PATH`` (``file:///abs/path``; the rest
  is the path) and ``memory://name/prefix`` (one process's in-memory store).
- Refused with :class:`~ckptstore.errors.InvalidURLError`, whose message names the
  supported forms: any other scheme (``gs://``, ``hdfs:/``, ``s4://``); a known scheme
  without its ``//`` or not in lower case (``s3:/bucket``, ``s3:bucket``, ``S3://``),
  with a suggestion (``did you mean s3://bucket?``); credentials in the URL
  (``s3://KEY:SECRET@bucket``, ``s3://KEY:wJal/K7MD@bucket`` where the secret holds a
  ``/``: boto3's configuration provides them); a query string or fragment in an
  ``s3://`` URL (a presigned URL is not a store); an ``s3://`` URL whose bucket (before
  the first ``/``) is no bucket name (:func:`valid_bucket`), not shown (``s3://***/...``).
- A local relative path whose first part is such a scheme (a directory named ``gs:``)
  is written with a leading ``./``: ``./gs:/x``.

Redaction: :func:`redact_url` removes the userinfo (``user:password@``, a password
holding ``/`` included: :func:`_userinfo_end` says where it ends) of every URL in a text and masks the values of query parameters that look like credentials
(``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``token``,
``sig``, ``password``, ...). Messages built here use :func:`shown`, which also covers
the malformed forms (``s3:KEY:SECRET@bucket``) that no URL pattern matches.
"""

from __future__ import annotations

import os
import re

from ..errors import InvalidURLError

__all__ = ["SCHEMES", "is_url", "parse_location", "redact_url", "scheme_of", "shown", "valid_bucket"]

# The schemes open_storage opens, with the form each takes.
SCHEMES = {"s3": "s3://bucket/prefix", "file": "file:///path", "memory": "memory://name/prefix (in-process)"}
SUPPORTED = ("Supported: " + ", ".join(SCHEMES.values()) + " or a local path (a relative path whose first "
             "directory ends in ':' is written ./NAME:/...)")

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]+):")
# A URL inside a text: scheme, one to three slashes, then up to whitespace or a quote;
# or s3: with no slash (s3:KEY:SECRET@bucket, a malformed form people paste).
_URL = re.compile(r"""[A-Za-z][A-Za-z0-9+.\-]*:/{1,3}[^\s'"<>]*|(?<![A-Za-z0-9+.\-])[sS]3:[^\s'"<>/]+[^\s'"<>]*""")
_HEAD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):(/*)")
# host:port (and [IPv6]:port): a colon in an authority that is no password.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]*\]|[^:\[\]]+)(:[0-9]{1,5})?")
# A query parameter whose name looks like a credential: its value is masked.
_SECRET_PARAM = re.compile(
    r"([?&;])([^=&;#?]*(?:signature|credential|token|secret|passw|pwd|sig|key|auth)[^=&;#?]*)=([^&;#]*)",
    re.IGNORECASE)
# What botocore itself accepts as a bucket name (an access-point ARN aside): AWS's rules
# for new buckets (3-63 of a-z 0-9 . -) are narrower, but legacy us-east-1 buckets and
# S3-compatible stores (MinIO, Ceph) use upper case and underscores: the server judges.
_BUCKET = re.compile(r"[A-Za-z0-9._\-]{1,255}")


def valid_bucket(name: str) -> bool:
    """Whether ``name`` can be an S3 bucket (botocore's own check, lenient on upper
    case, ``_`` and dots). A name with ``:`` or ``@`` (a credential) never is."""
    return _BUCKET.fullmatch(name) is not None


def _userinfo_end(scheme: str, body: str) -> int:
    """Where the userinfo of a URL ends (the index of its ``@`` in ``body``, what follows
    ``scheme:`` and its slashes), or -1 when it has none.

    - An ``@`` in the authority (before the first ``/``, ``?`` or ``#``): the userinfo
      runs to the authority's last ``@`` (an unencoded ``@`` in a password goes with it).
    - A ``:`` in the authority that is no ``host:port`` (any ``:`` for ``s3``: a bucket
      has no port), with an ``@`` later in ``body``: a password holding ``/`` (an AWS
      secret key is base64: half of them do), ``s3://KEY:wJal/K7MD@bucket/run``. The
      userinfo runs to the last ``@``: what the password holds cannot be told from a
      path, so more is removed rather than less. ``s3://bucket/model@v2`` (no ``:``)
      and ``http://minio:9000/bucket/model@v2`` (a port) keep their ``@``. Not for
      ``file:`` (what follows is a path: ``file://exp:1/model@v2``).
    """
    end = min((i for i in (body.find(c) for c in "/?#") if i >= 0), default=len(body))
    authority = body[:end]
    if "@" in authority:
        return authority.rindex("@")
    if ":" not in authority or "@" not in body or scheme.lower() == "file":
        return -1
    if scheme.lower() != "s3" and _HOST_PORT.fullmatch(authority):
        return -1
    return body.rindex("@")


def _mask_query(url: str) -> str:
    head, q, query = url.partition("?")
    if not q:
        return url
    return head + _SECRET_PARAM.sub(lambda p: f"{p.group(1)}{p.group(2)}=***", "?" + query)


def _redact_one(m: re.Match) -> str:
    url = m.group(0)
    h = _HEAD.match(url)
    body = url[h.end():]
    cut = _userinfo_end(h.group(1), body)
    # (userinfo already masked as "***@", by shown(), stays: it says where the secret was)
    if cut >= 0 and body[:cut] != "***":
        url = url[:h.end()] + body[cut + 1:]
    return _mask_query(url)


def redact_url(text: str) -> str:
    """``text`` with every URL in it (``scheme:/...`` or ``scheme://...``, up to
    whitespace or a quote) stripped of its userinfo (``user:password@``, a password
    holding ``/`` included: :func:`_userinfo_end`) and with credential-looking query
    values (``X-Amz-Signature=...``) replaced by ``***``; everything else is kept.
    Works on a bare URL and on a message that contains URLs; a path is left as it is."""
    return _URL.sub(_redact_one, text)


def scheme_of(location) -> str | None:
    """The scheme of ``location`` as written, when the rule makes it a URL; None for a
    local path (any ``PathLike`` included)."""
    if not isinstance(location, str):
        return None
    m = _SCHEME.match(location)
    if m is None:
        return None
    if m.group(1).lower() in SCHEMES or location[m.end():].startswith("/"):
        return m.group(1)
    return None


def is_url(location) -> bool:
    """Whether ``location`` is a URL (supported or not) rather than a local path."""
    return scheme_of(location) is not None


def shown(location) -> str:
    """``location`` as a message may show it: a path as it is; a URL with its userinfo
    as ``***@`` and credential-looking query values as ``***``, also in the forms
    :func:`redact_url` cannot recognise (``s3:KEY:SECRET@bucket``). An ``s3`` URL whose
    bucket is no bucket name (``s3://KEY:SECRET/x``: where a credential would end cannot
    be told) shows as ``s3://***`` and no more."""
    text = location if isinstance(location, str) else os.fspath(location)
    written = scheme_of(text)
    if written is None:
        return text
    rest = text[len(written) + 1:]
    slashes = len(rest) - len(rest.lstrip("/"))
    head, body = f"{written}:{rest[:slashes]}", rest[slashes:]
    cut = _userinfo_end(written, body)
    masked = "***@" if cut >= 0 else ""
    body = body[cut + 1:]
    if written.lower() == "s3":
        bucket = re.split(r"[/?#]", body, maxsplit=1)[0]
        if bucket and not valid_bucket(bucket):
            return f"{written}://{masked}***" + ("/..." if len(body) > len(bucket) else "")
    text = redact_url(_mask_query(head + body))
    return head + masked + text[len(head):]


def _suggest(scheme: str, rest: str) -> str:
    if scheme == "file":  # file:/abs -> file:///abs; file:rel -> file://rel
        return "file://" + ("/" if rest.startswith("/") else "") + rest.lstrip("/")
    return f"{scheme}://{rest.lstrip('/')}"


def parse_location(location) -> tuple[str | None, str]:
    """``(scheme, rest)`` of a supported URL (``rest``: what follows ``scheme://``), or
    ``(None, path)`` for a local path. Raises :class:`InvalidURLError` for a URL the
    rule refuses; its message shows no credential and names the supported forms."""
    written = scheme_of(location)
    if written is None:
        return None, location if isinstance(location, str) else os.fspath(location)
    scheme, rest = written.lower(), location[len(written) + 1:]
    where = shown(location)
    if scheme not in SCHEMES:
        hint = " (for Google Cloud Storage, use s3:// with its S3-compatible endpoint: docs/s3.md)" \
            if scheme == "gs" else ""
        raise InvalidURLError(f"{where}: unsupported URL scheme {written!r}{hint}. {SUPPORTED}")
    if written != scheme or not rest.startswith("//"):
        raise InvalidURLError(f"{where}: not a valid {scheme}:// URL; did you mean "
                              f"{redact_url(_suggest(scheme, rest))}? {SUPPORTED}")
    body = rest[2:]
    if _userinfo_end(scheme, body) >= 0 and (scheme == "s3" or "@" in body.partition("/")[0]):
        raise InvalidURLError(
            f"{where}: credentials do not belong in a URL (they would show in logs and process lists); "
            + ("boto3's configuration provides them: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
               "AWS_PROFILE, ~/.aws/credentials or an instance role (docs/s3.md)" if scheme == "s3"
               else f"write {scheme}:// without 'user@'"))
    if scheme == "s3" and ("?" in body or "#" in body):
        raise InvalidURLError(
            f"{where}: an s3:// URL takes no query string or fragment ('?', '#'): a presigned URL does not "
            "open a store; ckptstore signs its own requests with boto3's credentials (docs/s3.md)")
    bucket = body.partition("/")[0]
    if scheme == "s3" and bucket and not valid_bucket(bucket):  # (not shown: it may hold a credential)
        raise InvalidURLError(
            f"{where}: not a valid S3 bucket name before the first '/' (not shown: it may hold a credential); "
            "a bucket name has letters, digits, '.', '-' and '_' only, at most 255 of them: s3://bucket/prefix "
            "(credentials come from boto3's configuration, docs/s3.md)")
    return scheme, body
