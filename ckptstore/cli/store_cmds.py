"""``ckptstore ls``, ``verify`` and ``gc``: reading and cleaning up a store."""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time

import click

from ..checkpoint import gc as gc_mod
from ..checkpoint import nearby
from ..checkpoint.catalog import Location, check_skip_mark, is_location, scan_location, scan_store
from ..checkpoint.retention import KeepBest, Retention, parse_duration
from ..checkpoint.verify import Problem, verify_manifest
from ..errors import CkptStoreError
from ..storage import Storage, is_url, open_storage
from ..storage.urls import redact_url, shown
from .common import (EXIT_OK, EXIT_PROBLEM, _fail, _human_bytes, _open, _print_json, _printable, _progress,
                     _table)

def _locations(storage: Storage) -> list[Location]:
    """The URL itself when it is a checkpoint, else the checkpoints below it."""
    if is_location(storage):
        return [scan_location(storage, "")]
    return scan_store(storage)

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

@click.command("ls")
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
        _print_json(records)
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
@click.command("verify")
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
            _print_json({"ok": False, "quick": quick, "checkpoints": [], "error": redact_url(message)})
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
        _print_json({"ok": ok, "quick": quick, "checkpoints": reports})
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

@click.command("gc")
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
        _print_json({**p.to_json(), "dry_run": dry_run})
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
