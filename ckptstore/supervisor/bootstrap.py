"""The entry point of every worker of a supervised job: run the user's script as
torchrun would, and leave its uncaught exception in torchelastic's error file.

    python -u .../ckptstore/supervisor/bootstrap.py file SCRIPT [ARGS...]
    python -u .../ckptstore/supervisor/bootstrap.py module MODULE [ARGS...]
    (--run-path: torch runs this file with runpy in its own process; mode "run-path")

The launcher (launch.py) puts this file in torchrun's place of the script, by path:
``python -m`` would put the working directory first on ``sys.path``, and a checkout of
ckptstore there (its source folder) would be imported instead of the package the
supervisor runs. So, before anything else:

- this file's own directory (``sys.path[0]`` of a script run by path) is taken off
  ``sys.path``, and ``ckptstore`` resolves to the package this file belongs to (a
  meta-path finder for that one name: nothing is imported until the script asks);
- the script's own place goes first on ``sys.path`` as Python would put it there: the
  script's directory (symlinks resolved), or for a module the working directory; under
  ``-P`` / ``PYTHONSAFEPATH`` nothing, and for ``--run-path`` the path stays torch's;
- the worker dies with its launcher (parent-death signal SIGKILL on Linux), and
  faulthandler is on, as torch's ``@record`` turns it on.

An exception that leaves the script (a ``SystemExit`` with a non-zero status too, such
as argparse's usage error) is written to ``TORCHELASTIC_ERROR_FILE`` by torch's own
``ErrorHandler.record_exception``, unless the program's own ``@record`` wrote the file
first, then raised again: the exit status and the traceback on stderr stay Python's.
This costs no import: torch is imported only when there is an exception to record.
"""

import os  # (frozen: nothing is looked up on sys.path for os and sys)
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
# (only when run: progress.py imports this module for write_error_file)
if __name__ == "__main__" and sys.path and os.path.realpath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]  # run by path: ckptstore/supervisor/ would shadow top-level modules

import faulthandler  # noqa: E402

# the directory that holds this ckptstore package (as named, not through its symlinks)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("file", "module", "run-path")


class _OwnPackage:
    """A meta-path finder for the one name ``ckptstore``: the package this file
    belongs to (the one the supervisor runs), wherever the script's directory or the
    working directory put another on ``sys.path``."""

    def find_spec(self, name, path=None, target=None):
        if name != "ckptstore":
            return None
        from importlib.machinery import PathFinder

        return PathFinder.find_spec(name, [_ROOT])


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux


def _record(exc: BaseException) -> None:
    """Called inside the ``except`` block (torch formats the exception being handled)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # none asked for, or the program's own @record wrote it
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
        return
    except BaseException:  # noqa: BLE001 - a broken torch (perhaps the very error): write it ourselves
        pass
    write_error_file(path, exc)


def write_error_file(path: str, exc: BaseException) -> None:
    """``exc`` in torchelastic's error-file format (``ErrorHandler.record_exception``'s),
    written without torch; the progress hook of a Checkpointer's worker uses it too."""
    import json
    import time
    import traceback

    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)),
                                      "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in MODES:
        raise SystemExit(f"usage: bootstrap.py {{{'|'.join(MODES)}}} SCRIPT [ARGS...]")
    mode, target, args = argv[0], argv[1], argv[2:]
    if not any(isinstance(f, _OwnPackage) for f in sys.meta_path):
        sys.meta_path.insert(0, _OwnPackage())
    _die_with_parent()
    faulthandler.enable(all_threads=True)
    import runpy

    safe = getattr(sys.flags, "safe_path", False)
    try:
        if mode == "module":
            if not safe:
                sys.path.insert(0, os.getcwd())
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            if mode == "file" and not safe:
                sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            _record(e)
        raise
    except Exception as e:
        _record(e)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
