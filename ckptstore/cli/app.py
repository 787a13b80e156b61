"""The ``ckptstore`` command: the click group ``main`` (the console script) and its
commands, one module per group: store_cmds.py (ls, verify, gc), convert.py
(consolidate, export, import), doctor_cmd.py (doctor), status.py (status), run.py (run,
the supervisor's command line). What they share (exit codes, ``_fail``, opening a
store, JSON, tables, progress) is common.py, which imports none of them."""

from __future__ import annotations

import click

from .._version import __version__
from .convert import consolidate, export, import_
from .doctor_cmd import doctor
from .run import run_command
from .status import status as status_command
from .store_cmds import gc, ls, verify


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptstore")
def main() -> None:
    """Inspect, verify and clean up ckptstore checkpoints (local paths or URLs)."""


for _command in (ls, verify, gc, consolidate, export, import_, doctor, run_command, status_command):
    main.add_command(_command)

if __name__ == "__main__":  # pragma: no cover
    main()
