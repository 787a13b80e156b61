"""The exception tree of ckptstore.

Every error the package raises on purpose derives from :class:`CkptStoreError`.
Branches also derive from the builtin a caller would expect (``FileNotFoundError``
for a missing checkpoint, ``PermissionError`` for denied access, ...), so code written
for ``torch.load`` keeps catching what it caught before. Errors wrap their cause with
``raise ... from``; messages name the checkpoint and, where it applies, the tensor key
and the file.
"""

import pickle


class CkptStoreError(Exception):
    """Base class of every error raised by ckptstore."""


# --- storage -------------------------------------------------------------------------
class StorageError(CkptStoreError):
    """A byte store failed to read, write, list or delete."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """A key (file or object) does not exist in the store."""


class TruncatedObjectError(StorageError):
    """An object ends before the byte range asked for (a short read)."""


class AlreadyExistsError(StorageError, FileExistsError):
    """A create-only write found the key already there."""


class StoragePermissionError(StorageError, PermissionError):
    """The store refused access (permissions, credentials)."""


class NotRegularObjectError(StorageError):
    """A key names a symlink, FIFO, device or directory where a regular object belongs:
    never followed, opened or deleted through (it is reported as debris instead)."""


class ObjectTooLargeError(StorageError):
    """A whole-object read with a ``limit`` found a larger object: refused unread."""


class StorageFullError(StorageError):
    """The store has no space left."""


class TransientStorageError(StorageError):
    """A fault worth retrying (throttling, 5xx, reset); raised once retries ran out."""


# --- checkpoints -----------------------------------------------------------------------
class CheckpointNotFoundError(CkptStoreError, FileNotFoundError):
    """Nothing exists at the given path or URL."""


class FormatError(CkptStoreError, ValueError):
    """Stored metadata is malformed, unknown or unsafe."""


class NotACheckpointError(FormatError):
    """The path exists but holds no ckptstore checkpoint (and no torch.save file)."""


class UnsupportedVersionError(FormatError):
    """The manifest was written by an unknown format version."""


class NotCommittedError(CkptStoreError):
    """A checkpoint location holds attempts but no committed manifest."""


class IntegrityError(CkptStoreError):
    """Stored bytes do not match their recorded length or xxh3-128 hash."""


class SerializationError(CkptStoreError, TypeError):
    """An object cannot be saved (unsupported type or unpicklable)."""


class UnsafeLoadError(CkptStoreError, pickle.UnpicklingError):
    """``weights_only=True`` refused a pickle that would run code."""


# --- commit ----------------------------------------------------------------------------
class CommitError(CkptStoreError):
    """The two-phase commit did not commit this save."""


class CommitTimeoutError(CommitError, TimeoutError):
    """Not every rank voted (or no manifest appeared) within the commit timeout."""


class CommitConflictError(CommitError):
    """Another writer committed the same checkpoint generation first."""
