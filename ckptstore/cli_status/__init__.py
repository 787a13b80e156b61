"""Moved to ``ckptstore.cli.status`` (the ``ckptstore status`` command); this name stays
importable. A package rather than ``cli_status.py`` so that git pairs the old file with
cli/status.py as a rename at merges."""

from ..cli.status import _dur, _newest, _newest_of, _when, render, status  # noqa: F401
