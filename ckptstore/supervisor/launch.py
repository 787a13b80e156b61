"""One attempt of a supervised job: torch's own launcher (``torch.distributed.run``),
with its rendezvous, agent and error files, and the outcome written as JSON.

    python -c "<command()'s stub>" RESULT.json [torchrun options] SCRIPT [ARGS...]

The supervisor (``ckptstore run``) starts this in a process group of its own per
attempt and relaunches it whole after a failure (torchrun's in-place restarts did not
re-form the gloo group reliably: see docs/runbook.md). ``RESULT.json`` tells the
supervisor how each failed rank ended: exit code or signal, and the exception and
traceback that torchelastic's error file holds.

The launcher imports the ckptstore package the supervisor runs (:func:`command`: not
``python -m``, which puts the working directory first: a checkout's source folder there
was imported instead), and every worker of a Python script starts through
``bootstrap.py`` (:func:`through_bootstrap`), which records its uncaught exception in
the error file whatever the script imports.
"""

from __future__ import annotations

import math
import os
import signal
import sys

from .progress import die_with_parent
from .results import TRACEBACK_CHARS, clip as _clip, failure_record as _failure  # noqa: F401 (shared with agent.py)
from .results import write as _write

ENV_SUPERVISOR = "CKPTSTORE_SUPERVISOR_PID"  # the supervisor this launcher must not outlive
# Several nodes (consensus.py): the attempt's own rendezvous id, agreed through the store,
# and the bound on torch's wait for every node in that rendezvous (its join_timeout).
ENV_RDZV_ID = "CKPTSTORE_RDZV_ID"
ENV_JOIN_TIMEOUT = "CKPTSTORE_JOIN_TIMEOUT"
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")
# the directory that holds this ckptstore package (site-packages, or a checkout on PYTHONPATH)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def command(result_path: str, launcher_args: list[str]) -> list[str]:
    """The launcher's command line: this package's launcher, imported from the
    directory this package lives in, whatever the working directory holds ('' of
    ``-c``, the working directory, is replaced by it)."""
    stub = (f"import sys; sys.path[:1 if sys.path and sys.path[0] == '' else 0] = [{PACKAGE_ROOT!r}]; "
            "from ckptstore.supervisor.launch import main; from ckptstore.supervisor.quick_exit import exit_with; "
            "exit_with(main)")
    return [sys.executable, "-c", stub, result_path, *launcher_args]


def through_bootstrap(args) -> None:
    """Make torchrun's parsed ``args`` start each worker through bootstrap.py (the
    script, or ``-m`` module, and its arguments become the bootstrap's); a program run
    with ``--no-python`` is left as it is (it is not Python)."""
    if args.no_python:
        return
    mode = "run-path" if getattr(args, "run_path", False) else "module" if args.module else "file"
    args.training_script_args = [mode, args.training_script, *args.training_script_args]
    args.training_script, args.module = BOOTSTRAP, False


def rendezvous(args, env) -> None:
    """The supervisor's rendezvous settings for this attempt (several nodes): its own
    rendezvous id, and the bound on its wait for every node: torch's join timeout and,
    for the c10d store at ``--rdzv-endpoint`` (hosted by the launcher of the node whose
    address it is, and gone with that node), its read timeout, which bounds a client's
    wait for the store to answer; each unless ``--rdzv-conf`` sets it."""
    if env.get(ENV_RDZV_ID):
        args.rdzv_id = env[ENV_RDZV_ID]
    timeout = env.get(ENV_JOIN_TIMEOUT)
    for key in ("join_timeout", "read_timeout"):
        conf = args.rdzv_conf or ""
        if timeout and key not in conf:
            value = max(1, math.ceil(float(timeout))) if key == "read_timeout" else timeout  # (an int for torch)
            args.rdzv_conf = f"{conf},{key}={value}" if conf else f"{key}={value}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result_path, rest = argv[0], argv[1:]
    # A supervisor killed outright (SIGKILL) must not leave its job training unwatched
    # (a restarted supervisor would start a second one): SIGTERM then, which torch's
    # launcher forwards to the workers (they save and stop), as a stop does.
    die_with_parent(signal.SIGTERM)
    supervisor = os.environ.get(ENV_SUPERVISOR)
    if supervisor and str(os.getppid()) != supervisor:  # it died before the line above
        return 128 + int(signal.SIGTERM)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(rest)
    args.max_restarts = 0  # the supervisor relaunches; torchrun's in-place restarts stay off (runbook)
    through_bootstrap(args)
    rendezvous(args, os.environ)
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    try:
        torchrun.run(args)
    except ChildFailedError as e:
        _write(result_path, {"ok": False, "failures": {str(r): _failure(f) for r, f in e.failures.items()}})
        return 1
    except SignalException as e:  # the launcher itself was told to stop; workers got the signal too
        _write(result_path, {"ok": False, "launcher_signal": e.sigval.name, "failures": {}})
        return 128 + int(e.sigval)
    except RendezvousTimeoutError as e:  # not every node came within the join timeout
        _write(result_path, {"ok": False, "failures": {}, "rendezvous_timeout": True,
                             "launcher_error": f"RendezvousTimeoutError: {str(e)[:2000]}"})
        return 1
    except RendezvousConnectionError as e:  # the c10d store at --rdzv-endpoint did not answer (its host is gone?)
        _write(result_path, {"ok": False, "failures": {}, "rendezvous_unreachable": str(args.rdzv_endpoint)[:200],
                             "launcher_error": f"RendezvousConnectionError: {str(e)[:2000]}"})
        return 1
    except Exception as e:  # noqa: BLE001 - the launcher's own failure (a peer's store gone at shutdown)
        _write(result_path, {"ok": False, "failures": {}, "launcher_error": f"{type(e).__name__}: {str(e)[:2000]}"})
        return 1
    _write(result_path, {"ok": True, "failures": {}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
