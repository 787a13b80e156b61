"""The storage format: the manifest and vote schema, stored names, and their validation.

Pure data: frozen dataclasses with JSON in and out. No I/O happens here; see
``docs/format.md`` for the rules (I1-I7) these types encode.

This module is the face of the package: every name callers use is here
(``from ckptstore import format as fmt``; ``fmt.Manifest``). The modules behind it, each
importing only those above it in this list (and ``errors``, ``names``, ``config``, ``_gc``):

| module | owns |
|---|---|
| ``constants.py`` | ``FORMAT_NAME``, the versions written and read, the size caps |
| ``dtypes.py`` | canonical dtype names, the dtypes torch pickles typed (the one module importing torch) |
| ``strict.py`` | strict, bounded JSON in: ``loads_json``, field, type and int checks, lazy record names; stored times |
| ``records.py`` | ``Blob``, ``Chunk``, ``TensorEntry``, ``RankState``, ``ReplicaHash``, codec chains |
| ``text.py`` | the records' stored JSON text, written directly |
| ``coverage.py`` | coverage geometry: ``validate_coverage``, ``validate_chunks``, ``check_exact_cover`` |
| ``validation.py`` | checkpoint-wide rules: ``validate_ranks``, ``validate_references``, ``validate_extents`` |
| ``head.py`` | the members a manifest or vote has in every version, and the header check |
| ``index.py`` | version 4's records: a rank's ``Index``, its table, its vote's ``Summary``, ``Reads``, ``GlobalEntry`` |
| ``v3.py`` | versions 1 to 3: votes and manifests that hold every record, in and out |
| ``v4.py`` | version 4: votes naming an index, the root manifest, in and out |
| ``documents.py`` | ``Vote`` and ``Manifest``, dispatching JSON in and out by version to ``v3`` / ``v4`` |
"""

from __future__ import annotations

from ..errors import FormatError, UnsupportedVersionError
# Stored names live in ``names``; re-exported here for the callers that know them as format's.
from ..names import (
    ATTEMPTS_DIR,
    MAX_GENERATION,
    MAX_STEP,
    MAX_WORLD_SIZE,
    abort_name,
    attempt_dir,
    check_attempt_id,
    check_data_file,
    check_relative_name,
    data_file_name,
    is_attempt_id,
    manifest_name,
    new_attempt_id,
    parse_data_file,
    parse_manifest_name,
    parse_step_dir_name,
    step_dir_name,
    vote_name,
)
from .constants import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_VERSION,
    MAX_BYTES,
    MAX_MARKER_BYTES,
    MAX_NDIM,
    READ_VERSIONS,
    REFERENCE_VERSION,
    ZSTD_MAX_RATIO,
    max_manifest_bytes,
)
from .coverage import check_exact_cover, validate_chunks, validate_coverage
from .documents import IncompleteManifestError, Manifest, Vote
from .dtypes import TYPED_STORAGE_DTYPES, dtype_from_name, dtype_name, itemsize
from .index import (
    FINGERPRINT_MODULUS,
    INDEX_CODEC,
    INDEX_STREAM,
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
from .records import Blob, Chunk, RankState, ReplicaHash, TensorEntry
from .strict import loads_json, parse_time, utc_now
from .validation import validate_extents, validate_ranks, validate_references

__all__ = [
    # errors
    "FormatError", "IncompleteManifestError", "UnsupportedVersionError",
    # versions and caps
    "FORMAT_NAME", "FORMAT_VERSION", "READ_VERSIONS", "REFERENCE_VERSION",
    "MAX_BYTES", "MAX_MARKER_BYTES", "MAX_NDIM", "ZSTD_MAX_RATIO", "max_manifest_bytes",
    # stored names (names.py)
    "ATTEMPTS_DIR", "MAX_GENERATION", "MAX_STEP", "MAX_WORLD_SIZE", "abort_name", "attempt_dir",
    "check_attempt_id", "check_data_file", "check_relative_name", "data_file_name", "is_attempt_id",
    "manifest_name", "new_attempt_id", "parse_data_file", "parse_manifest_name", "parse_step_dir_name",
    "step_dir_name", "vote_name",
    # dtypes, JSON, times
    "TYPED_STORAGE_DTYPES", "dtype_from_name", "dtype_name", "itemsize", "loads_json", "parse_time", "utc_now",
    # records and documents
    "Blob", "Chunk", "RankState", "ReplicaHash", "TensorEntry", "Vote", "Manifest",
    # validation
    "check_exact_cover", "validate_chunks", "validate_coverage", "validate_extents", "validate_ranks",
    "validate_references",
    # version 4
    "FINGERPRINT_MODULUS", "INDEX_CODEC", "INDEX_STREAM", "INDEX_VERSION", "GlobalEntry", "Index", "Reads",
    "Summary", "check_cap", "in_ranges", "index_blob", "parse_table", "rank_ranges", "ranges_ranks", "table_bytes",
]
