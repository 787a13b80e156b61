"""Compatibility shim: format version 4's records now live in the ``ckptstore.format``
package (``format/index.py``, the root's members in ``format/v4.py``). Nothing in
ckptstore imports this module; it keeps ``ckptstore.format_index`` importable for code
outside it."""

from .errors import FormatError
from .format.index import (
    FINGERPRINT_MODULUS,
    INDEX_CODEC,
    INDEX_STREAM,
    INDEX_VERSION,
    GlobalEntry,
    Index,
    Reads,
    Summary,
    check_cap,
    in_ranges,
    index_blob,
    parse_table,
    rank_ranges,
    ranges_ranks,
    table_bytes,
)
from .format.v4 import ROOT_FIELDS, parse_root, root_text

__all__ = ["FINGERPRINT_MODULUS", "INDEX_CODEC", "INDEX_STREAM", "INDEX_VERSION", "ROOT_FIELDS", "FormatError",
           "GlobalEntry", "Index", "Reads", "Summary", "check_cap", "in_ranges", "index_blob", "parse_root",
           "parse_table", "rank_ranges", "ranges_ranks", "root_text", "table_bytes"]
