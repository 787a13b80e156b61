"""``ckptstore status URL``: how a supervised run (``ckptstore run``) is doing, from the
journal in its store. Registered on the ``ckptstore`` group by app.py.

Exit codes: 0 a journal was found; 1 the store holds no journal (or not the run asked
for), or reading it failed; 2 usage error or unreachable store.
"""

from __future__ import annotations

import math
import time

import click

from .._terminal import printable
from .common import EXIT_PROBLEM, EXIT_USAGE, _fail, _open, _print_json


@click.command("status")
@click.argument("url")
@click.option("--run", "run_id", metavar="ID", help="The run to summarise (default: the latest).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--local", "local", metavar="PATH",
              help="The local tier of a two-tier store whose durable tier is URL (with local_shared: that "
                   "location): show the newest step of each.")
def status(url: str, run_id: str | None, as_json: bool, local: str | None) -> None:
    """Summarise a supervised run: state, restarts, failures by class, MTBF, lost work,
    goodput, checkpoint age and the recommended checkpoint interval."""
    from ..errors import CkptStoreError, InvalidURLError
    from ..storage.urls import shown
    from ..supervisor.journal import is_run_id
    from ..supervisor.status import status as run_status

    if run_id is not None and not is_run_id(run_id):
        _fail(f"--run {run_id!r}: not a run id ([A-Za-z0-9][A-Za-z0-9._-]{{0,63}})", EXIT_USAGE)
    storage = _open(url, containers=False)
    try:
        summary = run_status(storage, run_id, time.time())
    except (CkptStoreError, OSError) as e:
        _fail(f"{shown(url)}: cannot read the run journal: {e}", EXIT_PROBLEM)
    if summary["state"] == "empty":
        what = f"no journal for run {run_id}" if run_id else "no run journal (ckptstore run writes one)"
        _fail(f"{shown(url)}: {what}", EXIT_PROBLEM)
    if local is not None:
        try:
            summary["tiers"] = {"local": _newest(local), "durable": _newest_of(storage)}
        except InvalidURLError as e:
            _fail(str(e), EXIT_USAGE)
        except (CkptStoreError, OSError) as e:
            _fail(f"{shown(local)}: cannot read the tiers' newest steps: {e}", EXIT_PROBLEM)
    if as_json:
        _print_json(summary)
    else:
        click.echo(render(summary))


def _newest(url: str) -> dict | None:
    """The newest committed step of a local tier, or None (none, or the path is gone:
    the node holding it was lost)."""
    import os

    from ..storage import is_url, open_storage

    if not is_url(url) and not os.path.isdir(url):
        return None
    return _newest_of(open_storage(url))


def _newest_of(storage) -> dict | None:
    from ..supervisor.status import newest_checkpoint

    newest = newest_checkpoint(storage)
    return None if newest is None else {"step": newest["step"],
                                        "age_s": max(0.0, time.time() - newest["committed_at_t"])}


