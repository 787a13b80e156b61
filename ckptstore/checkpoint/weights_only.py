"""Will the default load rebuild this? Checked while the skeleton is pickled.

``load`` defaults to ``weights_only=True``: torch's weights-only unpickler rebuilds only
its allow-list of globals (``_get_allowed_globals()`` plus what the user registered
with ``torch.serialization.add_safe_globals``). Anything else saves fine and is refused
at resume time. :class:`WeightsOnlyAudit` finds such objects during the save, from the
pickler's ``reducer_override`` hook, and :meth:`WeightsOnlyAudit.warn` reports them once
per save with :class:`~ckptstore.errors.UnsafeForWeightsOnlyWarning`.

Why the hook sees enough: the unpickler refuses a pickle when a GLOBAL names something
outside the allow-list, when NEWOBJ/REDUCE calls a class or function outside it, when
BUILD/APPENDS/SETITEMS target a type it does not allow, or on an opcode it does not
read. Every global the pickler writes is an object it pickles (a class, a function, or
an object whose reduction is a name), and the C pickler calls the hook for every
object but exact None/bool/int/float/bytes/str/bytearray/dict/list/tuple/set/frozenset
instances, which it writes itself; their own reductions (``b""`` to ``builtins.bytes``,
a frozenset to ``builtins.frozenset``) pickle those classes, which the hook sees. The
hook sees each distinct object once (the pickler's memo does the rest), and tensors,
OrderedDicts and plain values leave it after one set look-up: no per-tensor cost
beyond that. Opcodes are checked only for a protocol other than 2 (torch's default
and ours), which the unpickler was not written for: protocol 3 differs from 2 only in
writing bytes (flatten reports those: :attr:`WeightsOnlyAudit.watches_bytes`), 4 and
5 frame their first opcode.
Not seen: ints beyond 2**2040 (LONG4) and copyreg extension codes; neither occurs in
training state.
"""

from __future__ import annotations

import copyreg
import os
import pickle
import pickletools
import re
import sys
import types
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass
from itertools import chain

import torch

from ..errors import UnsafeForWeightsOnlyWarning

# Types whose instances the pickler writes itself, or that reduce only to allowed
# globals; what they hold is pickled, and so checked, on its own. By id: a type's
# hash may be user code (a metaclass), an id never is.
AS_IS = frozenset(map(id, (
    type(None), bool, int, float, complex, str, bytes, bytearray, dict, list, tuple, set, frozenset,
    pickle.PickleBuffer, OrderedDict, Counter, torch.Tensor, torch.nn.Parameter, torch.Size, torch.device,
)))

# The opcodes torch._weights_only_unpickler.Unpickler.load reads (protocol 2's, less some).
_READABLE_OPCODES = frozenset((
    "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT",
    "EMPTY_SET", "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINPERSID",
    "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1", "PROTO", "STOP",
))

_BUILDS = (torch.Tensor, torch.nn.Parameter, OrderedDict)  # BUILD targets allowed besides allow-listed types
_SETS_ITEMS = (dict, OrderedDict, Counter)  # SETITEMS targets
_SHOWN = 5  # names listed in the message; the rest are counted
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class AllowList:
    """The weights-only unpickler's allow-list, in the forms the checks need."""

    names: frozenset[str]  # module.qualname a GLOBAL may name
    named_ids: frozenset[int]  # ids of objects whose own pickled name is allowed
    callable_ids: frozenset[int]  # ids of what NEWOBJ/REDUCE may call and BUILD may target
    blocked_modules: frozenset[str]  # refused even when registered


_cache: tuple[frozenset, AllowList] | None = None


def allow_list() -> AllowList | None:
    """The current allow-list; rebuilt only when the user's safe globals changed.
    None when this torch lacks the API (then nothing is checked)."""
    global _cache
    try:
        import torch._weights_only_unpickler as wo

        user = frozenset(torch.serialization.get_safe_globals())
        cached = _cache
        if cached is not None and cached[0] == user:
            return cached[1]
        base = wo._get_allowed_globals()  # lru-cached by torch: fixed per process
        blocked = frozenset(wo._blocklisted_modules)
    except Exception:  # a torch without these internals: check nothing rather than fail saves
        return None
    names, named, callables = set(base), {id(v) for v in base.values()}, {id(v) for v in base.values()}
    for entry in user:
        if isinstance(entry, tuple):
            if len(entry) != 2 or not isinstance(entry[1], str):
                continue  # torch's load raises on these itself
            f, name = entry
            names.add(name)  # the name is what a GLOBAL must spell; the object's own may differ
        else:
            f, name = entry, f"{getattr(entry, '__module__', None)}.{getattr(entry, '__qualname__', None)}"
            names.add(name)
            named.add(id(f))
        callables.add(id(f))
    allowed = AllowList(frozenset(names), frozenset(named), frozenset(callables), blocked)
    _cache = (user, allowed)
    return allowed


