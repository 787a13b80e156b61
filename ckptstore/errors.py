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


class InvalidURLError(CkptStoreError, ValueError):
    """A location that names no store ckptstore can open: an unsupported URL scheme, a
    malformed URL (``s3:/bucket``), credentials inside a URL. Its message never shows a
    credential and names the supported forms (storage/urls.py)."""


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


class SerializationError(CkptStoreError, TypeError, AttributeError, pickle.PicklingError):
    """An object cannot be saved (unsupported type or unpicklable). torch.save raises
    the pickler's TypeError, AttributeError ("Can't pickle local object") or
    PicklingError for these: this is each of them."""


class UnsafeLoadError(CkptStoreError, pickle.UnpicklingError):
    """``weights_only=True`` refused a pickle that would run code."""


class TemplateMismatchError(FormatError):
    """A load template does not fit the checkpoint (a key it lacks, another shape or
    structure): the program's state, not the checkpoint's bytes, is at odds with it."""


# --- commit ----------------------------------------------------------------------------
class CommitError(CkptStoreError):
    """The two-phase commit did not commit this save."""


class BaseRetiredError(CommitError):
    """An incremental save's base checkpoint was deleted while it ran (a gc beside the
    job): this save did not commit, and the next one writes everything. A later save
    warns of it (RuntimeWarning) instead of raising it; the save's own future raises
    it, and so does ``wait()`` unless a later save warned of it already."""


class CommitTimeoutError(CommitError, TimeoutError):
    """Not every rank voted (or no manifest appeared) within the commit timeout."""


class CommitConflictError(CommitError):
    """Another writer committed the same checkpoint generation first."""


class FencedError(CommitError):
    """A newer run of this job has claimed the store (``Store.resume``): this older run
    (an orphaned worker of a dead launcher, say) may no longer commit."""


# --- training ---------------------------------------------------------------------------
class DeterministicError(CkptStoreError):
    """Raise it in a training program for a failure that a restart would repeat (a
    non-finite loss, a bad data shard): ``ckptstore run`` then stops the run at once
    and alerts, instead of spending its restart budget on it."""


# --- warnings --------------------------------------------------------------------------
class UnsafeForWeightsOnlyWarning(UserWarning):
    """``save`` met objects that the default load (``weights_only=True``) will refuse to
    rebuild: numpy arrays, user classes, ... outside torch's allow-list. Issued once per
    save, at the ``save`` call. ``types`` maps the refused objects' type names to counts;
    ``globals`` names the globals outside the allow-list. Under
    ``warnings.simplefilter("error", UnsafeForWeightsOnlyWarning)`` the save raises it
    instead, and nothing is committed."""

    def __init__(self, message: str, types: dict[str, int] | None = None, globals: tuple[str, ...] = ()):
        super().__init__(message)
        self.types = dict(types or {})
        self.globals = tuple(globals)
