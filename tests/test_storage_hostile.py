"""Hostile stores: what the storage layer does with symlinks, FIFOs and other special
files planted below a local root, and that no secret reaches a message.

The local backend (ckptstore/storage/local.py) never follows a symlink below its root:
reads, stats, writes and deletes walk a key's directories one O_NOFOLLOW open at a time,
walk/list never descend into a symlink, and delete prunes only the key's own
directories. Every test plants real symlinks pointing at an ``outside`` directory next
to the store and checks that the victims there survive, unread and unchanged.

The S3 part checks redaction: an endpoint URL with userinfo never shows in describe(),
repr or an error message (botocore's connection errors echo the URL, password included).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from ckptstore.errors import (
    AlreadyExistsError,
    CkptStoreError,
    NotRegularObjectError,
    ObjectNotFoundError,
    StorageError,
)
from ckptstore.storage import LocalStorage, ObjectInfo, open_storage, redact_url

VICTIM = b"outside the store: must never be read, changed or deleted"


@pytest.fixture
def outside(tmp_path):
    """A directory next to the store, with a victim file and a victim sub-directory."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "victim").write_bytes(VICTIM)
    (d / "sub" / "victim2").write_bytes(VICTIM)
    return d


@pytest.fixture
def store(tmp_path):
    s = LocalStorage(tmp_path / "store")
    s.put("attempts/a1/data-r0.bin", b"mine")
    s.put("manifest-0000000001.json", b"{}")
    return s


def _root(s: LocalStorage):
    from pathlib import Path

    return Path(s.root)


def _victims_intact(outside) -> None:
    assert (outside / "victim").read_bytes() == VICTIM
    assert (outside / "sub" / "victim2").read_bytes() == VICTIM
    assert sorted(os.listdir(outside)) == ["sub", "victim"]
    assert os.listdir(outside / "sub") == ["victim2"]


def _in_thread(fn, timeout: float = 30.0):
    """Run fn in a thread; returns what it raised (or returned). The join timeout is only
    a safety net so a regression fails instead of hanging the suite."""
    box: list = []

    def body():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the assertions
            box.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the call blocked"
    return box[0]


