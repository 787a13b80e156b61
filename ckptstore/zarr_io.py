"""Checkpoints as zarr v3 hierarchies, through tensorstore (``ckptstore export --zarr``,
``ckptstore import``): every tensor of a checkpoint becomes one zarr v3 array, readable
by zarr-python, tensorstore and NumPy users, and a zarr v3 hierarchy becomes a
checkpoint.

Layout of an export (docs/interop.md): a group at DEST whose attributes hold, under
``"ckptstore"``, each array's state path (a list of dict keys and list indices), its
torch dtype and how it is stored, and the JSON-representable plain values of the state
(step counters, names); one array per tensor directly below DEST, named by its dotted
path (``model.layer.weight``, with ``%`` and ``/`` escaped). Shapes and dtypes are kept;
the chunk grid splits the first dimension the way ckptstore's own writer does (at most
``chunk_bytes`` a chunk); every chunk is zstd-compressed.

zarr v3's core data types have no bfloat16 or float8. By default they are widened,
exactly, to a core type every reader knows: bfloat16 to float32, the float8 types to
float16 (each of their values is a float16 value; a NaN comes back as a NaN, its payload
bits not kept). ``extension_types=True``
writes them as tensorstore's extension types of the same names instead (bit for bit,
smaller; tensorstore and ml_dtypes read them, zarr-python 3.1 cannot open them, nor list
a group holding one). The attributes record the torch dtype, so ``import`` restores it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint.flatten import plan_chunks
from .errors import CkptStoreError

ATTRIBUTE = "ckptstore"
LAYOUT_VERSION = 1

# torch dtype -> zarr v3 data type (core types, then tensorstore's extension types)
_ZARR_TYPES = {
    torch.bool: "bool", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
    torch.complex64: "complex64", torch.complex128: "complex128",
    torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz", torch.float8_e5m2fnuz: "float8_e5m2fnuz",
}
_TORCH_TYPES = {v: k for k, v in _ZARR_TYPES.items()}
_EXTENSION = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16}  # how an extension type's bits cross to NumPy
_WIDER = {torch.bfloat16: torch.float32, torch.float8_e4m3fn: torch.float16, torch.float8_e5m2: torch.float16,
          torch.float8_e4m3fnuz: torch.float16, torch.float8_e5m2fnuz: torch.float16}  # exact widenings


class InteropError(CkptStoreError):
    """A zarr hierarchy or a state that cannot cross between the two formats."""


def _tensorstore():
    try:
        import tensorstore
    except ImportError as e:
        raise InteropError("zarr export and import need tensorstore: pip install 'ckptstore[zarr]'") from e
    return tensorstore


@dataclass
class Report:
    arrays: dict[str, dict] = field(default_factory=dict)  # array name -> {"path", "dtype", "stored_as", "shape"}
    values: int = 0  # plain values kept in the attributes
    skipped: list[str] = field(default_factory=list)  # "path: why" of what did not cross
    bytes: int = 0


# ---------------------------------------------------------------------------- export
def array_name(path: list) -> str:
    """The array's node name: the dotted path, with ``%`` and ``/`` escaped (zarr node
    names may not hold ``/``) and never empty, ``.``, ``..``, ``zarr.json`` or
    ``__``-prefixed. An int dict key reads as its number."""
    name = ".".join(str(_key_of(p)).replace("%", "%25").replace("/", "%2F") for p in path) or "tensor"
    if name in (".", "..", "zarr.json") or name.startswith("__"):
        name = "%" + name.encode().hex()
    return name


def _key_of(component):
    """A path component: a str dict key, an int list index, or {"int": n} for an int
    dict key (optimizer states are keyed so)."""
    return component["int"] if isinstance(component, dict) else component


def _leaves(obj, path: list, out: list, seen: set) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if isinstance(obj, (dict, list, tuple)) and not obj:
        out.append((path, {} if isinstance(obj, dict) else []))  # an empty container is a value
    elif isinstance(obj, dict):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                out.append((path + [repr(k)], _Unkeyable(k)))
                continue
            _leaves(v, path + [k if isinstance(k, str) else {"int": k}], out, seen)
    elif isinstance(obj, (list, tuple)):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for i, v in enumerate(obj):
            _leaves(v, path + [i], out, seen)
    else:
        out.append((path, obj))


class _Unkeyable:
    """A dict entry whose key is neither str nor int: reported as skipped."""

    def __init__(self, key):
        self.key = key


def _numpy(t: torch.Tensor):
    """A NumPy view of CPU tensor ``t`` in the zarr data type's NumPy dtype."""
    import ml_dtypes  # (tensorstore's own dependency)
    import numpy as np

    t = t.detach().contiguous()
    zarr_type = _ZARR_TYPES[t.dtype]
    if zarr_type in _EXTENSION:
        bits = t.view(_SAME_WIDTH_INT[t.element_size()]).numpy()
        return bits.view(getattr(ml_dtypes, zarr_type))
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy().view(
            {2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()])
    return t.numpy()


