"""Random number generator state: capture, restore and re-derive for another rank.

A resumed run draws the same numbers as an uninterrupted one only if every generator
it uses comes back: Python's ``random``, NumPy's legacy global generator, torch's CPU
generator and each CUDA device's. :func:`rng_state` returns them as a dict that torch's
weights-only unpickler loads (str keys, tensors, ints, floats, None, lists, dicts; no
NumPy arrays), so it can sit in any checkpoint. Layout (version 1)::

    {"ckptstore_rng": 1, "rank": int,
     "python": {"version": 3, "state": int64[625], "gauss_next": float | None},
     "numpy": {"keys": int64[624], "pos": int, "has_gauss": int, "cached_gaussian": float} | None,
     "torch": uint8[N],
     "cuda": [uint8[M], ...] | None,                # one per device
     # only in re-derived states:
     "derived_from_rank": int, "cuda_seeds": [int, ...] | None}
"""

from __future__ import annotations

import random
import struct

import torch
import xxhash

try:
    import numpy as _np
except ImportError:  # NumPy is optional: its state is simply not captured
    _np = None

MARKER = "ckptstore_rng"
VERSION = 1
_REQUIRED = {MARKER, "rank", "python", "numpy", "torch", "cuda"}
_OPTIONAL = {"derived_from_rank", "cuda_seeds"}
_U32 = 2 ** 32


def _current_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _python_dict(pystate: tuple) -> dict:
    version, words, gauss_next = pystate
    return {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next}


def _numpy_dict(npstate: tuple) -> dict:
    _, keys, pos, has_gauss, cached = npstate
    return {"keys": torch.from_numpy(keys.astype(_np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached)}


def rng_state() -> dict:
    """Every generator's state, as plain data; never initialises CUDA."""
    # Only a CUDA that is already up has states worth saving; touching it otherwise would
    # start a context (and pick a device) behind the program's back. (is_initialized()
    # alone: is_available() would initialise the driver, cuInit, for a CPU-only job.)
    cuda_up = torch.cuda.is_initialized()
    return {MARKER: VERSION, "rank": _current_rank(),
            "python": _python_dict(random.getstate()),
            "numpy": _numpy_dict(_np.random.get_state()) if _np is not None else None,
            "torch": torch.get_rng_state(),
            "cuda": list(torch.cuda.get_rng_state_all()) if cuda_up else None}


def is_rng_state(obj) -> bool:
    return isinstance(obj, dict) and MARKER in obj


# ---- validation: everything is checked (and tried on scratch generators) before any global is set

def _int(value, field: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"rng state field {field!r}: expected an int, got {type(value).__name__}")
    if not lo <= value < hi:
        raise ValueError(f"rng state field {field!r}: {value} is outside [{lo}, {hi})")
    return value


def _float(value, field: str, optional: bool = False):
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"rng state field {field!r}: expected a float, got {type(value).__name__}")
    return float(value)


def _tensor(value, field: str, dtype: torch.dtype, numel: int | None = None, lo=None, hi=None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"rng state field {field!r}: expected a {dtype} tensor, got {got}")
    if value.layout != torch.strided or value.is_meta or value.dim() != 1 or value.numel() == 0 \
            or (numel is not None and value.numel() != numel):
        raise ValueError(f"rng state field {field!r}: expected a 1-D dense tensor of "
                         f"{numel or 'some'} elements, got shape {tuple(value.shape)}")
    value = value.detach().cpu().contiguous()  # a map_location may have moved it
    if lo is not None and (int(value.min()) < lo or int(value.max()) >= hi):
        raise ValueError(f"rng state field {field!r}: values outside [{lo}, {hi})")
    return value


def _fields(value, field: str, keys: set) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"rng state field {field!r}: expected a dict, got {type(value).__name__}")
    if set(value) != keys:
        raise ValueError(f"rng state field {field!r}: expected keys {sorted(keys)}, got {sorted(map(str, value))}")
    return value


def _try(field: str, apply) -> None:
    try:
        apply()
    except (RuntimeError, ValueError, TypeError, OverflowError, IndexError) as e:
        raise ValueError(f"rng state field {field!r}: refused: {e}") from e


