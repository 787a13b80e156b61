"""The stored JSON text of records, written directly: a manifest, vote or index holds
one chunk record per chunk, so these build their text without a dict each (byte for
byte what ``json.dumps`` of the records' ``to_json`` gives, compact)."""

from __future__ import annotations

import json
from typing import Mapping

from .records import Blob, RankState, TensorEntry

COMPACT = dict(separators=(",", ":"), allow_nan=False)  # json.dumps(..., **COMPACT): the stored text


def _ints(values) -> str:
    return ",".join([str(int(v)) for v in values])


def _blob_fields(b: Blob, names: dict[str, str]) -> str:
    """A blob's JSON members, as Blob.to_json gives them, without the braces."""
    file = names.get(b.file)
    if file is None:
        file = names[b.file] = json.dumps(b.file)
    codec = "[]" if not b.codec else json.dumps([dict(c) for c in b.codec], **COMPACT)
    step = "" if b.step is None else f',"step":{int(b.step)}'
    if b.earlier:
        step += ',"earlier":true'
    return (f'"file":{file},"offset":{int(b.offset)},"length":{int(b.length)},"raw_length":{int(b.raw_length)},'
            f'"codec":{codec},"xxh3_128":{json.dumps(b.xxh3_128)}{step}')


def entries_text(entries: Mapping[str, TensorEntry], names: dict[str, str]) -> str:
    """``json.dumps(entries_json(entries))``, compact, written directly."""
    parts = []
    for key, e in entries.items():
        chunks = ",".join([f'{{"offsets":[{_ints(c.offsets)}],"sizes":[{_ints(c.sizes)}],{_blob_fields(c.blob, names)}}}'
                           for c in e.chunks])
        parts.append(f'{json.dumps(key)}:{{"dtype":{json.dumps(e.dtype)},"shape":[{_ints(e.shape)}],"chunks":[{chunks}]}}')
    return "{" + ",".join(parts) + "}"


def rank_text(r: RankState, names: dict[str, str]) -> str:
    return f'{{"rank":{int(r.rank)},"skeleton":{{{_blob_fields(r.skeleton, names)}}},"tensors":{entries_text(r.tensors, names)}}}'


def entries_json(entries: Mapping[str, TensorEntry]) -> dict:
    return {k: v.to_json() for k, v in entries.items()}

