"""Text read from a store or a journal, made safe to print on a terminal."""

from __future__ import annotations

__all__ = ["printable"]


def printable(text) -> str:
    """Untrusted text (names, metrics, reasons read from a store) for a terminal: control
    characters escaped (a newline cannot forge a row, an escape sequence cannot redraw
    the screen), and so are lone surrogates (a name that is not UTF-8), which the
    terminal's encoding would refuse."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