def render(s: dict) -> str:
    """The human form of a summary: one line per figure."""
    lines = [("run", f"{s['run']} (started {_when(s['started_at'])}, wall {_dur(s['wall_s'])})")]
    state = s["state"]
    if state == "gave_up" and s.get("give_up"):
        g = s["give_up"]
        state += f": {g.get('class') or '?'}, exit {g.get('code')}: {g.get('reason') or ''}"
    lines.append(("state", state + (f", at step {s['step']}" if s.get("step") is not None else "")))
    lines.append(("restarts", str(s["restarts"])))
    by_class = ", ".join(f"{k} {v}" for k, v in s["failures_by_class"].items())
    lines.append(("failures", f"{len(s['failures'])} ({by_class})"))
    lines.append(("MTBF", _dur(s["mtbf_s"]) if s["mtbf_s"] is not None else "no failure yet"))
    if s["failures"]:  # (durable_every="auto" promotes by it)
        lines.append(("MTBF cold", "no failure lost the memory tier" if s.get("mtbf_cold_s") is None else
                      f"{_dur(s['mtbf_cold_s'])} ({s['cold_failures']} failure(s) lost the memory tier)"))
    lines.append(("lost work", f"{s['lost_steps']} steps, {_dur(s['lost_s'])}; startup {_dur(s['startup_s'])}, "
                               f"recovery {_dur(s['recovery_s'])}"))
    rec = s.get("recoveries") or {}
    if rec.get("count"):
        lines.append(("in-job", _in_job_line(rec)))
    lines.append(("goodput", "-" if s["goodput"] is None else f"{100 * s['goodput']:.1f}%"))
    lines.append(("checkpoint", "none committed" if s["checkpoint_step"] is None else
                  f"step {s['checkpoint_step']}, age {_dur(s['checkpoint_age_s'])}"))
    if s.get("tiers") is not None:
        lines.append(("tiers", ", ".join(
            f"{tier} " + ("none" if t is None else f"step {t['step']}, age {_dur(t['age_s'])}")
            for tier, t in s["tiers"].items())))
    r = s.get("last_resume")
    if r is not None and r["step"] is not None:
        where = f" from the {r['tier']} tier" if r["tier"] else ""
        age = f" (age {_dur(r['checkpoint_age_s'])})" if r["checkpoint_age_s"] is not None else ""
        lines.append(("resumed", f"attempt {r['attempt']}: step {r['step']}{where}{age}"))
    f = s["last_failure"]
    if f is not None:
        where = f" at step {f['step']}" if f["step"] is not None else ""
        lines.append(("last failure", f"attempt {f['attempt']}, {f['class']}{where}: {f['reason'] or '?'}"))
        if f.get("recovered") == "in_job":
            lines.append(("last recovery", _recovery_line(f)))
    for st in s.get("stragglers") or []:
        host = f" on {st['host']}" if st.get("host") else ""
        lines.append(("straggler", f"rank {st['rank']}{host}: {st['step_s']:.3g}s per step, "
                                   f"{st['ratio']:.2f}x the other ranks' median {st['others_s']:.3g}s, "
                                   f"slow in {st['reports']} reports in a row"))
    timeouts = s.get("section_timeouts") or []
    if timeouts:
        t = timeouts[-1]
        at = f" at step {t['step']}" if t.get("step") is not None else ""
        lines.append(("section timeout", f"{len(timeouts)}; last: attempt {t['attempt']}, {t['section']}{at}: "
                                         f"{_dur(t['elapsed_s'])} > bound {_dur(t['bound_s'])} ({t['source']})"))
    health = s.get("run_health") or []
    if health:
        h = health[-1]
        names = ", ".join(str(c.get("name")) for c in h.get("checks") or [])
        lines.append(("run health", f"{len(health)} finding(s); last: attempt {h['attempt']}, {h['action']}: {names}"))
    if s["recommended_interval_s"] is None:
        advice = "not yet (no save cost measured)"
    else:
        steps = s["recommended_interval_steps"]
        advice = (f"every {steps} steps (" if steps is not None else "(") + \
            f"{_dur(s['recommended_interval_s'])}; Young/Daly, save {s['save_blocking_s']:.3g}s, " \
            f"MTBF {s['mtbf_source']})"
    lines.append(("interval", advice))
    j = s.get("journal") or {}
    bad = {k: v for k, v in j.items() if v}
    if bad:
        lines.append(("journal", ", ".join(f"{v} {k}" for k, v in bad.items()) + " event(s) left out"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {printable(v)}" for k, v in lines)  # reasons come from the ranks


def _in_job_line(rec: dict) -> str:
    """``N recoveries, median 0.46s (detect .., teardown .., re-form .., restore ..),
    restored from memory N, local N, durable N``."""
    def median(part: str) -> str:
        m = (rec.get(part) or {}).get("median")
        return "-" if m is None else f"{m:.2f}"

    n = rec["count"]
    parts = ", ".join(f"{name} {median(part)}" for name, part in (
        ("detect", "detect_s"), ("teardown", "teardown_s"), ("re-form", "reform_s"), ("restore", "restore_s")))
    total = (rec.get("first_step_s") or {}).get("median")
    tiers = dict.fromkeys(("memory", "local", "durable"), 0)
    tiers.update(rec.get("restore_from") or {})
    where = ", ".join(f"{t} {c}" for t, c in tiers.items())
    back = rec.get("nodes_rejoined") or 0
    return (f"{n} recover{'y' if n == 1 else 'ies'}, median {'-' if total is None else f'{total:.2f}s'} "
            f"({parts}), restored from {where}" + (f", {back} node(s) rejoined as spares" if back else ""))


def _recovery_line(f: dict) -> str:
    """One in-job recovery: ``round N in 0.37s (detect .., teardown .., re-form .., restore ..), from memory 2``."""
    def secs(part: str) -> str:
        return "-" if f.get(part) is None else f"{f[part]:.2f}"

    parts = ", ".join(f"{name} {secs(part)}" for name, part in (
        ("detect", "detect_s"), ("teardown", "teardown_s"), ("re-form", "reform_s"), ("restore", "restore_s")))
    where = ", ".join(f"{t} {c}" for t, c in (f.get("restore_from") or {}).items()) or "-"
    total = "-" if f.get("first_step_s") is None else f"{f['first_step_s']:.2f}s"
    return f"round {f.get('round')} in {total} ({parts}), restored from {where}"


def _dur(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d {h}h {m:02d}m" if d else f"{h}h {m:02d}m" if h else f"{m}m {sec:02d}s"


def _when(iso: str | None) -> str:
    return (iso or "?")[:19].replace("T", " ") + (" UTC" if iso else "")
