"""Before the first launch of ``ckptstore run``: refuse a command line that cannot
work (a script that is not there, a supervisor option given where it goes to the
script), and say which detections are on for this script and why.

Pure over torchrun's parsed arguments and the policy, apart from looking the script up
on disk; the command line (cli/run.py) prints what these return.
"""

from __future__ import annotations

import math
import os
import shutil


def script_problem(launch_args) -> str | None:
    """Why the script of ``launch_args`` (torchrun's parsed arguments) cannot start, or
    None. A ``-m`` module is not looked up: importing its parents could run code."""
    script = launch_args.training_script
    if launch_args.module:
        return None
    if launch_args.no_python:
        if os.sep in script:
            ok = os.path.isfile(script) and os.access(script, os.X_OK)
        else:
            ok = shutil.which(script) is not None
        return None if ok else f"{script}: no such program (--no-python runs SCRIPT as a program)"
    if not os.path.exists(script):
        return f"{script}: no such file (the script is the first argument that is not an option)"
    if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        return f"{script}: a directory without __main__.py, not a script"
    return None


def misplaced(script_args: list[str], option_strings: set[str]) -> list[str]:
    """The supervisor's options that appear after SCRIPT, where they go to the script."""
    out = []
    for tok in script_args:
        name = tok.split("=", 1)[0]
        if name.startswith("--") and name.replace("_", "-") in option_strings and name not in out:
            out.append(name)
    return out


def detections(launch_args, policy) -> list[str]:
    """What the supervisor will see of this script, one line each (printed at launch)."""
    script = launch_args.training_script
    if launch_args.no_python:
        errors = ("errors: exit codes and signals only: --no-python runs a program, not a Python script "
                  "(its uncaught errors are recorded only if it writes TORCHELASTIC_ERROR_FILE itself)")
    else:
        errors = (f"errors: recorded for every rank: {script} runs under ckptstore's bootstrap, which writes "
                  "an uncaught exception to torchelastic's error file")
    off = [name for name, value in (("--hang-timeout", policy.hang_timeout_s),
                                    ("--first-progress-timeout", policy.first_progress_timeout_s))
           if not math.isfinite(value)]
    if len(off) == 2:
        hangs = "hangs: off (--hang-timeout and --first-progress-timeout are inf)"
    else:
        parts = []
        if math.isfinite(policy.first_progress_timeout_s):
            parts.append(f"no step {policy.first_progress_timeout_s:g}s after the launch")
        if math.isfinite(policy.hang_timeout_s):
            parts.append(f"no new step for {policy.hang_timeout_s:g}s")
        hangs = (f"hangs: {' or '.join(parts)}, judged only on ranks that report progress (a "
                 "ckptstore.Checkpointer does); a script that never reports is never killed as hung"
                 + (f" ({off[0]} is inf)" if off else ""))
    return [errors, hangs]