class WeightsOnlyAudit:
    """What one save holds that the default load will refuse. Call :meth:`reduce` from
    the pickler's ``reducer_override`` for objects outside :data:`AS_IS`, then :meth:`warn`
    with the finished pickle."""

    def __init__(self, protocol: int, enabled: bool = True):
        # (a protocol that is no int: the pickler itself refuses it)
        self.protocol = pickle.HIGHEST_PROTOCOL if isinstance(protocol, int) and protocol < 0 else protocol
        self.allowed = allow_list() if enabled else None  # (None: nothing noted, nothing warned)
        self.types: dict[str, int] = {}  # refused instances: type name -> count
        self.globals: dict[str, None] = {}  # refused global names, in order met
        # Protocol 3 writes bytes with opcodes the unpickler does not read, and the C
        # pickler writes bytes without calling reducer_override: the pickler's
        # persistent_id, which sees every object, must call note_bytes().
        self.watches_bytes = self.protocol == 3 and self.allowed is not None
        self.wrote_bytes = False

    def note_bytes(self) -> None:
        self.wrote_bytes = True

    def reduce(self, pickler, o):
        """The reduction the pickler would make of ``o`` (or NotImplemented: let it
        make its own), noting what the unpickler will refuse. Reducing here, once,
        and handing the result back costs no second ``__reduce_ex__`` call."""
        allowed = self.allowed
        if allowed is None or id(o) in allowed.named_ids:
            return NotImplemented
        t = type(o)
        if t is type or t is types.FunctionType:  # pickled by name, before any dispatch table
            self._check_global(o)
            return NotImplemented
        # The pickler's own order: dispatch table, classes by name, then __reduce_ex__.
        reducer = getattr(pickler, "dispatch_table", copyreg.dispatch_table).get(t)
        if reducer is None and issubclass(t, type):
            self._check_global(o)
            return NotImplemented
        rv = reducer(o) if reducer is not None else o.__reduce_ex__(self.protocol)
        try:
            if isinstance(rv, str):
                self._check_global(o, rv)
            elif isinstance(rv, tuple) and len(rv) >= 2:
                ok, rv = self._rebuilds(rv)
                if not ok:
                    name = _name(t)
                    self.types[name] = self.types.get(name, 0) + 1
        except Exception:  # our bookkeeping must never fail a save the pickler would make
            pass
        return rv

    def _check_global(self, o, name: str | None = None) -> None:
        allowed = self.allowed
        if id(o) in allowed.named_ids:
            return
        module, qualname = _global_name(o, name)
        full = f"{module}.{qualname}"
        if full not in allowed.names or module in allowed.blocked_modules:
            self.globals.setdefault(full)

    def _rebuilds(self, rv: tuple) -> tuple[bool, tuple]:
        """Whether the unpickler will run this reduction, and the reduction (its item
        iterators re-made if peeked at). The callable and classes it names are checked
        as globals when the pickler writes them; this checks what is done with them."""
        func, args = rv[0], rv[1]
        kind = getattr(func, "__name__", None) if self.protocol >= 2 else None
        callable_ids = self.allowed.callable_ids
        if kind == "__newobj_ex__":
            return False, rv  # protocol 2-3 writes functools.partial; 4+ NEWOBJ_EX: neither is read
        if kind == "__newobj__":  # NEWOBJ of args[0]
            target = args[0] if isinstance(args, tuple) and args else None
            ok = target is torch.nn.Parameter or id(target) in callable_ids
        else:  # REDUCE: the callable; the instance's type is known when it is a class
            target = func if isinstance(func, type) else None
            ok = id(func) in callable_ids
        if len(rv) > 5 and rv[5] is not None:
            ok = False  # a state setter is written as REDUCE then POP; POP is not read
        if ok and len(rv) > 2 and rv[2] is not None and target is not None:
            ok = target in _BUILDS or id(target) in callable_ids
        if ok and len(rv) > 3 and rv[3] is not None:
            empty, items = _peek(rv[3])
            rv = rv[:3] + (items,) + rv[4:]
            ok = empty or target is list
        if ok and len(rv) > 4 and rv[4] is not None:
            empty, items = _peek(rv[4])
            rv = rv[:4] + (items,) + rv[5:]
            ok = empty or target in _SETS_ITEMS
        return ok, rv

    def warn(self, skeleton: bytes) -> None:
        """Warn once, at the caller's ``save`` line, if the default load will refuse
        ``skeleton``. Raises the warning when a filter makes it an error."""
        if self.allowed is None:
            return
        if self.protocol == 2:
            opcode = None
        elif self.protocol == 3:
            opcode = "BINBYTES" if self.wrote_bytes else None
        else:
            opcode = _unreadable_opcode(skeleton)
        if not (self.types or self.globals or opcode):
            return
        parts = []
        if self.types:
            parts.append("it holds objects of type " + _listing([f"{n} (x{c})" for n, c in self.types.items()]))
        if self.globals:
            parts.append("its pickle names globals outside torch's allow-list: " + _listing(list(self.globals)))
        if opcode:
            parts.append(f"pickle_protocol={self.protocol} wrote opcode {opcode}, which the weights-only unpickler "
                         "does not read (use pickle_protocol=2, the default)")
        advice = (" Convert those objects to tensors or plain Python values, register them with "
                  "torch.serialization.add_safe_globals([...]) (when saving and loading), or load with "
                  "weights_only=False if you trust the source." if self.types or self.globals else "")
        message = ("the default load (weights_only=True) will refuse this checkpoint with UnsafeLoadError: "
                   + "; ".join(parts) + "." + advice + " warnings.simplefilter(\"error\", "
                   "ckptstore.UnsafeForWeightsOnlyWarning) makes such a save raise instead.")
        warnings.warn(UnsafeForWeightsOnlyWarning(message, dict(self.types), tuple(self.globals)),
                      stacklevel=_caller_stacklevel())


