"""``ckptstore run [torchrun options] --store URL [policy options] SCRIPT [ARGS...]``.

torchrun's options and ours mix before the script, so the command line is split here:
our options (below) are taken out wherever they appear before SCRIPT; everything else
goes to torch's own launcher parser, which knows which of its options take a value.
"""

from __future__ import annotations

import argparse
import math
import sys

import click

from ..errors import CkptStoreError
from ..supervisor.mode import choose as choose_recovery
from ..supervisor.preflight import detections, misplaced, script_problem


def _count(least: int):
    """An argparse ``type=``: a whole number >= ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (allowed: >= {least})") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is out of range (allowed: >= {least})")
        return value
    return parse


def _seconds(positive: bool = False, inf: bool = False):
    """An argparse ``type=``: seconds (or a factor), finite, >= 0 (``positive``: > 0);
    ``inf``: infinity allowed too (no bound). NaN never: it compares false with
    everything, so a bound of NaN neither fires nor ends."""
    allowed = ("> 0" if positive else ">= 0") + (", or inf (no bound)" if inf else ", finite")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number (allowed: {allowed})") from None
        if math.isnan(value) or (math.isinf(value) and not (inf and value > 0)) or value < 0 or \
                (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text} is out of range (allowed: {allowed})")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    from ..supervisor.decide import Policy

    d = Policy()  # the defaults live in one place
    p = argparse.ArgumentParser(prog="ckptstore run", add_help=False)
    p.add_argument("--store", required=True, help="the checkpoint store (path or URL): the journal goes there")
    p.add_argument("--run-id", default=None, help="journal run id (default: a new one per `ckptstore run`)")
    p.add_argument("--max-restarts", type=_count(0), default=d.max_restarts,
                   help="relaunches after failures in all (preemptions excepted; 0: none)")
    p.add_argument("--max-restarts-per-hour", type=_count(0), default=d.max_restarts_per_hour,
                   help="more failures than this within an hour gives up")
    p.add_argument("--max-preemptions-per-hour", type=_count(0), default=d.max_preemptions_per_hour,
                   help="more preemptions than this within an hour gives up")
    p.add_argument("--backoff", type=_seconds(), default=d.backoff_s,
                   help="first delay before a relaunch, seconds (doubles)")
    p.add_argument("--backoff-max", type=_seconds(), default=d.backoff_max_s)
    p.add_argument("--outage-window", type=_seconds(), default=d.outage_window_s,
                   help="seconds an error that names an outage (and an unreachable store) is retried")
    p.add_argument("--health-wait", type=_seconds(), default=d.health_wait_s,
                   help="seconds failed health checks are rechecked before giving up on the node")
    p.add_argument("--hang-timeout", type=_seconds(positive=True, inf=True), default=d.hang_timeout_s,
                   help="seconds without progress from any reporting rank (saves and loads excepted)")
    p.add_argument("--first-progress-timeout", type=_seconds(positive=True, inf=True), default=d.first_progress_timeout_s,
                   help="seconds from a launch to the first training step of a reporting rank")
    p.add_argument("--resume-timeout", type=_seconds(positive=True, inf=True), default=d.resume_timeout_s,
                   help="the longest a Checkpointer.resume() may take, and its bound until one is measured")
    p.add_argument("--save-timeout", type=_seconds(positive=True, inf=True), default=d.save_timeout_s,
                   help="the longest a save (start to commit, or a wait for commits) may take, and its bound "
                   "until one is measured")
    p.add_argument("--section-factor", type=_seconds(), default=d.section_factor,
                   help="learned section bounds are this many times the longest measured (0: not learned)")
    p.add_argument("--health-interval", type=_seconds(), default=d.health_interval_s,
                   help="seconds between health checks of the node during the run (0: off)")
    p.add_argument("--straggler-report", type=_seconds(), default=d.straggler_report_s,
                   help="seconds between step-time reports for straggler detection (0: off)")
    p.add_argument("--run-timeout", type=_seconds(positive=True, inf=True), default=None, help="give up after this many seconds in all")
    p.add_argument("--no-progress-restarts", type=_count(0), default=d.no_progress_restarts,
                   help="give up after this many failures in a row without a newer checkpoint (0: off)")
    p.add_argument("--alert", default=None, help="shell command run on every failure and on giving up "
                   "(the event as JSON on stdin; in the background)")
    p.add_argument("--join-timeout", type=_seconds(positive=True), default=d.join_timeout_s,
                   help="several nodes: seconds a relaunch waits in torch's rendezvous for every node (then exit 16)")
    p.add_argument("--decision-wait", type=_seconds(positive=True), default=d.decision_wait_s,
                   help="several nodes: seconds a failed attempt waits for the other nodes' reports before its "
                   "verdict")
    p.add_argument("--in-job", action=argparse.BooleanOptionalAction, default=None,
                   help="replace a failed rank with a warm spare while the other ranks stay alive (the script "
                   "calls ckptstore.inprocess.run). Default: on for a script that does (seen in its source), on a "
                   "fixed number of nodes; --no-in-job: relaunch the whole job after every failure")
    p.add_argument("--spares", type=_count(0), default=None,
                   help="--in-job: warm spare processes per node (default 1)")
    p.add_argument("--memory-dir", default=d.memory_dir,
                   help="--in-job: where the node's memory tier lives (tmpfs; <dir>/<run>-<store digest>/<node>, removed at the end)")
    p.add_argument("--memory-budget", type=_budget, default=d.memory_budget,
                   help="--in-job: bytes the memory tier may hold, or N%% of the available memory at the start")
    p.add_argument("--abort-timeout", type=_seconds(positive=True), default=d.abort_timeout_s,
                   help="--in-job: seconds a surviving rank may take to leave a failed round")
    p.add_argument("--reform-timeout", type=_seconds(positive=True), default=d.reform_timeout_s,
                   help="--in-job: seconds for the survivors' reports, a spare, and a re-formed process group")
    p.add_argument("--max-rounds-in-a-row", type=_count(1), default=d.max_rounds_in_a_row,
                   help="--in-job: in-job recoveries in a row without a new step before a cold relaunch")
    p.add_argument("--node-lost-timeout", type=_seconds(positive=True), default=d.node_silent_s,
                   help="--in-job, several nodes: a node whose agent's beat (every 0.5 s) stood still this many "
                   "seconds is lost, with every rank on it")
    p.add_argument("--node-fault-silent", type=_seconds(), default=d.node_fault_silent_s,
                   help="--in-job, several nodes: once a rank's collective failed, a node whose beat stood still "
                   "this many seconds and whose agent does not answer a connection is lost (a refused connection "
                   "decides at once; an agent that answers is never lost sooner than --node-lost-timeout; "
                   "0: the beat timeout alone)")
    p.add_argument("--node-probe-timeout", type=_seconds(), default=d.node_probe_timeout_s,
                   help="--in-job, several nodes: seconds the leader waits for a suspect node's agent to answer "
                   "a connection (0: no probes; then a failed collective and --node-fault-silent decide)")
    p.add_argument("--heartbeat-timeout", type=_seconds(), default=d.heartbeat_timeout_s,
                   help="several nodes: a node whose supervisor's heartbeat in the store did not change for this "
                   "many seconds is gone: its report is not waited for (0: off)")
    p.add_argument("--staging-dir", action="append", default=[], help="a local directory to health-check")
    p.add_argument("--expected-gpus", type=_count(1), default=None,
                   help="health check: fewer visible GPUs than this is an unhealthy node")
    return p


def _budget(text: str) -> str:
    from ..supervisor.memory import parse_budget

    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def in_job_problem(opts, nnodes: str, in_job: bool | None = None) -> str | None:
    """Why the in-job options cannot run as given (refused before any launch), or None.
    ``in_job``: the recovery chosen (supervisor/mode.py); None: as ``opts`` asks."""
    in_job = opts.in_job if in_job is None else in_job
    if opts.spares is not None and not in_job:
        return ("--spares needs in-job recovery (spares replace failed ranks only there); it is off: "
                + ("--no-in-job" if opts.in_job is False else "the script does not call ckptstore.inprocess.run"))
    if not in_job:
        return None
    low, _, high = str(nnodes).partition(":")
    if high and low != high:
        return (f"--in-job with --nnodes {nnodes}: elastic membership is not supported in-job; "
                "give a fixed number of nodes (--nnodes N)")
    if not (high or low).isdigit() or int(high or low) < 1:
        return f"--in-job needs a fixed number of nodes (--nnodes N), not {nnodes!r}"
    return None  # several nodes: node 0 hosts the in-job store (supervisor/injob_nodes.py)


class _Refused(Exception):
    pass


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(our options, torchrun's argv with the script and its arguments)."""
    from torch.distributed.run import get_args_parser

    ours = _parser()
    our_opts = {s for a in ours._actions for s in a.option_strings}
    theirs = get_args_parser()._option_string_actions
    mine, rest, script, i = [], [], [], 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if not tok.startswith("-") or tok == "--":
            rest += argv[i:]  # the script and its arguments
            script = argv[i + (tok == "--"):]
            break
        if name.startswith("--") and name.replace("_", "-") in our_opts:  # torchrun's spelling of ours
            name = name.replace("_", "-")
            tok = name + tok[len(name):]
        elif name.startswith("--") and name not in theirs and name not in our_opts:
            # An abbreviation: argparse would read it as torchrun's option (or as nobody's),
            # and whether it takes a value, so where the script begins, would be a guess.
            full = sorted(o for o in (*our_opts, *theirs) if o.startswith("--") and o.startswith(name))
            if full:
                raise _Refused(f"ckptstore run: {name} is not an option; spell it out ({', '.join(full)})")
        if name in our_opts:
            mine.append(tok)
            takes = ours._option_string_actions[name].nargs != 0
            if takes and "=" not in tok and i + 1 < len(argv):
                mine.append(argv[i + 1])
                i += 1
        else:
            rest.append(tok)
            action = theirs.get(name)
            if action is not None and action.nargs != 0 and "=" not in tok and i + 1 < len(argv):
                rest.append(argv[i + 1])
                i += 1
        i += 1
    if script and not any(t == "--store" or t.startswith("--store=") for t in mine):
        later = misplaced(script[1:], our_opts)
        if later:
            raise _Refused(f"ckptstore run: {', '.join(later)} after SCRIPT ({script[0]}) goes to the script; "
                           "the supervisor's options go before the script: ckptstore run [torchrun options] "
                           "--store URL [policy options] SCRIPT [ARGS...]")
    return ours.parse_args(mine), rest


