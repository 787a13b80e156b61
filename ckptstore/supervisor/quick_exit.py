"""The end of a process that imported torch, without the interpreter's last collections.

At exit, the interpreter tears its modules down and garbage-collects every tracked
object several times over: torch's (and the sympy and dynamo modules it pulls in) are
hundreds of thousands, about a second of CPU per process, and each rank's, launcher's and
supervisor's exit lies on the path from a job's end (or failure) to the supervisor's
verdict. ``gc.freeze()`` takes the objects that exist then out of every later
collection: atexit handlers still run, objects are still freed when their last
reference goes (module teardown closes files, sockets and stores), and only cyclic
garbage made before the call is left to the operating system. For process entry points
only: never in a library call, where it would keep a caller's garbage for good.
"""

from __future__ import annotations

import gc
import sys
from typing import Callable, NoReturn


def skip_final_collections() -> None:
    """Called last in a process's main path (see the module's docstring)."""
    gc.freeze()


def exit_with(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())`` for a ``python -c`` entry point, however main ends."""
    try:
        code = main()
    finally:
        skip_final_collections()
    sys.exit(code)