def export_state(state: Any, dest: str, *, chunk_bytes: int = 16 << 20, extension_types: bool = False,
                 source: str = "", on_bytes=None) -> Report:
    """Write ``state`` (a loaded checkpoint) as a zarr v3 hierarchy at local path ``dest``,
    which must not exist (module docstring)."""
    ts = _tensorstore()
    os.makedirs(dest)  # refuses an existing path: an export never merges into another
    try:
        return _export(ts, state, dest, chunk_bytes, extension_types, source, on_bytes)
    except BaseException as e:
        import shutil

        shutil.rmtree(dest, ignore_errors=True)  # no half export left behind
        if isinstance(e, ValueError):  # tensorstore's error for anything it refuses
            raise InteropError(f"{dest}: {e}") from e
        raise


def _export(ts, state, dest: str, chunk_bytes: int, extension_types: bool, source: str, on_bytes) -> Report:
    report = Report()
    leaves: list = []
    _leaves(state, [], leaves, set())
    values = {}
    for path, leaf in leaves:
        where = array_name(path)
        if where in report.arrays or where in values:
            raise InteropError(f"{dest}: two state paths map to one name {where!r}")
        if not isinstance(leaf, torch.Tensor):
            if isinstance(leaf, _Unkeyable):
                report.skipped.append(f"{where}: a dict key of type {type(leaf.key).__name__} (only str and int)")
            elif leaf is None or leaf == {} or leaf == [] or isinstance(leaf, (bool, int, float, str)) and \
                    _json_safe(leaf):
                values[where] = {"path": path, "value": leaf}
            else:
                report.skipped.append(f"{where}: a {type(leaf).__name__} (only tensors and JSON values cross)")
            continue
        if leaf.layout != torch.strided or leaf.is_nested or leaf.dtype not in _ZARR_TYPES or leaf.is_quantized:
            report.skipped.append(f"{where}: a {leaf.dtype} {leaf.layout} tensor has no zarr v3 data type")
            continue
        t = leaf.detach().cpu()
        stored = t if extension_types or _ZARR_TYPES[t.dtype] not in _EXTENSION else t.to(_WIDER[t.dtype])
        zarr_type = _ZARR_TYPES[stored.dtype]
        shape = tuple(stored.shape)
        first = next(plan_chunks(shape, stored.element_size(), chunk_bytes), None)
        chunk = [max(1, s) for s in (first[1] if first else shape)]
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": os.path.join(dest, where)},
            "metadata": {
                "shape": list(shape), "data_type": zarr_type,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                           {"name": "zstd", "configuration": {"level": 3, "checksum": False}}],
            },
            "create": True,
        }
        array = ts.open(spec).result()
        if stored.numel():
            array.write(_numpy(stored)).result()
        report.arrays[where] = {"path": path, "dtype": str(t.dtype).removeprefix("torch."),
                                "stored_as": zarr_type, "shape": list(shape)}
        report.bytes += stored.numel() * stored.element_size()
        if on_bytes is not None:
            on_bytes(stored.numel() * stored.element_size())
    report.values = len(values)
    attributes = {ATTRIBUTE: {"layout_version": LAYOUT_VERSION, "source": source, "arrays": report.arrays,
                              "values": values, "skipped": report.skipped}}
    _write_json(os.path.join(dest, "zarr.json"),
                {"zarr_format": 3, "node_type": "group", "attributes": attributes})
    return report


def _json_safe(v) -> bool:
    return not (isinstance(v, float) and not math.isfinite(v))


def _write_json(path: str, doc: dict) -> None:
    with open(path, "x") as f:
        json.dump(doc, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------- import
def import_state(src: str) -> dict | list:
    """The state a zarr v3 hierarchy at local path ``src`` holds: an export's original
    nesting and torch dtypes, or for any other hierarchy one tensor per array, nested by
    the array's group path."""
    ts = _tensorstore()
    root = _read_json(os.path.join(src, "zarr.json"), src)
    if root.get("zarr_format") != 3:
        raise InteropError(f"{src}: not a zarr v3 node (zarr.json says zarr_format {root.get('zarr_format')!r})")
    ours = (root.get("attributes") or {}).get(ATTRIBUTE) if root.get("node_type") == "group" else None
    if ours is not None:
        if ours.get("layout_version") != LAYOUT_VERSION:
            raise InteropError(f"{src}: written by a newer ckptstore (layout {ours.get('layout_version')!r})")
        items = [(_path(spec, src), os.path.join(src, _own_name(name, spec, src)),
                  _torch_dtype(spec.get("dtype"), f"{src}/{name}"))
                 for name, spec in _mapping(ours.get("arrays", {}), src).items()]
        items += [(_path(v, src), None, v.get("value")) for v in _mapping(ours.get("values", {}), src).values()]
    else:
        items = [(rel.split("/") if rel else ["tensor"], os.path.join(src, rel), None)
                 for rel in _array_nodes(src)]
    out: list = []
    for path, where, extra in items:
        if where is None:
            out.append((path, extra))
            continue
        out.append((path, _read_array(ts, where, extra)))
    return _nest(out, src)


def _mapping(v, src: str) -> dict:
    if not isinstance(v, dict) or not all(isinstance(x, dict) for x in v.values()):
        raise InteropError(f"{src}: the ckptstore attributes are damaged (not a mapping of records)")
    return v


def _path(spec: dict, src: str) -> list:
    path = spec.get("path")
    if not isinstance(path, list) or not all(_component_ok(p) for p in path):
        raise InteropError(f"{src}: a state path that is not a list of keys and indices: {path!r}")
    return path


def _component_ok(p) -> bool:
    if isinstance(p, dict):
        return list(p) == ["int"] and type(p["int"]) is int
    return isinstance(p, (str, int)) and not isinstance(p, bool)


def _own_name(name: str, spec: dict, src: str) -> str:
    """An export names each array after its path (array_name): any other name (``..``,
    a nested or absolute one) would lead outside the hierarchy."""
    if name != array_name(_path(spec, src)):
        raise InteropError(f"{src}: array {name!r} is not named after its state path {spec.get('path')!r}")
    return name


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 26)
        doc = json.loads(data)
    except FileNotFoundError:
        raise InteropError(f"{what}: no zarr.json (not a zarr v3 hierarchy)") from None
    except (OSError, ValueError) as e:
        raise InteropError(f"{path}: unreadable zarr metadata: {e}") from e
    if not isinstance(doc, dict):
        raise InteropError(f"{path}: zarr metadata is not a JSON object")
    return doc


