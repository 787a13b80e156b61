"""The restart supervisor behind ``ckptstore run``: journal, status, health, policy."""
