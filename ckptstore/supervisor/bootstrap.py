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
    """Called inside the ``except`` block (torch formats the exception being handled).
    Never raises: the program's own exception, not a failure to record it, is what
    leaves the worker."""
    try:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path or os.path.exists(path):  # none asked for, or the program's own @record wrote it
            return
        try:
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(exc)
            if os.path.exists(path):
                return
        except BaseException:  # noqa: BLE001 - a broken torch (perhaps the very error), an exception
            pass  # whose str() raises: write it ourselves
        write_error_file(path, exc)
    except BaseException:  # noqa: BLE001
        pass


def _text(fn, exc: BaseException, fallback: str) -> str:
    try:
        return fn(exc)
    except BaseException:  # noqa: BLE001 - an exception whose __str__ / __repr__ raises
        return fallback


def write_error_file(path: str, exc: BaseException) -> None:
    """``exc`` in torchelastic's error-file format (``ErrorHandler.record_exception``'s),
    written without torch; the progress hook of a Checkpointer's worker uses it too.
    An exception whose ``str()`` (or ``repr()``) raises is written all the same, with
    a placeholder for what could not be formatted, as Python's own traceback does."""
    import json
    import time
    import traceback

    name = _text(lambda e: type(e).__name__, exc, "BaseException")
    message = _text(lambda e: f"{name}: {e}", exc, "")
    if not message:
        message = f"{name}: <exception str() failed>"
    stack = _text(lambda e: "".join(traceback.format_exception(e)), exc, "")
    if not stack:
        try:
            stack = "".join(traceback.format_tb(exc.__traceback__)) + message + "\n"
        except BaseException:  # noqa: BLE001
            stack = message + "\n"
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except (OSError, ValueError, TypeError):
        pass


def _fresh_main():
    """A new, empty ``__main__`` module, installed in ``sys.modules`` for good (as the
    interpreter's own is): what the script defines stays importable as ``__main__``
    after its top-level code returns (pickle in a thread or an atexit handler,
    multiprocessing), and the bootstrap's own globals are not the script's. The
    bootstrap's module is kept (``_BOOTSTRAP_MAIN``): its functions are still running."""
    import builtins
    import types

    global _BOOTSTRAP_MAIN
    _BOOTSTRAP_MAIN = sys.modules.get("__main__")
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return module


_BOOTSTRAP_MAIN = None


def _run_file(target: str, safe: bool) -> None:
    """Run the script at ``target`` as ``python SCRIPT`` does: in a fresh ``__main__``,
    ``__file__`` absolute (Python 3.9 and later), ``__spec__`` None, compiled with its
    absolute path (tracebacks name it), ``sys.argv[0]`` as given. A directory or a zip
    file (its ``__main__.py``) is run as Python runs it, through runpy."""
    import io
    import zipfile

    if os.path.isdir(target) or zipfile.is_zipfile(target):
        sys.path.insert(0, target)  # Python's sys.path[0] for a directory or zip file, even under -P
        _fresh_main()
        import runpy

        runpy._run_module_as_main("__main__", alter_argv=False)  # what Python itself runs
        return
    from importlib.machinery import SourceFileLoader, SourcelessFileLoader
    from pkgutil import read_code

    if not safe:
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
    path = os.path.abspath(target)
    with io.open_code(path) as f:
        code = read_code(f)  # a compiled .pyc, as Python runs one
    loader = SourcelessFileLoader if code is not None else SourceFileLoader
    if code is None:
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    module = _fresh_main()
    module.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                           __loader__=loader("__main__", path))
    exec(code, module.__dict__)


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
            # python -m's own function (runpy.run_module(alter_sys=True) puts the old
            # __main__ back when the top-level code returns); it runs the module in the
            # __main__ of sys.modules, so a fresh one (not the bootstrap's globals) first.
            _fresh_main()
            runpy._run_module_as_main(target, alter_argv=True)  # sys.argv[0]: the module's file
        elif mode == "file":
            sys.argv = [target, *args]
            _run_file(target, safe)
        else:  # run-path: torch's runpy.run_path, as torchrun --run-path runs the script
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
