"""``python -m ckptstore.cli``: the ``ckptstore`` command."""

from . import main

if __name__ == "__main__":  # pragma: no cover
    main()