def _array_nodes(src: str) -> list[str]:
    """Relative paths of the arrays below ``src`` (a hierarchy zarr-python or another
    tool wrote), in sorted order; symlinks are not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        if "zarr.json" in filenames:
            doc = _read_json(os.path.join(dirpath, "zarr.json"), dirpath)
            if doc.get("node_type") == "array":
                rel = os.path.relpath(dirpath, src).replace(os.sep, "/")
                found.append("" if rel == "." else rel)
                dirnames.clear()
    return found


def _torch_dtype(name, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype not in _ZARR_TYPES:
        raise InteropError(f"{where}: unsupported torch dtype {name!r}")
    return dtype


# An array may state any shape in a few bytes of zarr.json, and chunks it lacks read as
# its fill value: one that states more than this many times the bytes it holds on disk
# (zstd's own bound on its ratio) is refused before anything is allocated.
MAX_EXPANSION = 32768


def _read_array(ts, where: str, dtype: torch.dtype | None) -> torch.Tensor:
    if os.path.islink(where) or not os.path.isdir(where):
        raise InteropError(f"{where}: not a directory of the hierarchy (a symlink is never followed)")
    try:
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": where}, "open": True}).result()
        stated = math.prod(array.shape) * array.dtype.numpy_dtype.itemsize
        held = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(where) for f in fs)
        if stated > MAX_EXPANSION * held + (1 << 20):
            raise InteropError(f"{where}: states {stated} bytes of data but holds {held} on disk; refused")
        data = array.read().result()
    except InteropError:
        raise
    except Exception as e:  # tensorstore raises ValueError for any bad metadata or chunk
        raise InteropError(f"{where}: cannot read the zarr array: {e}") from e
    stored = _TORCH_TYPES.get(str(data.dtype))
    if stored is None:
        raise InteropError(f"{where}: zarr data type {data.dtype} has no torch dtype")
    if str(data.dtype) in _EXTENSION:
        t = torch.from_numpy(data.view({1: "uint8", 2: "int16"}[data.dtype.itemsize]).copy()).view(stored)
    elif stored in (torch.uint16, torch.uint32, torch.uint64):
        t = torch.from_numpy(data.view({2: "int16", 4: "int32", 8: "int64"}[data.dtype.itemsize]).copy()).view(stored)
    else:
        t = torch.from_numpy(data.copy())
    if dtype is not None and dtype != t.dtype:
        if _WIDER.get(dtype) != t.dtype:
            raise InteropError(f"{where}: stored as {t.dtype}, the attributes say {dtype}")
        t = t.to(dtype)  # an export widened it: narrowing back is exact
    return t


def _nest(items: list, src: str):
    """Containers rebuilt from (path, value): int components are list indices."""
    if not items:
        return {}
    if any(not path for path, _ in items):
        if len(items) == 1:
            return items[0][1]
        raise InteropError(f"{src}: a value at the root beside others")
    groups: dict = {}
    for path, value in items:
        head = ("int", path[0]["int"]) if isinstance(path[0], dict) else path[0]
        groups.setdefault(head, []).append((path[1:], value))
    keys = list(groups)
    if all(type(k) is int for k in keys):
        if sorted(keys) != list(range(len(keys))):
            raise InteropError(f"{src}: list indices {sorted(keys)} are not 0..{len(keys) - 1}")
        return [_nest_one(groups[i], src) for i in range(len(keys))]
    if any(type(k) is int for k in keys):
        raise InteropError(f"{src}: list indices beside dict keys at one level")
    return {(k[1] if isinstance(k, tuple) else k): _nest_one(groups[k], src) for k in keys}


def _nest_one(items: list, src: str):
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    return _nest(items, src)


__all__ = ["InteropError", "Report", "array_name", "export_state", "import_state"]
