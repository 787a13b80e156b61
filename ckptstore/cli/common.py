"""What every ``ckptstore`` command shares: the exit codes, ``_fail`` (one line on stderr,
redacted and escaped), opening a store, JSON output, tables and progress bars.

Exit codes: 0 success (verify: everything sound); 1 verify found a problem, ls or
verify found no committed checkpoint at the URL, or a command failed on the store; 2
usage error, a URL that names no store ckptstore opens, or an unreachable store.
Expected errors print one line on stderr, never a traceback, and never a credential
(``_fail`` redacts every message: storage/urls.py). ``--json`` prints one JSON
document on stdout.
"""

from __future__ import annotations

import json
import os
import sys

import click

from .._terminal import printable as _printable
from ..errors import CkptStoreError, InvalidURLError
from ..storage import Storage, is_url, open_storage
from ..storage.urls import redact_url, shown

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

def _fail(message: str, code: int) -> None:
    """One line on stderr, without credentials (whatever URL the message holds) or
    control characters, and exit with ``code``."""
    click.echo(f"ckptstore: {_printable(redact_url(message))}", err=True)
    sys.exit(code)

def _open(url: str, containers: bool = True) -> Storage:
    """The store at ``url``. A local file holding a single-file container (what
    ``ckptstore.save`` writes over an existing plain file) opens as a read-only
    in-memory store that ls and verify read like any checkpoint; gc has nothing to
    collect in one (``containers=False``: a usage error)."""
    if not is_url(url) and os.path.isfile(url):
        return _open_container(url, containers)
    try:
        storage = open_storage(url)
        storage.list("")
    except InvalidURLError as e:  # names the URL and the supported forms itself
        _fail(str(e), EXIT_USAGE)
    except (CkptStoreError, ValueError, OSError) as e:
        _fail(f"cannot open {shown(url)}: {e}", EXIT_USAGE)
    if not storage.is_dir():
        _fail(f"cannot open {shown(url)}: no such directory", EXIT_USAGE)
    return storage

def _exists(url: str) -> bool:
    """Whether a destination path or URL holds anything (a URL ckptstore cannot open:
    a usage error)."""
    if not is_url(url):
        return os.path.lexists(url)
    try:
        return bool(open_storage(url).list(""))
    except InvalidURLError as e:
        _fail(str(e), EXIT_USAGE)
    except (CkptStoreError, OSError) as e:
        _fail(f"cannot open {shown(url)}: {e}", EXIT_USAGE)

def _open_container(path: str, allowed: bool) -> Storage:
    from ..checkpoint.container import read_container_file

    if not allowed:
        _fail(f"{path}: a file (a single-file checkpoint holds nothing for gc to collect)", EXIT_USAGE)
    try:
        storage = read_container_file(path)
    except (CkptStoreError, OSError) as e:
        _fail(f"cannot open {path}: {e}", EXIT_PROBLEM if isinstance(e, CkptStoreError) else EXIT_USAGE)
    if storage is None:
        _fail(f"cannot open {path}: a file that is not a ckptstore container "
              "(a torch.save file? ckptstore.load reads those)", EXIT_USAGE)
    return storage

def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)

def _table(headers: list[str], rows: list[list[str]]) -> str:
    rows = [[_printable(c) for c in r] for r in rows]  # names and metrics come from the store
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)

def _print_json(obj) -> None:
    """The one JSON document ``--json`` prints on stdout."""
    click.echo(json.dumps(obj, indent=2))

def _progress(total: int, label: str, quiet: bool):
    """A progress bar over ``total`` (bytes, or items) with its ETA on a terminal's
    stderr (click's); hidden when stderr is not a terminal or the output is JSON."""
    return click.progressbar(length=max(total, 1), label=label, file=sys.stderr,
                             hidden=quiet or not sys.stderr.isatty(), show_eta=True, show_percent=True)
