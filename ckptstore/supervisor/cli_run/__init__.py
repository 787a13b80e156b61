"""Moved to ``ckptstore.cli.run`` (the ``ckptstore run`` command line); this name stays
importable. A package rather than ``cli_run.py`` so that git pairs the old file with
cli/run.py as a rename at merges."""

from ...cli.run import _parser, _Refused, run_command, split_argv  # noqa: F401