def _parse(state) -> dict:
    """The checked, ready-to-apply form of ``state``; raises naming the first bad field."""
    if not isinstance(state, dict):
        raise TypeError(f"rng state: expected a dict, got {type(state).__name__}")
    if type(state.get(MARKER)) is not int or state[MARKER] != VERSION:
        raise ValueError(f"rng state field {MARKER!r}: expected {VERSION}, got {state.get(MARKER)!r}")
    unknown, missing = set(state) - _REQUIRED - _OPTIONAL, _REQUIRED - set(state)
    if unknown or missing:  # unknown fields are errors, never skipped (as in the manifest)
        raise ValueError(f"rng state fields: unknown {sorted(map(str, unknown))}, missing {sorted(missing)}")
    out = {"rank": _int(state["rank"], "rank", 0, 2 ** 31)}
    py = _fields(state["python"], "python", {"version", "state", "gauss_next"})
    words = _tensor(py["state"], "python.state", torch.int64, 625, 0, _U32)
    if int(words[-1]) > 624:  # the last word is the position in the 624-word key
        raise ValueError("rng state field 'python.state': position (last element) above 624")
    out["python"] = (_int(py["version"], "python.version", 3, 4), tuple(words.tolist()),
                     _float(py["gauss_next"], "python.gauss_next", optional=True))
    _try("python", lambda: random.Random().setstate(out["python"]))
    out["numpy"] = out["numpy_keys"] = None
    if state["numpy"] is not None:
        np_ = _fields(state["numpy"], "numpy", {"keys", "pos", "has_gauss", "cached_gaussian"})
        keys = out["numpy_keys"] = _tensor(np_["keys"], "numpy.keys", torch.int64, 624, 0, _U32)
        rest = (_int(np_["pos"], "numpy.pos", 0, 625), _int(np_["has_gauss"], "numpy.has_gauss", 0, 2),
                _float(np_["cached_gaussian"], "numpy.cached_gaussian"))
        if _np is not None:  # without NumPy there is nothing to restore it into
            out["numpy"] = ("MT19937", keys.numpy().astype(_np.uint32)) + rest
            _try("numpy", lambda: _np.random.RandomState().set_state(out["numpy"]))
    out["torch"] = _tensor(state["torch"], "torch", torch.uint8)
    _try("torch", lambda: torch.Generator().set_state(out["torch"]))
    cuda, seeds = state["cuda"], state.get("cuda_seeds")
    if cuda is not None and seeds is not None:
        raise ValueError("rng state field 'cuda_seeds': set together with 'cuda'")
    for name, items in (("cuda", cuda), ("cuda_seeds", seeds)):
        if items is not None and not isinstance(items, (list, tuple)):
            raise TypeError(f"rng state field {name!r}: expected a list, got {type(items).__name__}")
    out["cuda"] = None if cuda is None else [_tensor(t, f"cuda[{i}]", torch.uint8) for i, t in enumerate(cuda)]
    out["cuda_seeds"] = None if seeds is None else [_int(s, f"cuda_seeds[{i}]", 0, 2 ** 64)
                                                    for i, s in enumerate(seeds)]
    if "derived_from_rank" in state:
        _int(state["derived_from_rank"], "derived_from_rank", 0, 2 ** 31)
    return out


def _words(ints) -> bytes:
    return struct.pack(f"<{len(ints)}q", *ints)  # fixed byte order, no NumPy needed


def rederive(state: dict, rank: int) -> dict:
    """A fresh state for ``rank``, deterministic in (``state``, ``rank``).

    Used when a rank reads another rank's saved state (resume on another world size):
    restoring it verbatim would give two ranks the same stream, so each gets generators
    seeded from a hash of the saved states and its own rank. ``state`` is not modified.
    """
    p = _parse(state)
    rank = _int(rank, "rank", 0, 2 ** 31)
    h = xxhash.xxh3_64()
    h.update(bytes(p["torch"].tolist()))
    h.update(_words(p["python"][1]))
    keys = p["numpy_keys"]
    h.update(b"-" if keys is None else b"N" + _words(keys.tolist()))
    h.update(struct.pack("<q", rank))
    base = h.intdigest()

    def seed(label: str) -> int:  # one independent 64-bit seed per generator
        return xxhash.xxh3_64_intdigest(label.encode(), seed=base)

    n_cuda = len(p["cuda"] or p["cuda_seeds"] or [])
    s_np = seed("numpy")
    return {MARKER: VERSION, "rank": rank, "derived_from_rank": p["rank"],
            "python": _python_dict(random.Random(seed("python")).getstate()),
            "numpy": (_numpy_dict(_np.random.RandomState([s_np % _U32, s_np // _U32]).get_state())
                      if keys is not None and _np is not None else None),
            "torch": torch.Generator().manual_seed(seed("torch")).get_state(),
            # A CUDA generator's state cannot be built without CUDA: keep a seed per device.
            "cuda": None, "cuda_seeds": [seed(f"cuda{i}") for i in range(n_cuda)] if n_cuda else None}


def set_rng_state(state: dict, *, rank: int | None = None) -> bool:
    """Restore every generator from ``state``; True when it was re-derived for ``rank``.

    ``rank`` defaults to this process's torch.distributed rank (0 without it). A state
    saved by another rank is re-derived (:func:`rederive`) rather than restored verbatim.
    CUDA states go to the devices present; without CUDA (or NumPy) they are skipped.
    Invalid input raises ValueError/TypeError naming the field, with nothing restored.
    """
    p = _parse(state)
    rank = _current_rank() if rank is None else _int(rank, "rank", 0, 2 ** 31)
    derived = p["rank"] != rank
    if derived:
        p = _parse(rederive(state, rank))
    random.setstate(p["python"])
    if p["numpy"] is not None:
        _np.random.set_state(p["numpy"])
    torch.set_rng_state(p["torch"])
    if torch.cuda.is_available():  # a GPU checkpoint loaded on a CPU machine: skip CUDA
        n = torch.cuda.device_count()
        for i, t in enumerate((p["cuda"] or [])[:n]):
            torch.cuda.set_rng_state(t, i)  # queued until CUDA starts, if it has not yet
        if p["cuda_seeds"]:
            torch.cuda.init()  # per-device seeding has no lazy form; this state is for a GPU job
            for i, s in enumerate(p["cuda_seeds"][:n]):
                torch.cuda.default_generators[i].manual_seed(s)
    return derived
