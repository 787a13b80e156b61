"""The ``ckptstore`` command: ls, verify, gc, doctor.

Exit codes: 0 success (verify: everything sound); 1 verify found a problem, ls or
verify found no committed checkpoint at the URL, or a command failed on the store; 2
usage error, a URL that names no store ckptstore opens, or an unreachable store.
Expected errors print one line on stderr, never a traceback, and never a credential
(``_fail`` redacts every message: storage/urls.py). ``--json`` prints one JSON
document on stdout.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time

import click

from .._terminal import printable as _printable
from .._version import __version__
from ..checkpoint import gc as gc_mod
from ..checkpoint import nearby
from ..checkpoint.catalog import Location, check_skip_mark, is_location, scan_location, scan_store
from ..checkpoint.retention import KeepBest, Retention, parse_duration
from ..checkpoint.verify import Problem, verify_manifest
from ..errors import CkptStoreError, InvalidURLError, NotACheckpointError
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


def _nothing_here(url: str) -> str:
    """Why ``url`` gave ls or verify no committed checkpoint (both exit 1 then), and
    where the checkpoints are when they lie a level or two below it
    (checkpoint/nearby.py: bounded work)."""
    where = shown(url)
    text = f"{where}: no committed checkpoint here"
    try:
        storage = open_storage(url)
        if _locations(storage):  # what is there holds attempts only
            text += " (only save attempts that never committed: `ckptstore ls --all` shows them)"
        found = nearby.search(storage)
    except (CkptStoreError, OSError):
        return text
    return f"{text}; {nearby.below_message(where, found)}" if found.below() else text


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


def _locations(storage: Storage) -> list[Location]:
    """The URL itself when it is a checkpoint, else the checkpoints below it."""
    if is_location(storage):
        return [scan_location(storage, "")]
    return scan_store(storage)


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptstore")
def main() -> None:
    """Inspect, verify and clean up ckptstore checkpoints (local paths or URLs)."""


# ---------------------------------------------------------------------------- ls
def _ls_record(loc: Location, now: float) -> dict:
    m = loc.manifest
    rec = {
        "name": loc.name or ".",
        "url": loc.storage.describe(),
        "committed": m is not None,
        "step": loc.step,
        "generation": m.generation if m else None,
        "committed_at": m.committed_at if m else None,
        "world_size": m.world_size if m else None,
        "bytes": m.stored_bytes if m else 0,
        "raw_bytes": m.raw_bytes if m else 0,
        # incremental saves: what this checkpoint wrote, and what it reads from other steps
        "referenced_bytes": m.referenced_bytes if m else 0,
        "metrics": dict(m.metrics) if m else {},
        "pinned": loc.pinned,
    }
    rec["new_bytes"] = rec["bytes"] - rec["referenced_bytes"]
    mark, ignored = check_skip_mark(loc)
    if mark is not None:  # a resume could not use this checkpoint: say why
        rec["skipped_by_resume"] = {"reason": str(mark.get("reason", "(no reason given)"))[:4096],
                                    "at": str(mark.get("at", ""))[:64]}
    elif ignored is not None:  # a mark not bound to this manifest: stale or forged, not acted on
        rec["skip_mark"] = ignored
    if loc.manifest_error:
        rec["error"] = loc.manifest_error
    if loc.foreign:
        rec["foreign"] = loc.foreign
    return rec


@main.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (a list of objects).")
@click.option("--all", "show_all", is_flag=True, help="Also list uncommitted attempts.")
@click.option("--local", "local", metavar="PATH",
              help="The local tier of a two-tier store whose durable tier is URL: list both, with the tiers "
                   "holding each step.")
def ls(url: str, as_json: bool, show_all: bool, local: str | None) -> None:
    """List the committed checkpoints at URL, oldest first.

    None at all is exit 1, as for verify, naming the checkpoints a level or two below
    URL when there are some.
    """
    records = _ls_records(url, show_all)
    if local is not None:
        gone = not is_url(local) and not os.path.exists(local)  # the node holding it was lost: none
        records = _merge_tiers({"durable": records, "local": [] if gone else _ls_records(local, show_all)})
    nothing = not any(r["committed"] or r.get("error") for r in records)
    if as_json:
        click.echo(json.dumps(records, indent=2))
        if nothing:
            _fail(_nothing_here(url), EXIT_PROBLEM)
        return
    rows = []
    for r in records:
        metrics = ", ".join(f"{k}={v}" for k, v in r["metrics"].items())
        rows.append([r["name"], "" if r["step"] is None else str(r["step"]),
                     ("UNREADABLE" if r.get("error") else (r["committed_at"] or "uncommitted")[:19].replace("T", " ")),
                     "" if r["world_size"] is None else str(r["world_size"]),
                     _human_bytes(r["bytes"]), _human_bytes(r["raw_bytes"]),
                     *([",".join(r["tiers"])] if local is not None else []),
                     (f"new {_human_bytes(r['new_bytes'])}, referenced {_human_bytes(r['referenced_bytes'])} "
                      if r["referenced_bytes"] else "")
                     + ("pinned " if r["pinned"] else "") + metrics
                     + (f" SKIPPED BY RESUME: {_printable(r['skipped_by_resume']['reason'])}"
                        if "skipped_by_resume" in r else "")
                     + (f" skip mark {r['skip_mark']}" if "skip_mark" in r else "")
                     + (f"UNREADABLE MANIFEST: {r['error']}" if r.get("error") else "")])
        for a in r.get("attempts", []):
            if not a["committed"]:
                state = f"read by {', '.join(a['read_by'])}" if a["read_by"] else \
                    f"released, idle {a['age_s']:.0f}s" if a["released"] else f"uncommitted, age {a['age_s']:.0f}s"
                rows.append([f"  {a['attempt']}", "", state,
                             f"voted {a['voted']}", _human_bytes(a["bytes"]), "",
                             *([""] if local is not None else []), "aborted" if a["aborted"] else ""])
    tiers = ["TIERS"] if local is not None else []
    if rows:
        click.echo(_table(["NAME", "STEP", "COMMITTED (UTC)", "RANKS", "STORED", "RAW", *tiers, "NOTES"], rows))
    if nothing:  # as verify: exit 1, saying where the checkpoints are when they lie deeper
        _fail(_nothing_here(url), EXIT_PROBLEM)


def _ls_records(url: str, show_all: bool) -> list[dict]:
    storage = _open(url)
    now = time.time()
    try:
        locations = _locations(storage)
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    records = []
    readers = _readers(locations) if show_all else {}
    for loc in locations:
        if loc.committed or loc.manifest_error or show_all:
            rec = _ls_record(loc, now)
            if show_all:
                rec["attempts"] = _attempt_records(loc, now, readers)
            records.append(rec)
    return records


def _readers(locations: list[Location]) -> dict[tuple[str, str], list[str]]:
    """{(location, attempt): the checkpoints whose manifests read its files}: incremental
    saves keep a dropped checkpoint's data while a newer one references it."""
    from ..checkpoint.gc import attempts_named, references_of

    out: dict[tuple[str, str], list[str]] = {}
    for loc in locations:
        if loc.manifest is None:
            continue
        reads = {loc.name or ".": attempts_named(loc.manifest) - {loc.manifest.attempt},
                 **references_of([loc.manifest])}
        for where, attempts in reads.items():
            for attempt in attempts:
                out.setdefault((where, attempt), []).append(loc.name or ".")
    return out


