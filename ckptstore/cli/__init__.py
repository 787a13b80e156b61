"""The ``ckptstore`` command (console script ``ckptstore.cli:main``; ``python -m
ckptstore.cli`` is the same command). One module per command group, the click group in
app.py, what they share in common.py."""

from .app import main
from .common import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from .convert import consolidate, export, import_
from .doctor_cmd import doctor, doctor_report, doctor_text
from .run import run_command
from .status import status as status_command
from .store_cmds import _locations, gc, ls, verify

__all__ = ["EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "consolidate", "doctor", "doctor_report", "doctor_text",
           "export", "gc", "import_", "ls", "main", "run_command", "status_command", "verify", "_locations"]
