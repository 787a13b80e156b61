"""Every failure gets an error of the right class whose message names the checkpoint
and, where it applies, the tensor key and the file; a failed save harms no earlier
checkpoint; background errors surface on the future, at wait() and on the next save."""

from __future__ import annotations

import io
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore import format as fmt
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    FormatError,
    IntegrityError,
    NotACheckpointError,
    NotCommittedError,
    SerializationError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
    UnsupportedVersionError,
)
from ckptstore.runtime import runtime


# ---------------------------------------------------------------------------- helpers
def save(obj, path, **kw) -> fmt.Manifest:
    return ckptstore.save(obj, str(path), **kw).result(timeout=60)


def manifest_file(path) -> Path:
    (name,) = [n for n in os.listdir(path) if fmt.parse_manifest_name(n) is not None]
    return Path(path) / name


def rewrite_manifest(path, change) -> None:
    """Edit the committed manifest's JSON in place (simulating a foreign or damaged writer)."""
    mf = manifest_file(path)
    d = json.loads(mf.read_bytes())
    change(d)
    mf.write_bytes(json.dumps(d).encode())


def no_manifest_anywhere(path) -> bool:
    if not os.path.exists(path):
        return True
    return not any(fmt.parse_manifest_name(n) is not None for _, _, files in os.walk(path) for n in files)


def drain_earlier_failures() -> None:
    """Observe failures other tests may have left, so they do not surface in ours."""
    try:
        ckptstore.wait(timeout=60)
    except (CkptStoreError, TimeoutError):
        pass


pytestmark = pytest.mark.usefixtures("observe_earlier_failures")


def compressible(n: int = 16_384) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) % 13) * 0.5


def blob_of(manifest: fmt.Manifest, key: str) -> fmt.Blob:
    (chunk,) = manifest.ranks[0].tensors[key].chunks
    return chunk.blob


# ---------------------------------------------------------------------------- saving
UNSUPPORTED = {
    "lambda": lambda: (lambda x: x),
    "lock": threading.Lock,
    "generator": lambda: (i for i in range(3)),
}


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED))
def test_unsupported_object_raises_serialization_error_and_commits_nothing(tmp_ckpt, kind):
    obj = {"w": torch.randn(64), "bad": {"inner": UNSUPPORTED[kind]()}}
    with pytest.raises(SerializationError) as ei:
        ckptstore.save(obj, str(tmp_ckpt))
    assert isinstance(ei.value, TypeError)
    assert str(tmp_ckpt) in str(ei.value)
    assert no_manifest_anywhere(tmp_ckpt)
    # "w" was queued for copying when pickling failed: its buffer went back to the pool
    assert runtime().pool.in_use == 0
    with pytest.raises((CheckpointNotFoundError, NotCommittedError)):
        ckptstore.load(tmp_ckpt)


def test_unsupported_object_to_a_stream_writes_nothing():
    buf = io.BytesIO()
    with pytest.raises(SerializationError):
        ckptstore.save({"w": torch.ones(3), "lock": threading.Lock()}, buf)
    assert buf.getvalue() == b""


def test_failed_save_leaves_the_earlier_checkpoint_loadable(tmp_ckpt):
    save({"w": torch.arange(5.0)}, tmp_ckpt)
    with pytest.raises(SerializationError):
        ckptstore.save({"w": torch.zeros(5), "bad": threading.Lock()}, str(tmp_ckpt))
    assert torch.equal(ckptstore.load(tmp_ckpt)["w"], torch.arange(5.0))
    assert [fmt.parse_manifest_name(n) for n in os.listdir(tmp_ckpt) if n.startswith("manifest-")] == [1]


# ---------------------------------------------------------------------------- not a checkpoint
def test_missing_path_raises_file_not_found(tmp_path):
    missing = tmp_path / "nope" / "ckpt"
    with pytest.raises(FileNotFoundError) as ei:
        ckptstore.load(missing)
    assert isinstance(ei.value, CkptStoreError)
    assert str(missing) in str(ei.value)


def test_missing_store_step_raises_file_not_found(tmp_path):
    store = ckptstore.Store(tmp_path / "run")
    with pytest.raises(FileNotFoundError) as ei:
        store.load()
    assert str(tmp_path / "run") in str(ei.value)