def _merge_tiers(by_tier: dict[str, list[dict]]) -> list[dict]:
    """One record per checkpoint name, ``tiers`` naming the tiers that hold it committed
    (the local tier's record first, as loads prefer it)."""
    merged: dict[str, dict] = {}
    for tier in ("local", "durable"):
        for rec in by_tier[tier]:
            held = [tier] if rec["committed_at"] else []
            if rec["name"] in merged:
                merged[rec["name"]]["tiers"] += held
            else:
                merged[rec["name"]] = {**rec, "tiers": held}
    return sorted(merged.values(), key=lambda r: (r["step"] is None, r["step"] or 0, r["name"]))


def _attempt_records(loc: Location, now: float, readers: dict) -> list[dict]:
    committed = loc.manifest.attempt if loc.manifest else None
    return [{"attempt": a.attempt, "committed": a.attempt == committed, "age_s": round(a.age(now), 3),
             "voted": a.voted, "aborted": a.aborted, "files": a.files, "bytes": a.bytes,
             "read_by": readers.get((loc.name or ".", a.attempt), []), "released": a.released}
            for a in sorted(loc.attempts.values(), key=lambda a: a.attempt)]


# ---------------------------------------------------------------------------- verify
@main.command()
@click.argument("url")
@click.option("--quick", is_flag=True, help="Check files and sizes only; do not read chunks.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def verify(url: str, quick: bool, as_json: bool) -> None:
    """Check one checkpoint, or every committed checkpoint under URL.

    Full mode reads, decodes and hashes every chunk. Exit 0 when all is sound, 1 when
    anything is missing or corrupt or no checkpoint is there. Never changes the store.
    """
    storage = _open(url)
    try:
        locations = [loc for loc in _locations(storage) if loc.committed or loc.manifest_error]
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    if not locations:  # as ls: exit 1, saying where the checkpoints are when they lie deeper
        message = _nothing_here(url)
        if as_json:
            click.echo(json.dumps({"ok": False, "quick": quick, "checkpoints": [], "error": redact_url(message)},
                                  indent=2))
        _fail(message, EXIT_PROBLEM)
    total = sum(loc.manifest.stored_bytes for loc in locations if loc.manifest)
    reports = []
    seen: dict = {}  # each stored blob is read once, however many checkpoints reference it
    with _progress(total, "verifying", as_json) as bar:
        for loc in locations:
            if loc.manifest is None:
                problems = [Problem(loc.storage.describe(), None, None, None, None, loc.manifest_error or "unreadable")]
            else:
                problems = verify_manifest(loc.storage, loc.manifest, quick,
                                           on_blob=lambda blob: bar.update(blob.length), seen=seen)
            reports.append({"name": loc.name or ".", "url": loc.storage.describe(),
                            "step": loc.step, "ok": not problems,
                            "problems": [_problem_record(p) for p in problems]})
    ok = all(r["ok"] for r in reports)
    if as_json:
        click.echo(json.dumps({"ok": ok, "quick": quick, "checkpoints": reports}, indent=2))
    else:
        for r in reports:
            click.echo(f"{'ok  ' if r['ok'] else 'FAIL'}  {_printable(r['url'])}")
            for p in r["problems"]:
                click.echo(f"      {_printable(p['text'])}")
        click.echo(f"{len(reports)} checkpoint(s) checked, "
                   f"{sum(not r['ok'] for r in reports)} with problems")
    sys.exit(EXIT_OK if ok else EXIT_PROBLEM)


def _problem_record(p: Problem) -> dict:
    return {"rank": p.rank, "key": p.key, "file": p.file, "offset": p.offset, "message": p.message, "text": str(p)}


# ---------------------------------------------------------------------------- gc
def _duration(ctx, param, value):
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e


def _keep_best(ctx, param, values):
    try:
        return tuple(KeepBest.parse(v) for v in values)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e


@main.command()
@click.argument("url")
@click.option("--keep-last", type=click.IntRange(min=1), help="Keep the N newest checkpoints.")
@click.option("--keep-every", type=click.IntRange(min=1), help="Keep steps that are multiples of K.")
@click.option("--keep-within", callback=_duration, help="Keep checkpoints committed within DURATION (e.g. 7d, 12h).")
@click.option("--keep-best", multiple=True, callback=_keep_best, help="METRIC:min|max:N, repeatable.")
@click.option("--grace", callback=_duration, default="6h", show_default=True,
              help="Leave uncommitted and released attempts alone until idle this long (0: delete "
                   "dropped files at once; a save committing meanwhile keeps what it uses).")
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def gc(url, keep_last, keep_every, keep_within, keep_best, grace, dry_run, as_json) -> None:
    """Delete checkpoints no policy keeps, superseded generations and stale debris.

    A checkpoint is kept when any policy keeps it; pinned checkpoints and the newest
    committed one are always kept. Without any --keep option no committed checkpoint is
    deleted. Manifests go before their files, so an interrupted gc is safe to re-run.
    The files of a deleted manifest are released, not deleted: a save in flight may
    reference them, so a run after the grace deletes them (--grace 0: at once). What
    waits for a later run is listed as pending, with the time it becomes deletable.
    """
    storage = _open(url, containers=False)
    policy = Retention(last=keep_last, every=keep_every, within=keep_within, best=keep_best)
    try:
        p = gc_mod.plan(storage, policy, grace)
        if not dry_run:
            with _progress(len(p.deletions), "deleting", as_json) as bar:
                gc_mod.execute(storage, p, on_deleted=lambda d: bar.update(1))
        else:
            gc_mod.preview(storage, p)
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    if as_json:
        click.echo(json.dumps({**p.to_json(), "dry_run": dry_run}, indent=2))
        return
    verb = "would delete" if dry_run else "deleted"
    done = [d for d in p.deletions if d.skipped is None]
    for d in done:
        click.echo(f"{verb} {d.kind:<10} {_printable(d.location)}: {_printable(d.reason)} ({_human_bytes(d.bytes)})")
    for d in p.deletions:
        if d.skipped is not None:
            click.echo(f"skipped {d.kind:<10} {_printable(d.location)}: {_printable(d.skipped)}")
    for key in p.foreign:
        click.echo(f"left    foreign    {_printable(key)}: not a name ckptstore writes (symlink, special file or unknown)")
    if p.held_back:
        click.echo(f"held    data: {_printable(p.held_back)}")
    for key in p.aborted_uploads:
        click.echo(f"{'would abort' if dry_run else 'aborted'} upload {_printable(key)}: a multipart upload left open")
    for key in p.empty_dirs:
        click.echo(f"{verb} empty dir  {_printable(key)}/: left by a save killed before its first file")
    for w in p.pending:
        click.echo(f"pending {w.kind:<10} {_printable(w.location)}: {_printable(w.name)} {w.why}; deletable from "
                   f"{_when(w.deletable_at)} ({_human_bytes(w.bytes)}, {w.files} file(s))")
    summary = [f"{verb} {len(done)} item(s), {_human_bytes(p.bytes)}"]
    if p.released_files:
        summary.append(f"released {_human_bytes(p.released_bytes)} in {p.released_files} file(s): a gc run from "
                       f"{_when(p.released_until)} deletes it")
    if p.pending:
        summary.append(f"pending {len(p.pending)} item(s), {_human_bytes(sum(w.bytes for w in p.pending))}: "
                       f"the first deletable from {_when(min(w.deletable_at for w in p.pending))}")
    click.echo("; ".join(summary + [f"kept {len(p.kept)} checkpoint(s)"]))


def _when(t: float) -> str:
    """A moment gc names: UTC, and how far off it is."""
    at = _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    left = int(t - time.time() + 0.5)
    if left <= 0:
        return f"{at} (now)"
    hours, rest = divmod(left, 3600)
    return f"{at} (in {hours}h {rest // 60}m)" if hours else f"{at} (in {rest // 60}m {rest % 60}s)"


# ---------------------------------------------------------------------------- consolidate
@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--torch", "as_torch", is_flag=True, help="Write a torch.save file instead of a ckptstore checkpoint.")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Whose rank-local values (RNG state, counters) to keep.")
@click.option("--weights-only/--no-weights-only", default=True, show_default=True,
              help="Refuse pickled objects outside torch's allow-list (trust the source before disabling).")
