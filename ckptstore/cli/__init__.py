"""The ``ckptstore`` command (console script ``ckptstore.cli:main``; ``python -m
ckptstore.cli`` is the same command). One module per command group; see app.py."""

from .app import (  # noqa: F401  (the names ckptstore.cli has always had)
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    _locations,
    consolidate,
    doctor,
    doctor_report,
    doctor_text,
    export,
    gc,
    import_,
    ls,
    main,
    run_command,
    status_command,
    verify,
)
