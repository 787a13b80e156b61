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
  (``s3://KEY:SECRET@bucket``: boto3's configuration provides them); a query string or
  fragment in an ``s3://`` URL (a presigned URL is not a store).
- A local relative path whose first part is such a scheme (a directory named ``gs:``)
  is written with a leading ``./``: ``./gs:/x``.

Redaction: :func:`redact_url` removes the userinfo (``user:password@``) of every URL
in a text and masks the values of query parameters that look like credentials
(``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``token``,
``sig``, ``password``, ...). Messages built here use :func:`shown`, which also covers
the malformed forms (``s3:KEY:SECRET@bucket``) that no URL pattern matches.
"""

from __future__ import annotations

import os
import re

from ..errors import InvalidURLError

__all__ = ["SCHEMES", "is_url", "parse_location", "redact_url", "scheme_of", "shown"]

# The schemes open_storage opens, with the form each takes.
SCHEMES = {"s3": "s3://bucket/prefix", "file": "file:///path", "memory": "memory://name/prefix (in-process)"}
SUPPORTED = ("Supported: " + ", ".join(SCHEMES.values()) + " or a local path (a relative path whose first "
             "directory ends in ':' is written ./NAME:/...)")

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]+):")
# A URL inside a text: scheme, one to three slashes, then up to whitespace or a quote.
_URL = re.compile(r"""[A-Za-z][A-Za-z0-9+.\-]*:/{1,3}[^\s'"<>]*""")
# scheme:// or scheme:/ then userinfo: it runs to the last '@' before the host's end (a
# '/', '?', '#'), so an unencoded '@' in a password is removed with it.
_USERINFO = re.compile(r"""([A-Za-z][A-Za-z0-9+.\-]*:/{1,2})([^/?#]*)@""")
# A query parameter whose name looks like a credential: its value is masked.
_SECRET_PARAM = re.compile(
    r"([?&;])([^=&;#?]*(?:signature|credential|token|secret|passw|pwd|sig|key|auth)[^=&;#?]*)=([^&;#]*)",
    re.IGNORECASE)


def _mask_query(url: str) -> str:
    head, q, query = url.partition("?")
    if not q:
        return url
    return head + _SECRET_PARAM.sub(lambda p: f"{p.group(1)}{p.group(2)}=***", "?" + query)


def _redact_one(m: re.Match) -> str:
    # (userinfo already masked as "***@", by shown(), stays: it says where the secret was)
    url = _USERINFO.sub(lambda u: u.group(0) if u.group(2) == "***" else u.group(1), m.group(0), count=1)
    return _mask_query(url)


def redact_url(text: str) -> str:
    """``text`` with every URL in it (``scheme:/...`` or ``scheme://...``) stripped of
    its userinfo (``user:password@``) and with credential-looking query values
    (``X-Amz-Signature=...``) replaced by ``***``; everything else is kept. Works on a
    bare URL and on a message that contains URLs; a path is left as it is."""
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
    :func:`redact_url` cannot recognise (``s3:KEY:SECRET@bucket``)."""
    text = location if isinstance(location, str) else os.fspath(location)
    written = scheme_of(text)
    if written is None:
        return text
    rest = text[len(written) + 1:]
    slashes = len(rest) - len(rest.lstrip("/"))
    end = min((i for i in (rest.find(c, slashes) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[slashes:end]
    head = f"{written}:{rest[:slashes]}"
    text = redact_url(_mask_query(head + authority.rpartition("@")[2] + rest[end:]))
    return head + "***@" + text[len(head):] if "@" in authority else text


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
    if "@" in body.partition("/")[0]:
        raise InvalidURLError(
            f"{where}: credentials do not belong in a URL (they would show in logs and process lists); "
            + ("boto3's configuration provides them: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
               "AWS_PROFILE, ~/.aws/credentials or an instance role (docs/s3.md)" if scheme == "s3"
               else f"write {scheme}:// without 'user@'"))
    if scheme == "s3" and ("?" in body or "#" in body):
        raise InvalidURLError(
            f"{where}: an s3:// URL takes no query string or fragment ('?', '#'): a presigned URL does not "
            "open a store; ckptstore signs its own requests with boto3's credentials (docs/s3.md)")
    return scheme, body
