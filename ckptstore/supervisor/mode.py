"""Which recovery ``ckptstore run`` uses: in-job (a failed rank replaced by a warm spare
while the others stay alive: agent.py, ckptstore/inprocess.py) or a cold relaunch of
the whole job (launch.py).

In-job is the default wherever it can work: a fixed number of nodes, a Python script,
and a script that enters through ``ckptstore.inprocess.run`` (seen in its source: the
script file, or the ``-m`` module's file). A script that does not is relaunched cold as
before: its ranks cannot live through a peer's failure. ``--in-job`` asks for it
whatever the source says (a script that calls ``inprocess.run`` from another module),
``--no-in-job`` turns it off. Pure apart from reading the script.
"""

from __future__ import annotations

import importlib.util
import os
import re

# ``inprocess.run(`` or ``from ckptstore.inprocess import run`` (then ``run(``).
_USES = re.compile(rb"\binprocess\s*\.\s*run\s*\(|from\s+ckptstore\.inprocess\s+import\s+[^\n]*\brun\b")
_READ_CAP = 4 << 20  # bytes of the script read to look for it


def script_file(launch_args) -> str | None:
    """The Python file the workers run, or None (``--no-python``, a module not found).
    A ``-m`` module is located without importing it or its parents' code."""
    if launch_args.no_python:
        return None
    script = launch_args.training_script
    if launch_args.module:
        try:
            spec = importlib.util.find_spec(script) if "." not in script else None
        except (ImportError, ValueError):
            return None
        return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None
    if os.path.isdir(script):
        script = os.path.join(script, "__main__.py")
    return script if os.path.isfile(script) else None


def uses_inprocess(path: str | None) -> bool:
    if path is None:
        return False
    try:
        with open(path, "rb") as fh:
            return bool(_USES.search(fh.read(_READ_CAP)))
    except OSError:
        return False


def choose(requested: bool | None, launch_args) -> tuple[bool, str]:
    """(in-job or not, the reason said at launch). ``requested``: True ``--in-job``,
    False ``--no-in-job``, None the default."""
    if requested is False:
        return False, "cold relaunch of the whole job (--no-in-job)"
    if requested is True:
        return True, "in-job: a failed rank is replaced by a warm spare, the others stay alive (--in-job)"
    low, _, high = str(launch_args.nnodes).partition(":")
    if high and low != high:
        return False, (f"cold relaunch (--nnodes {launch_args.nnodes}: in-job recovery needs a fixed number "
                       "of nodes)")
    if launch_args.no_python:
        return False, "cold relaunch (--no-python: in-job recovery needs a Python script)"
    path = script_file(launch_args)
    if not uses_inprocess(path):
        return False, (f"cold relaunch ({launch_args.training_script} does not call ckptstore.inprocess.run: "
                       "its ranks cannot live through a peer's failure; docs/training.md says how)")
    return True, ("in-job: a failed rank is replaced by a warm spare, the others stay alive (the script "
                  "calls ckptstore.inprocess.run; --no-in-job for cold relaunches)")