def _peek(items):
    """(is the iterator empty, an iterator yielding the same items)."""
    it = iter(items)
    first = next(it, _peek)
    return (True, iter(())) if first is _peek else (False, chain((first,), it))


def _global_name(o, name: str | None = None) -> tuple[str, str]:
    """(module, qualname) as the pickler writes them for ``o``."""
    qualname = name or getattr(o, "__qualname__", None) or getattr(o, "__name__", None) or "?"
    module = getattr(o, "__module__", None)
    if module is None:
        module = pickle.whichmodule(o, qualname)
    return module, qualname


def _name(t: type) -> str:
    return "{}.{}".format(*_global_name(t))


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _unreadable_opcode(skeleton: bytes) -> str | None:
    """The first opcode the weights-only unpickler does not read, if any: a walk, for
    protocols 0, 1, 4 and 5, which in practice ends early (4 and 5 at the second
    opcode, FRAME; 0 and 1 at the first bool or dict)."""
    try:
        for op, _arg, _pos in pickletools.genops(skeleton):
            if op.name not in _READABLE_OPCODES:
                return op.name
    except Exception:  # not a pickle we can walk: say nothing rather than guess
        return None
    return None


def _caller_stacklevel() -> int:
    """The stacklevel that makes a warning point at the first frame outside this
    package: the user's ``save`` line, however many package frames lie between."""
    frame, level = sys._getframe(1), 1  # level 1: the frame that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level



# --------------------------------------------------------------------------- load side
_TRUE = ("1", "y", "yes", "true")
# torch's unpickler named what it refused (a global, a blocked module, a type to import)
_NAMED_REFUSAL = re.compile(r"GLOBAL \S+ was not an allowed global|whose module \S+ is blocked|\S+ must be \S+ to load")


def resolve_weights_only(weights_only: bool | None, pickle_module) -> tuple[bool, object]:
    """(weights_only, pickle_module) by torch.load's rules: the default is True unless a
    ``pickle_module`` is given; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces True, and
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` forces False where the caller passed nothing
    (with torch's warning); True with a ``pickle_module`` is torch's RuntimeError."""
    unset = weights_only is None
    if unset:
        weights_only = pickle_module is None
    force = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    force_no = os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    if force and force_no:
        raise RuntimeError("Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` "
                           "should be set, but both were set.")
    if force:
        weights_only = True
    elif force_no and unset:
        warnings.warn("Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected: the `weights_only` "
                      "argument was not passed to load, so weights_only=False.", UserWarning, stacklevel=3)
        weights_only = False
    if weights_only and pickle_module is not None:
        raise RuntimeError("Can not safely load weights when explicit pickle_module is specified")
    return weights_only, (pickle_module if weights_only else pickle_module or pickle)


def weights_only_refusal(error: BaseException) -> str:
    """The message of a load that weights_only=True refused: torch.load's opening words
    (code written for torch.load matches on them), the unpickler's own, and the way out."""
    text = str(error)
    way_out = ("Load it with weights_only=False only if you trust its source, or allow the type with "
               "torch.serialization.add_safe_globals([...]).")
    if _NAMED_REFUSAL.search(text):
        return f"Weights only load failed: weights_only=True refused this checkpoint. {text} {way_out}"
    return ("Weights only load failed: weights_only=True refused this checkpoint (torch's weights-only unpickler "
            "does not read it). If it holds only tensors and torch's own types, please file an issue with the "
            "following so that we can make `weights_only=True` compatible with your use case (PyTorch's issue "
            f"tracker: the unpickler is torch's): WeightsUnpickler error: {text}. {way_out}")


__all__ = ["AS_IS", "AllowList", "WeightsOnlyAudit", "allow_list", "resolve_weights_only", "weights_only_refusal"]