def consolidate(src: str, dst: str, as_torch: bool, rank: int, weights_only: bool) -> None:
    """Write a single-process checkpoint (or with --torch a torch.save file) holding the
    full tensors of the sharded checkpoint SRC."""
    import torch

    from .. import api

    if _exists(dst):
        _fail(f"{shown(dst)}: already exists; consolidate never replaces a checkpoint", EXIT_USAGE)
    try:
        obj = _load_with_progress(src, "reading", False, map_location="cpu", weights_only=weights_only, rank=rank)
        if as_torch:
            with open(dst, "xb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            api.save(obj, dst).result()
    except FileExistsError as e:
        _fail(f"{shown(dst)}: already exists ({e})", EXIT_USAGE)
    except (FileNotFoundError, InvalidURLError, NotACheckpointError) as e:  # (a store root: which step?)
        _fail(str(e), EXIT_USAGE)
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    click.echo(f"wrote {shown(dst)}")


# ---------------------------------------------------------------------------- zarr interop
@main.command("export")
@click.argument("src")
@click.argument("dest", type=click.Path())
@click.option("--zarr", "as_zarr", is_flag=True, required=True,
              help="Write a zarr v3 hierarchy through tensorstore (the one export format).")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Whose rank-local values to export (sharded tensors are exported whole).")
@click.option("--extension-types", is_flag=True,
              help="bfloat16 and float8 as tensorstore's extension types (bit for bit) instead of widened "
                   "exactly to float32/float16 (which every zarr reader opens).")
@click.option("--weights-only/--no-weights-only", default=True, show_default=True,
              help="Refuse pickled objects outside torch's allow-list (trust the source before disabling).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def export(src: str, dest: str, as_zarr: bool, rank: int, extension_types: bool, weights_only: bool,
           as_json: bool) -> None:
    """Write every tensor of checkpoint SRC as a zarr v3 array below the new local
    directory DEST, with dtype and shape kept (docs/interop.md)."""
    from .. import zarr_io

    if os.path.lexists(dest):
        _fail(f"{dest}: already exists; export never writes into an existing path", EXIT_USAGE)
    try:
        state = _load_with_progress(src, "reading", as_json, map_location="cpu", weights_only=weights_only,
                                    rank=rank)
        total = sum(t.numel() * t.element_size() for t in _tensors_of(state))
        with _progress(total, "exporting", as_json) as bar:
            report = zarr_io.export_state(state, dest, extension_types=extension_types, source=src,
                                          on_bytes=bar.update)
    except (FileNotFoundError, InvalidURLError, NotACheckpointError) as e:  # (a store root: which step?)
        _fail(str(e), EXIT_USAGE)
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    if as_json:
        click.echo(json.dumps({"dest": dest, "arrays": report.arrays, "values": report.values,
                               "skipped": report.skipped, "bytes": report.bytes}, indent=2))
        return
    for line in report.skipped:
        click.echo(f"skipped {_printable(line)}")
    click.echo(f"wrote {dest}: {len(report.arrays)} array(s), {_human_bytes(report.bytes)}, "
               f"{report.values} plain value(s)")


@main.command("import")
@click.argument("src")
@click.argument("dest")
def import_(src: str, dest: str) -> None:
    """Save the zarr v3 hierarchy at local directory SRC (an export, or any hierarchy of
    arrays) as a new ckptstore checkpoint DEST."""
    from .. import api, zarr_io

    if is_url(src) or not os.path.isdir(src):  # (checked here, not by click, which echoes a URL whole)
        _fail(f"{shown(src)}: not a local directory (import reads a zarr v3 hierarchy on local disk)", EXIT_USAGE)
    if _exists(dest):
        _fail(f"{shown(dest)}: already exists; import never replaces a checkpoint", EXIT_USAGE)
    try:
        state = zarr_io.import_state(src)
        api.save(state, dest).result()
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    click.echo(f"wrote {shown(dest)}: {len(_tensors_of(state))} tensor(s)")


def _load_with_progress(src: str, label: str, quiet: bool, **load_args):
    """``ckptstore.load(src)`` in one process (a sharded checkpoint whole: no warning for
    that), with a bar over the stored bytes it reads."""
    import warnings

    from .. import api
    from ..checkpoint.reader import on_bytes_read
    from ..checkpoint.restore import latest_manifest

    try:
        total = latest_manifest(open_storage(src)).stored_bytes
    except NotACheckpointError:  # (a store root, say: load would search for what lies there again)
        raise
    except (CkptStoreError, ValueError, OSError):  # a single-file container, say: no total to show
        total = 0
    with _progress(total, label, quiet or not total) as bar:
        token = on_bytes_read.set(bar.update)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", api.WorldSizeChangedWarning)
                return api.load(src, **load_args)
        finally:
            on_bytes_read.reset(token)


def _tensors_of(state) -> list:
    from ..checkpoint.flatten import tensor_paths

    found, _ = tensor_paths(state)
    return [t for _, t in found.values()]


def _progress(total: int, label: str, quiet: bool):
    """A progress bar over ``total`` (bytes, or items) with its ETA on a terminal's
    stderr (click's); hidden when stderr is not a terminal or the output is JSON."""
    return click.progressbar(length=max(total, 1), label=label, file=sys.stderr,
                             hidden=quiet or not sys.stderr.isatty(), show_eta=True, show_percent=True)


# ---------------------------------------------------------------------------- doctor
def doctor_report() -> dict:
    import platform

    import torch
    import xxhash
    import zstandard

    from .. import native
    from ..runtime import runtime

    cuda = torch.cuda.is_available()
    backends = ["local", "memory"]
    try:
        import boto3  # noqa: F401

        backends.append("s3 (boto3 present)")
    except ImportError:
        pass
    return {
        "ckptstore": __version__,
        "native": native.NATIVE,
        "native_reason": native.WHY_NOT or None,
        "hardware_threads": native.hardware_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zstandard": zstandard.__version__,
        "xxhash": xxhash.VERSION,
        "cuda": {
            "available": cuda,
            "runtime": torch.version.cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            # the extension's own CUDA path (batched staging, pinned slabs): compiled in,
            # and whether the driver (libcuda, loaded at run time) sees a device
            "native": native.cuda_info(),
            # why that path is off (None: on); staging then runs on torch streams
            "native_off": native.cuda_off_reason(),
        },
        "staging_pool": runtime().pool.stats(),
        "backends": backends,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--health", is_flag=True, help="Check this node instead (GPUs through NVML, disks, the store), as "
              "`ckptstore run` does before each launch; exit 13 when unhealthy.")
@click.option("--store", "store_url", default=None, help="With --health: the store to check (reachable, writable).")
@click.option("--staging-dir", "staging_dirs", multiple=True, help="With --health: a local directory to check.")
@click.option("--expected-gpus", type=click.IntRange(min=0), default=None,
              help="With --health: fewer visible GPUs than this is unhealthy.")
def doctor(as_json: bool, health: bool, store_url: str | None, staging_dirs: tuple[str, ...],
           expected_gpus: int | None) -> None:
    """Report the native extension, CUDA, staging pool, backends and versions."""
    if health:
        from ..supervisor.health import HealthLimits, health_main

        sys.exit(health_main(store_url, staging_dirs, as_json, HealthLimits(expected_gpus=expected_gpus)))
    report = doctor_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(doctor_text(report))


# Figures of the staging pool that count bytes (the rest count events or blocks).
_POOL_BYTES = {"capacity", "held", "in_use", "used", "cached", "peak", "peak_in_use", "overflow_bytes",
               "largest_free", "slab_bytes"}


def _doctor_value(key: str, value, section: str) -> str:
    """One figure of the doctor report, as a person reads it."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or value == "":
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_doctor_value(key, v, section) for v in value) or "none"
    if isinstance(value, dict):  # (deeper than a section: inline)
        return ", ".join(f"{k.replace('_', ' ')} {_doctor_value(k, v, section)}" for k, v in value.items()) or "-"
    if isinstance(value, int) and section == "staging_pool" and key in _POOL_BYTES:
        return f"{_human_bytes(value)} ({value} bytes)" if value >= 1024 else _human_bytes(value)
    if isinstance(value, int) and section == "cuda.native" and key.endswith("_version"):
        # CUDA's encoding: 1000 * major + 10 * minor (12040 is 12.4); 0: none found
        return "-" if value == 0 else f"{value // 1000}.{value % 1000 // 10} ({value})"
    return str(value)


def doctor_text(report: dict) -> str:
    """The doctor report as a table: one row per figure (the same keys as --json, each
    section's rows indented under it), with yes/no for flags, "-" for nothing, byte
    counts with their units, and every string escaped as ls escapes what it prints."""
    rows: list[tuple[str, str]] = []

    def walk(d: dict, depth: int, section: str) -> None:
        for k, v in d.items():
            label = "  " * depth + k.replace("_", " ")
            if isinstance(v, dict) and depth < 2 and v:
                rows.append((label, ""))
                walk(v, depth + 1, f"{section}.{k}" if section else k)
            else:
                rows.append((label, _doctor_value(k, v, section)))

    walk(report, 0, "")
    cuda = report.get("cuda") or {}
    if cuda.get("native_off"):
        # Said plainly: the path is off for a reason the user may fix (driver, build).
        state = "GPU present, " if cuda.get("available") else "no GPU for torch; "
        rows.append(("native CUDA path", f"OFF ({state}{cuda['native_off']})"))
    elif isinstance(cuda.get("native"), dict):
        info = cuda["native"]
        driver = _doctor_value("driver_version", info.get("driver_version"), "cuda.native")
        rows.append(("native CUDA path", f"on (driver API, driver {driver}, "
                                         f"{info.get('devices')} device(s), kernel {info.get('kernel')})"))
    rows = [(_printable(k), _printable(v)) for k, v in rows]  # reasons and names come from the system
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}".rstrip() for k, v in rows)


from .run import run_command  # noqa: E402 (its own module: the supervisor)

main.add_command(run_command)
from .status import status as status_command  # noqa: E402

main.add_command(status_command)

if __name__ == "__main__":  # pragma: no cover
    main()