def test_empty_directory_is_not_a_checkpoint(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(NotACheckpointError) as ei:
        ckptstore.load(d)
    assert str(d) in str(ei.value)


def test_directory_of_random_files_is_not_a_checkpoint(tmp_path):
    d = tmp_path / "junk"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("hello")
    (d / "sub" / "blob.bin").write_bytes(os.urandom(100))
    (d / "manifest.json").write_text("{}")  # not a manifest-<generation>.json name
    with pytest.raises(NotACheckpointError) as ei:
        ckptstore.load(d)
    assert isinstance(ei.value, FormatError)
    assert str(d) in str(ei.value)


@pytest.mark.parametrize("how", ["manifest_deleted", "attempt_only"])
def test_I1_checkpoint_without_manifest_is_not_committed(tmp_ckpt, how):
    if how == "manifest_deleted":
        save({"w": torch.ones(4)}, tmp_ckpt)
        manifest_file(tmp_ckpt).unlink()
    else:  # what a save killed before its commit leaves behind
        data = tmp_ckpt / fmt.data_file_name(fmt.new_attempt_id(), 0, 0)
        data.parent.mkdir(parents=True)
        data.write_bytes(os.urandom(1000))
    with pytest.raises(NotCommittedError) as ei:
        ckptstore.load(tmp_ckpt)
    assert str(tmp_ckpt) in str(ei.value)


# ---------------------------------------------------------------------------- integrity (I3)
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_I3_truncated_data_file_raises_integrity_error(tmp_ckpt, compression):
    m = save({"layer.weight": compressible()}, tmp_ckpt, compression=compression)
    blob = blob_of(m, "layer.weight")
    assert (blob.codec == ()) == (compression == "none")
    data = tmp_ckpt / blob.file
    cut = blob.offset + blob.length - 1  # the tensor's last stored byte is gone
    os.truncate(data, cut)

    with pytest.raises(IntegrityError) as ei:
        ckptstore.load(tmp_ckpt)
    msg = str(ei.value)
    assert str(tmp_ckpt) in msg and blob.file in msg
    # Tensors are checked before the skeleton, so the error names the tensor hit.
    assert "'layer.weight'" in msg

    problems = ckptstore.verify(tmp_ckpt)
    assert "layer.weight" in {p.key for p in problems}
    assert {p.file for p in problems} == {blob.file}


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_I3_flipped_bit_in_data_file_raises_integrity_error(tmp_ckpt, compression):
    m = save({"layer.weight": compressible(), "other": torch.ones(3)}, tmp_ckpt, compression=compression)
    blob = blob_of(m, "layer.weight")
    assert (blob.codec == ()) == (compression == "none")
    path = tmp_ckpt / blob.file
    raw = bytearray(path.read_bytes())
    raw[blob.offset + blob.length // 2] ^= 0x10
    path.write_bytes(bytes(raw))

    with pytest.raises(IntegrityError) as ei:
        ckptstore.load(tmp_ckpt)
    msg = str(ei.value)
    assert str(tmp_ckpt) in msg and blob.file in msg and "'layer.weight'" in msg
    assert "'other'" not in msg
    problems = ckptstore.verify(tmp_ckpt)
    assert [(p.key, p.file) for p in problems] == [("layer.weight", blob.file)]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_I3_every_flipped_byte_of_a_blob_is_caught(tmp_ckpt, compression):
    """No byte of a stored chunk can change unnoticed (sampled for raw chunks)."""
    m = save({"t": compressible(4096)}, tmp_ckpt, compression=compression)
    blob = blob_of(m, "t")
    path = tmp_ckpt / blob.file
    good = path.read_bytes()
    step = 1 if blob.length <= 400 else blob.length // 97
    missed = []
    for pos in range(blob.offset, blob.offset + blob.length, step):
        bad = bytearray(good)
        bad[pos] ^= 0x01
        path.write_bytes(bytes(bad))
        try:
            ckptstore.load(tmp_ckpt)
        except IntegrityError:
            continue
        missed.append(pos)
    path.write_bytes(good)
    assert missed == []
    assert torch.equal(ckptstore.load(tmp_ckpt)["t"], compressible(4096))


# ---------------------------------------------------------------------------- manifest (I4)
def test_I4_unknown_format_version_raises_unsupported_version(tmp_ckpt):
    save({"w": torch.ones(2)}, tmp_ckpt)
    rewrite_manifest(tmp_ckpt, lambda d: d.update(format_version=max(fmt.READ_VERSIONS) + 1))
    with pytest.raises(UnsupportedVersionError) as ei:
        ckptstore.load(tmp_ckpt)
    assert str(tmp_ckpt) in str(ei.value)
    assert str(max(fmt.READ_VERSIONS) + 1) in str(ei.value)


@pytest.mark.parametrize("where", ["top", "rank", "chunk"])
def test_I4_unknown_manifest_field_raises_format_error(tmp_ckpt, where):
    save({"w": torch.ones(2)}, tmp_ckpt)

    def change(d):
        target = {"top": d, "rank": d["ranks"][0], "chunk": d["ranks"][0]["tensors"]["w"]["chunks"][0]}[where]
        target["surprise_field"] = 1

    rewrite_manifest(tmp_ckpt, change)
    with pytest.raises(FormatError) as ei:
        ckptstore.load(tmp_ckpt)
    assert not isinstance(ei.value, UnsupportedVersionError)
    assert "surprise_field" in str(ei.value)
    assert str(tmp_ckpt) in str(ei.value)


@pytest.mark.parametrize("bad_name", ["../x", "/etc/passwd", "attempts/../../x", "attempts//x"])
@pytest.mark.parametrize("blob", ["chunk", "skeleton"])
def test_I4_escaping_file_name_in_manifest_raises_format_error(tmp_ckpt, bad_name, blob):
    save({"w": torch.ones(2)}, tmp_ckpt)

    def change(d):
        rank = d["ranks"][0]
        (rank["tensors"]["w"]["chunks"][0] if blob == "chunk" else rank["skeleton"])["file"] = bad_name

    rewrite_manifest(tmp_ckpt, change)
    with pytest.raises(FormatError) as ei:
        ckptstore.load(tmp_ckpt)
    assert bad_name in str(ei.value)
    assert str(tmp_ckpt) in str(ei.value)


# ---------------------------------------------------------------------------- background failures
def _mount(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


def _umount(path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True, text=True, check=True)


def test_permission_denied_during_background_write_fails_future_keeps_old(tmp_ckpt):
    state = {"w": torch.arange(1000.0)}
    save(state, tmp_ckpt)
    # chmod first. Tests run as root here, and root's CAP_DAC_OVERRIDE ignores mode bits,
    # so when a probe write still succeeds, make the same directory read-only for root
    # too with a read-only bind mount of it onto itself (writes then fail with EROFS,
    # which ckptstore classes as permission denied).
    os.chmod(tmp_ckpt, 0o555)
    mounted = False
    try:
        probe = tmp_ckpt / "probe"
        try:
            probe.touch()
        except PermissionError:
            pass
        else:
            probe.unlink()
            r = _mount("--bind", str(tmp_ckpt), str(tmp_ckpt))
            if r.returncode != 0:
                pytest.skip(f"running as root and cannot bind-mount read-only: {r.stderr.strip()}")
            mounted = True
            r = _mount("-o", "remount,bind,ro", str(tmp_ckpt))
            if r.returncode != 0:
                pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")

        drain_earlier_failures()
        fut = ckptstore.save({"w": torch.zeros(1000)}, str(tmp_ckpt))
        err = fut.exception(timeout=60)
        assert isinstance(err, StoragePermissionError)
        assert isinstance(err, PermissionError)
        assert str(tmp_ckpt) in str(err)
        # the earlier checkpoint still loads, even from the read-only directory
        assert torch.equal(ckptstore.load(tmp_ckpt)["w"], state["w"])
    finally:
        if mounted:
            _umount(tmp_ckpt)
        os.chmod(tmp_ckpt, 0o755)
    assert torch.equal(ckptstore.load(tmp_ckpt)["w"], state["w"])
    assert sorted(n for n in os.listdir(tmp_ckpt) if n.startswith("manifest-")) == [fmt.manifest_name(1)]


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt))
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        _umount(mnt)


def test_disk_full_during_background_write_fails_future_keeps_old(small_fs):
    ckpt = small_fs / "ckpt"
    old = {"w": torch.arange(2000.0)}
    save(old, ckpt)
    drain_earlier_failures()
    big = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)  # 2 MiB of noise: cannot fit
    fut = ckptstore.save({"w": big}, str(ckpt), compression="none")
    err = fut.exception(timeout=60)
    assert isinstance(err, StorageFullError)
    assert str(ckpt) in str(err)
    assert torch.equal(ckptstore.load(ckpt)["w"], old["w"])
    # the failed attempt gave its space back: a small save fits and commits
    m = save({"w": torch.ones(10)}, ckpt)
    assert m.generation == 2
    assert torch.equal(ckptstore.load(ckpt)["w"], torch.ones(10))