@click.command(name="run", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                             "allow_interspersed_args": False, "help_option_names": []})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def run_command(argv) -> None:
    """Launch a training job with torch's launcher and restart it after transient faults
    (--in-job: replace a failed rank with a warm spare instead, without a restart).

    ckptstore run [torchrun options] --store URL [policy options] SCRIPT [ARGS...]

    Exit status: 0 finished, 2 usage, 10 deterministic error, 11 restart limit, 12 no
    progress, 13 unhealthy node, 14 run timeout, 15 store unreachable, 16 a node missing
    at a relaunch (several nodes), 143 stopped by SIGTERM (docs/runbook.md).
    """
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        click.echo(run_command.help)
        _parser().print_help()
        sys.exit(0 if argv else 2)
    from torch.distributed.run import parse_args

    from ..supervisor.decide import Policy
    from ..supervisor.health import HealthLimits
    from ..supervisor.runner import Supervisor

    try:
        opts, launcher = split_argv(argv)
        launch_args = parse_args([a for a in launcher])  # refuses what torchrun would refuse
    except _Refused as e:
        click.echo(str(e), err=True)
        sys.exit(2)
    except SystemExit as e:
        sys.exit(2 if e.code else 0)
    problem = script_problem(launch_args)
    if problem:  # refused before any launch: it would fail the same way on every attempt
        click.echo(f"ckptstore run: {problem}", err=True)
        sys.exit(2)
    in_job, recovery = choose_recovery(opts.in_job, launch_args)
    problem = in_job_problem(opts, launch_args.nnodes, in_job)
    if problem:
        click.echo(f"ckptstore run: {problem}", err=True)
        sys.exit(2)
    nproc = launch_args.nproc_per_node
    nnodes = str(launch_args.nnodes).split(":")[-1]
    nnodes_min = str(launch_args.nnodes).split(":")[0]
    world = int(nproc) * int(nnodes) if str(nproc).isdigit() and nnodes.isdigit() else None
    policy = Policy(max_restarts=opts.max_restarts, max_restarts_per_hour=opts.max_restarts_per_hour,
                    max_preemptions_per_hour=opts.max_preemptions_per_hour, backoff_s=opts.backoff,
                    backoff_max_s=opts.backoff_max, outage_window_s=opts.outage_window,
                    health_wait_s=opts.health_wait, hang_timeout_s=opts.hang_timeout,
                    first_progress_timeout_s=opts.first_progress_timeout, run_timeout_s=opts.run_timeout,
                    no_progress_restarts=opts.no_progress_restarts, alert=opts.alert,
                    resume_timeout_s=opts.resume_timeout, save_timeout_s=opts.save_timeout,
                    section_factor=opts.section_factor, health_interval_s=opts.health_interval,
                    in_job=in_job, spares=(1 if opts.spares is None else opts.spares) if in_job else 0,
                    memory_dir=opts.memory_dir, memory_budget=opts.memory_budget,
                    abort_timeout_s=opts.abort_timeout, reform_timeout_s=opts.reform_timeout,
                    max_rounds_in_a_row=opts.max_rounds_in_a_row,
                    node_silent_s=opts.node_lost_timeout, node_fault_silent_s=opts.node_fault_silent,
                    node_probe_timeout_s=opts.node_probe_timeout,
                    straggler_report_s=opts.straggler_report, heartbeat_timeout_s=opts.heartbeat_timeout,
                    health=HealthLimits(expected_gpus=opts.expected_gpus))
    try:
        sup = Supervisor(opts.store, launcher, policy, run_id=opts.run_id, staging_dirs=tuple(opts.staging_dir),
                         world_size=world, nnodes=int(nnodes) if nnodes.isdigit() else 1,
                         nnodes_max=max(int(n) for n in (nnodes, nnodes_min) if n.isdigit()) if
                         (nnodes.isdigit() or nnodes_min.isdigit()) else None,
                         node_rank=launch_args.node_rank, join_timeout_s=opts.join_timeout,
                         decision_wait_s=opts.decision_wait)
    except (ValueError, CkptStoreError) as e:  # a store URL or run id that cannot be used
        click.echo(f"ckptstore run: {e}", err=True)
        sys.exit(2)
    for line in [f"recovery: {recovery}", *detections(launch_args, policy)]:
        click.echo(f"ckptstore run: {line}", err=True)
    sys.exit(sup.run())
