"""Finding the tensors in a nested object: the one walk that ``prepare`` (the bytes of a
state's tensors, warmup.py), the Checkpointer (whether a template holds DTensors) and a
load (the tensors of an unpickled object, to check and place: restore.py) use."""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping

import torch

# Values that hold no tensor and are not walked into
_ATOMS = (str, bytes, int, float, bool, type, types.ModuleType)


def tensors_in(obj, *, attributes: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor in nested mappings, lists and tuples; with ``attributes`` (an
    unpickled object, which may hold anything) also in sets and frozensets and in other
    objects' attributes (``__dict__``), where a mapping that is not a dict counts as an
    object. A tensor reached twice comes twice. Each container or object is walked
    once, without recursion: a state that holds itself, shares one list many times or
    nests deeper than Python's stack is walked in time linear in its distinct objects
    (pickle saves all of those)."""
    stack, seen = [obj], set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            yield o
            continue
        if o is None or isinstance(o, _ATOMS) or id(o) in seen:
            continue
        if isinstance(o, dict) or (not attributes and isinstance(o, Mapping)):
            seen.add(id(o))
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)) or (attributes and isinstance(o, (set, frozenset))):
            seen.add(id(o))
            stack.extend(o)
        elif attributes:
            seen.add(id(o))
            attrs = getattr(o, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend(attrs.values())


__all__ = ["tensors_in"]