def _open_fifo_writer(path) -> None:
    """Unblock a reader a regression left stuck in open() on the FIFO (so its thread
    ends); never needed when the backend is right."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------- reads
def test_local_read_of_a_symlink_to_an_outside_file_raises_not_regular(store, outside):
    os.symlink(outside / "victim", _root(store) / "manifest-0000000002.json")
    calls = {
        "read": lambda: store.read("manifest-0000000002.json"),
        "read_range": lambda: store.read("manifest-0000000002.json", 0, 4),
        "readinto": lambda: store.readinto("manifest-0000000002.json", 0, memoryview(bytearray(4))),
        "stat": lambda: store.stat("manifest-0000000002.json"),
        "exists": lambda: store.exists("manifest-0000000002.json"),
    }
    for name, call in calls.items():
        with pytest.raises(NotRegularObjectError, match="manifest-0000000002.json") as ei:
            call()
        assert "symlink" in str(ei.value), name
        assert isinstance(ei.value, StorageError)
    _victims_intact(outside)


def test_local_read_through_a_symlinked_directory_raises_not_regular(store, outside):
    os.symlink(outside, _root(store) / "attempts" / "evil")
    for call in (lambda: store.read("attempts/evil/victim"),
                 lambda: store.readinto("attempts/evil/victim", 0, memoryview(bytearray(4))),
                 lambda: store.stat("attempts/evil/victim"),
                 lambda: store.exists("attempts/evil/sub/victim2")):
        with pytest.raises(NotRegularObjectError, match="attempts/evil") as ei:
            call()
        assert "'attempts/evil' is a symlink" in str(ei.value)
    assert store.read("attempts/a1/data-r0.bin") == b"mine"  # the real ones still read
    _victims_intact(outside)


def test_local_symlinked_top_directory_is_never_followed(store, outside):
    os.symlink(outside, _root(store) / "evil")
    with pytest.raises(NotRegularObjectError):
        store.read("evil/victim")
    with pytest.raises(NotRegularObjectError):
        store.stat("evil/sub/victim2")
    with pytest.raises(NotRegularObjectError):
        store.put("evil/new", b"x")
    with pytest.raises(NotRegularObjectError):
        store.delete("evil/victim")
    _victims_intact(outside)


def test_local_dangling_symlink_is_not_regular_and_a_directory_is_not_an_object(store, tmp_path):
    os.symlink(tmp_path / "nowhere", _root(store) / "dangling")
    with pytest.raises(NotRegularObjectError):
        store.read("dangling")
    with pytest.raises(ObjectNotFoundError):
        store.read("attempts/a1")  # a directory
    with pytest.raises(ObjectNotFoundError):
        store.readinto("attempts", 0, memoryview(bytearray(1)))
    # A regular file where a directory belongs: the key does not exist.
    with pytest.raises(ObjectNotFoundError):
        store.read("manifest-0000000001.json/x")
    assert store.exists("manifest-0000000001.json/x") is False
    store.delete("manifest-0000000001.json/x")  # missing: nothing to do
    assert store.read("manifest-0000000001.json") == b"{}"


def test_local_reading_a_fifo_raises_at_once(store):
    fifo = _root(store) / "attempts" / "a1" / "data-r1.bin"
    os.mkfifo(fifo)
    try:
        calls = {
            "read": lambda: store.read("attempts/a1/data-r1.bin"),
            "read_range": lambda: store.read("attempts/a1/data-r1.bin", 0, 4),
            "readinto": lambda: store.readinto("attempts/a1/data-r1.bin", 0, memoryview(bytearray(4))),
            "stat": lambda: store.stat("attempts/a1/data-r1.bin"),
        }
        for name, call in calls.items():
            got = _in_thread(call)
            assert isinstance(got, NotRegularObjectError), (name, got)
            assert "attempts/a1/data-r1.bin" in str(got) and "FIFO" in str(got)
    finally:
        _open_fifo_writer(fifo)


def test_local_reading_a_fifo_in_a_subprocess_fails_fast(store, tmp_path):
    """The same through a whole load-like call in a fresh process (no leftover thread)."""
    import subprocess
    import sys

    os.mkfifo(_root(store) / "manifest-0000000002.json")
    code = ("import sys\nfrom ckptstore.storage import LocalStorage\nfrom ckptstore.errors import NotRegularObjectError\n"
            "try:\n    LocalStorage(sys.argv[1]).readinto('manifest-0000000002.json', 0, memoryview(bytearray(8)))\n"
            "except NotRegularObjectError as e:\n    print('refused:', e)\n    sys.exit(0)\nsys.exit(1)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code, store.root], capture_output=True, text=True, timeout=60)
    finally:
        _open_fifo_writer(_root(store) / "manifest-0000000002.json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused:" in out.stdout and "FIFO" in out.stdout


# ---------------------------------------------------------------------------- walk / list
def test_local_walk_never_descends_into_symlinked_dir(store, outside):
    os.symlink(outside, _root(store) / "attempts" / "evil")
    os.symlink(outside / "victim", _root(store) / "attempts" / "a1" / "vote-r0.json")
    infos = {i.key: i for i in store.walk("")}
    assert set(infos) == {"attempts/a1/data-r0.bin", "attempts/a1/vote-r0.json", "attempts/evil",
                          "manifest-0000000001.json"}
    assert infos["attempts/evil"].kind == "symlink" and infos["attempts/evil"].size == 0
    assert infos["attempts/a1/vote-r0.json"].kind == "symlink" and infos["attempts/a1/vote-r0.json"].size == 0
    assert infos["attempts/a1/data-r0.bin"] == ObjectInfo("attempts/a1/data-r0.bin", 4,
                                                          infos["attempts/a1/data-r0.bin"].mtime, "file")
    assert not any("victim" in k for k in infos)
    _victims_intact(outside)


def test_local_walk_and_list_of_a_symlinked_prefix_are_empty(store, outside):
    os.symlink(outside, _root(store) / "attempts" / "evil")
    for prefix in ("attempts/evil", "attempts/evil/", "attempts/evil/sub/"):
        assert list(store.walk(prefix)) == []
        assert store.list(prefix) == []
    assert store.list("attempts") == ["a1/", "evil"]  # a symlink is a plain name, never a prefix
    os.symlink(outside, _root(store) / "top")
    assert store.list("") == ["attempts/", "manifest-0000000001.json", "top"]
    assert store.list("top") == [] and list(store.walk("top/")) == []
    _victims_intact(outside)


def test_local_walk_reports_fifos_and_sockets_as_other(store, tmp_path):
    os.mkfifo(_root(store) / "attempts" / "a1" / "fifo")
    sock_path = _root(store) / "sock"
    sock = None
    if len(str(sock_path)) < 100:  # AF_UNIX path limit
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(sock_path))
    try:
        infos = {i.key: i for i in _in_thread(lambda: list(store.walk("")))}
        assert infos["attempts/a1/fifo"].kind == "other" and infos["attempts/a1/fifo"].size == 0
        if sock is not None:
            assert infos["sock"].kind == "other"
            with pytest.raises(NotRegularObjectError, match="socket"):
                store.read("sock")
        assert infos["attempts/a1/data-r0.bin"].kind == "file"
        assert "fifo" in store.list("attempts/a1")
    finally:
        if sock is not None:
            sock.close()
        _open_fifo_writer(_root(store) / "attempts" / "a1" / "fifo")


def test_local_walk_skips_names_that_are_not_valid_keys(store):
    (_root(store) / "attempts" / "a1" / "back\\slash").write_bytes(b"?")
    assert {i.key for i in store.walk("")} == {"attempts/a1/data-r0.bin", "manifest-0000000001.json"}
    assert store.list("attempts/a1") == ["data-r0.bin"]


# ---------------------------------------------------------------------------- delete
def test_local_delete_never_follows_symlinked_dir(store, outside):
    os.symlink(outside, _root(store) / "attempts" / "evil")
    with pytest.raises(NotRegularObjectError, match="attempts/evil"):
        store.delete("attempts/evil/victim")
    with pytest.raises(NotRegularObjectError):
        store.delete("attempts/evil/sub/victim2")
    assert os.path.islink(_root(store) / "attempts" / "evil")
    _victims_intact(outside)


def test_local_delete_of_a_symlink_removes_the_link_only(store, outside):
    os.symlink(outside / "victim", _root(store) / "attempts" / "a1" / "link")
    os.symlink(outside, _root(store) / "attempts" / "dirlink")
    store.delete("attempts/a1/link")
    store.delete("attempts/dirlink")
    assert not os.path.lexists(_root(store) / "attempts" / "a1" / "link")
    assert not os.path.lexists(_root(store) / "attempts" / "dirlink")
    assert store.read("attempts/a1/data-r0.bin") == b"mine"
    _victims_intact(outside)


def test_local_delete_prefix_never_follows_symlinks(store, outside):
    a2 = _root(store) / "attempts" / "a2"
    a2.mkdir()
    (a2 / "data-r0.bin").write_bytes(b"x")
    os.symlink(outside, a2 / "dirlink")
    os.symlink(outside / "victim", a2 / "filelink")
    os.mkfifo(a2 / "fifo")
    store.delete_prefix("attempts/a2/")
    assert not a2.exists()  # everything in it went, the links themselves included
    # A prefix that is itself a symlink to the victims: nothing there, nothing deleted.
    os.symlink(outside, _root(store) / "attempts" / "evil")
    store.delete_prefix("attempts/evil/")
    assert os.path.islink(_root(store) / "attempts" / "evil")
    # And a walk of the whole store deletes the link, never what it points at.
    store.delete_prefix("")
    assert list(store.walk("")) == []
    assert os.path.isdir(store.root)
    _victims_intact(outside)


def test_local_delete_prunes_only_the_keys_own_empty_directories_never_the_root(tmp_path, outside):
    s = LocalStorage(tmp_path / "store")
    s.put("a/b/c/k", b"1")
    (tmp_path / "store" / "a" / "empty-sibling").mkdir()
    (tmp_path / "store" / "lonely").mkdir()
    s.delete("a/b/c/k")
    assert not (tmp_path / "store" / "a" / "b").exists()  # c and b: emptied by the delete
    assert (tmp_path / "store" / "a" / "empty-sibling").is_dir()  # not on the key's path
    assert (tmp_path / "store" / "lonely").is_dir()
    s.put("only", b"1")
    s.delete("only")
    assert os.path.isdir(s.root)  # the root stays, empty or not
    # A child view: its own root stays too, though the delete emptied it.
    sub = s.child("x/y")
    sub.put("k", b"1")
    sub.delete("k")
    assert os.path.isdir(tmp_path / "store" / "x" / "y")


def test_local_delete_pruning_never_goes_through_a_symlink(tmp_path, outside, monkeypatch):
    """A key's directory swapped for a symlink to an empty outside directory right after
    the unlink: the prune stops there (rmdir relative to the parent's fd never follows),
    the outside directory survives."""
    (outside / "empty").mkdir()
    s = LocalStorage(tmp_path / "store")
    s.put("a/b/k", b"1")
    real_unlink = os.unlink

    def unlink_then_swap(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        if path == "k":
            os.rename(tmp_path / "store" / "a" / "b", tmp_path / "moved")
            os.symlink(outside / "empty", tmp_path / "store" / "a" / "b")

    monkeypatch.setattr(os, "unlink", unlink_then_swap)
    s.delete("a/b/k")
    monkeypatch.undo()
    assert (outside / "empty").is_dir()
    assert os.path.islink(tmp_path / "store" / "a" / "b")
    assert (tmp_path / "store" / "a").is_dir()  # holds the link: not empty, not removed


# ---------------------------------------------------------------------------- writes
def test_local_put_and_append_refuse_a_symlinked_parent_directory(store, outside):
    os.symlink(outside, _root(store) / "attempts" / "evil")
    with pytest.raises(NotRegularObjectError, match="attempts/evil"):
        store.put("attempts/evil/vote-r0.json", b"x")
    with pytest.raises(NotRegularObjectError):
        store.put("attempts/evil/new/vote-r0.json", b"x", if_absent=True)
    with pytest.raises(NotRegularObjectError):
        store.open_append("attempts/evil/data-r0.bin")
    with pytest.raises(NotRegularObjectError):
        store.put("attempts/evil/sub/victim2", b"overwritten")
    _victims_intact(outside)
    assert not any(".tmp-" in n for n in os.listdir(outside))


def test_local_put_over_a_symlink_replaces_the_link_not_its_target(store, outside):
    os.symlink(outside / "victim", _root(store) / "manifest-0000000002.json")
    with pytest.raises(AlreadyExistsError):
        store.put("manifest-0000000002.json", b"new", if_absent=True)  # create-only: something is there
    with pytest.raises(AlreadyExistsError):
        store.open_append("manifest-0000000002.json")
    store.put("manifest-0000000002.json", b"new")
    assert not os.path.islink(_root(store) / "manifest-0000000002.json")
    assert store.read("manifest-0000000002.json") == b"new"
    _victims_intact(outside)


def test_local_child_view_through_a_symlink_is_refused(store, outside):
    os.symlink(outside, _root(store) / "runs")
    sub = store.child("runs")
    with pytest.raises(NotRegularObjectError):
        sub.read("victim")
    with pytest.raises(NotRegularObjectError):
        sub.put("new", b"x")
    with pytest.raises(NotRegularObjectError):
        sub.delete("victim")
    assert sub.list("") == [] and list(sub.walk("")) == []
    assert not sub.is_dir()
    _victims_intact(outside)


def test_local_root_itself_may_be_a_symlink(tmp_path, outside):
    real = tmp_path / "mnt" / "real"
    real.mkdir(parents=True)
    os.symlink(real, tmp_path / "root-link")
    s = LocalStorage(tmp_path / "root-link")
    s.put("a/b/k", b"v", if_absent=True)
    w = s.open_append("a/data.bin")
    w.append(b"xyz")
    w.close()
    assert s.read("a/b/k") == b"v" and s.stat("a/data.bin").size == 3
    assert s.list("") == ["a/"] and {i.key for i in s.walk("")} == {"a/b/k", "a/data.bin"}
    s.delete_prefix("")
    assert os.path.isdir(real) and os.path.islink(tmp_path / "root-link") and os.listdir(real) == []
    # A root that does not exist yet is created by the first put, as before.
    fresh = LocalStorage(tmp_path / "not" / "yet")
    assert fresh.list("") == [] and not fresh.is_dir()
    fresh.put("k", b"v")
    assert fresh.read("k") == b"v"


def test_local_append_writer_survives_the_directory_path_changing(tmp_path):
    """close() fsyncs the directory it created the object in (held open), and abort()
    after close removes the object by key, never through a symlink."""
    s = LocalStorage(tmp_path / "store")
    w = s.open_append("attempts/a/data.bin")
    w.append(b"abc")
    assert w.close() == 3
    w.abort()  # after close: removes it
    assert not s.exists("attempts/a/data.bin")
    w = s.open_append("attempts/a/data.bin")
    w.append(b"abc")
    w.abort()
    w.abort()
    assert not os.path.lexists(tmp_path / "store" / "attempts" / "a" / "data.bin")


# ---------------------------------------------------------------------------- redaction
def test_redact_url_removes_userinfo_only():
    assert redact_url("http://user:s3cr3t@127.0.0.1:9/b/k?x=1#f") == "http://127.0.0.1:9/b/k?x=1#f"
    assert redact_url("https://AKIA:pa@ss@host/x") == "https://host/x"  # unencoded '@' in a password
    assert redact_url("s3://bucket/key@v1") == "s3://bucket/key@v1"  # '@' after the host: not userinfo
    assert redact_url("http://host:9/") == "http://host:9/"
    assert redact_url('Could not connect to "http://u:p@h:1/b" or http://v:q@g/') == \
        'Could not connect to "http://h:1/b" or http://g/'
    assert redact_url("/data/user:pass@x/ckpt") == "/data/user:pass@x/ckpt"  # not a URL: a path


def test_open_storage_errors_do_not_echo_credentials():
    with pytest.raises(ValueError) as ei:
        open_storage("https://user:s3cr3t@example.com/ckpt")
    assert "s3cr3t" not in str(ei.value) and "example.com" in str(ei.value)
    pytest.importorskip("boto3")
    with pytest.raises(ValueError) as ei:
        open_storage("s3://AKIAXX:s3cr3t@bucket/ckpt")
    assert "s3cr3t" not in str(ei.value) and "AKIAXX" not in str(ei.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: connections are refused


@pytest.fixture
def fake_aws_env(monkeypatch):
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)


def _all_text(e: BaseException) -> str:
    """The messages of e and of every exception chained to it (what a traceback shows,
    less the source lines), and botocore's kwargs."""
    texts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        texts += [f"{type(e).__name__}: {e}", repr(e.args), repr(getattr(e, "kwargs", None))]
        e = e.__cause__ or e.__context__
    return "\n".join(texts)


@pytest.mark.parametrize("how", ["endpoint_url", "client", "environment"])
def test_s3_errors_and_describe_never_contain_the_endpoint_password(fake_aws_env, monkeypatch, how):
    pytest.importorskip("boto3")
    import boto3
    from botocore.config import Config

    from ckptstore.storage.s3 import S3Storage

    endpoint = f"http://user:s3cr3t@127.0.0.1:{_closed_port()}"
    opts = dict(max_attempts=1, connect_timeout=2.0, read_timeout=2.0)
    if how == "endpoint_url":
        s = S3Storage("bucket", "run", endpoint_url=endpoint, **opts)
    elif how == "client":
        client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
            aws_secret_access_key="testing", config=Config(retries={"total_max_attempts": 1}, connect_timeout=2))
        s = S3Storage("bucket", "run", client=client)
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        s = open_storage("s3://bucket/run", **opts)
    assert s.client.meta.endpoint_url == endpoint  # the secret really is in play
    for text in (s.describe(), s.describe("k"), s.url, repr(s), repr(s.child("sub"))):
        assert "s3cr3t" not in text and "user:" not in text, text
    assert "127.0.0.1" in repr(s)  # the endpoint itself is still shown, without userinfo
    calls = {
        "read": lambda: s.read("k"),
        "readinto": lambda: s.readinto("k", 0, memoryview(bytearray(4))),
        "stat": lambda: s.stat("k"),
        "exists": lambda: s.exists("k"),
        "put": lambda: s.put("k", b"x"),
        "put_if_absent": lambda: s.put("k", b"x", if_absent=True),
        "list": lambda: s.list(""),
        "walk": lambda: list(s.walk("")),
        "delete": lambda: s.delete("k"),
        "delete_prefix": lambda: s.delete_prefix("p/"),
        "is_dir": lambda: s.is_dir(),
        "abort_stale_uploads": lambda: s.abort_stale_uploads(0),
    }
    for name, call in calls.items():
        with pytest.raises(CkptStoreError) as ei:
            call()
        text = _all_text(ei.value)
        assert "s3cr3t" not in text and "user:s3" not in text, (name, text)
        assert "s3://bucket/run" in str(ei.value), (name, str(ei.value))
    with pytest.raises(CkptStoreError) as ei:
        s.open_append("data.bin")
    assert "s3cr3t" not in _all_text(ei.value)


