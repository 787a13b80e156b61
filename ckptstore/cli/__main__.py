"""``python -m ckptstore.cli``: the ``ckptstore`` command."""

from ..supervisor.quick_exit import skip_final_collections
from . import main

if __name__ == "__main__":  # pragma: no cover
    try:
        main()
    finally:  # (click ends main with SystemExit) the supervisor's exit, a second sooner
        skip_final_collections()