def _unwritable_path(tmp_path) -> Path:
    """A path below a regular file: every mkdir there fails (ENOTDIR), even for root,
    but only in the background, once the writer creates its data file."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    return blocker / "ckpt"


def test_background_error_surfaces_on_the_future(tmp_path):
    bad = _unwritable_path(tmp_path)
    drain_earlier_failures()
    fut = ckptstore.save({"w": torch.ones(8)}, str(bad))
    err = fut.exception(timeout=60)
    assert isinstance(err, StorageError)
    assert str(bad) in str(err)
    with pytest.raises(StorageError):
        fut.result(timeout=60)


def test_background_error_surfaces_on_wait_after_it_failed(tmp_path):
    bad = _unwritable_path(tmp_path)
    drain_earlier_failures()
    finished = threading.Event()
    fut = ckptstore.save({"w": torch.ones(8)}, str(bad))
    fut.add_done_callback(lambda _f: finished.set())  # does not observe the outcome
    assert finished.wait(60)
    with pytest.raises(StorageError) as ei:
        ckptstore.wait(timeout=60)
    assert ei.value is fut.exception(timeout=0)
    assert str(bad) in str(ei.value)
    ckptstore.wait(timeout=60)  # reported once: nothing left to raise


def test_background_error_surfaces_on_wait_while_in_flight(tmp_path):
    """wait() called while the failing save is still in flight must raise its error.

    To be sure the save is in flight when wait() looks, the single commit thread is
    held by a task that returns only once wait() starts waiting on the save's future
    (a profile hook on this thread sees wait() call SaveFuture.exception)."""
    from ckptstore.checkpoint.save import SaveFuture
    from ckptstore.runtime import runtime

    bad = _unwritable_path(tmp_path)
    drain_earlier_failures()
    release = threading.Event()
    blocker = runtime().committer.submit(release.wait, 60)
    try:
        fut = ckptstore.save({"w": torch.ones(8)}, str(bad))
        assert not fut.done()  # its commit step queues behind the blocker

        def hook(frame, event, arg):
            if event == "call" and frame.f_code is SaveFuture.exception.__code__:
                release.set()

        import sys

        sys.setprofile(hook)
        try:
            with pytest.raises(StorageError) as ei:
                ckptstore.wait(timeout=60)
        finally:
            sys.setprofile(None)
    finally:
        release.set()
        blocker.result(timeout=60)
    assert ei.value is fut.exception(timeout=0)
    assert str(bad) in str(ei.value)


@pytest.mark.parametrize("via", ["save", "store"])
def test_background_error_surfaces_on_the_next_save(tmp_path, via):
    bad = _unwritable_path(tmp_path)
    drain_earlier_failures()
    finished = threading.Event()
    fut = ckptstore.save({"w": torch.ones(8)}, str(bad))
    fut.add_done_callback(lambda _f: finished.set())  # does not observe the outcome
    assert finished.wait(60)

    good = tmp_path / "good"
    with pytest.raises(CkptStoreError) as ei:
        if via == "save":
            ckptstore.save({"x": torch.zeros(2)}, str(good))
        else:
            ckptstore.Store(good).save(1, {"x": torch.zeros(2)})
    msg = str(ei.value)
    assert "earlier save" in msg and str(bad) in msg
    assert isinstance(ei.value.__cause__, StorageError)
    assert not good.exists() or no_manifest_anywhere(good)

    # reported once: the next save goes through
    save({"x": torch.zeros(2)}, good / "again")
    assert torch.equal(ckptstore.load(good / "again")["x"], torch.zeros(2))