def test_s3_invalid_endpoint_error_does_not_echo_the_password(fake_aws_env):
    pytest.importorskip("boto3")
    from ckptstore.storage.s3 import S3Storage

    try:
        S3Storage("bucket", endpoint_url="http://user:s3cr3t@bad host:1")
    except ValueError as e:
        assert "s3cr3t" not in _all_text(e)


def test_s3_walk_and_list_skip_objects_whose_names_are_not_valid_keys(request, tmp_path):
    pytest.importorskip("boto3")
    import s3util

    s = s3util.s3_storage_factory(request, tmp_path)
    s.put("a/ok", b"1")
    for bad in ("a//double", "a/./dot", "a/../up", "a/back\\slash", "a/"):
        s.client.put_object(Bucket=s.bucket, Key=f"{s.prefix}/{bad}", Body=b"x")
    assert [(i.key, i.kind) for i in s.walk("")] == [("a/ok", "file")]
    assert s.list("a") == ["ok"]
    s.delete_prefix("a/")  # deletes them all, invalid names included
    assert s.client.list_objects_v2(Bucket=s.bucket, Prefix=f"{s.prefix}/").get("KeyCount", 0) == 0


def test_local_appends_from_threads_only_ever_write_at_the_end(tmp_path, monkeypatch):
    """Every pwrite of an append lands at the file's current end, in order: concurrent
    pwrites at interleaved offsets past the end were several times slower on ext4
    (docs/performance.md), and a failed write leaves no hole before later bytes."""
    s = LocalStorage(tmp_path / "store")
    w = s.open_append("data.bin")
    real = os.pwrite
    ends: list[tuple[int, int]] = []  # (offset written at, the file's size just before)

    def spy(fd, data, offset):
        ends.append((offset, os.fstat(fd).st_size))
        time.sleep(0)  # hand the GIL over: another append would write past the end now
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    gate = threading.Barrier(4)

    def feed(k):
        gate.wait()
        for i in range(25):
            w.append(bytes([k]) * (1000 + 37 * i))

    threads = [threading.Thread(target=feed, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    size = w.close()
    assert len(ends) == 100 and all(offset == before for offset, before in ends)
    assert size == os.path.getsize(tmp_path / "store" / "data.bin") == sum(4 * (1000 + 37 * i) for i in range(25))
