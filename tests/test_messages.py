"""Messages that help and never leak (issue 34, "URLs" and "Errors that help").

- No credential in any message: an ``s3://KEY:SECRET@bucket`` URL (or one with a
  presigned query string) given to ``status``, ``ls``, ``verify``, ``gc``, ``export``,
  ``consolidate``, ``import`` or to the Python API never shows its secret, on stdout,
  stderr or in an exception (chained ones included).
- The URL rule (storage/urls.py): ``s3:/bucket`` is refused with ``did you mean
  s3://bucket``, never silently a local path; an unsupported scheme lists the supported
  ones; a colon later in a relative path is still a path.
- A store root where one checkpoint is expected says so, with its newest steps and
  what to pass; ``Store.load(step)`` of a missing step names the nearest steps.
- ``ls`` and ``verify`` agree on "nothing here" (exit 1) and say where the checkpoints
  are when they lie a level or two deeper, with bounded work.
- ``doctor`` prints a table, not dict reprs.

Everything runs in-process (click's CliRunner) on tiny states: no subprocess, no S3
server (every refused URL is refused before boto3 is asked anything).
"""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
import torch
from cliutil import cli

import ckptstore
from ckptstore.checkpoint import nearby
from ckptstore.errors import CheckpointNotFoundError, InvalidURLError, NotACheckpointError
from ckptstore.storage import LocalStorage, open_storage, redact_url

SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"
KEY = "AKIAIOSFODNN7EXAMPLE"
# An AWS secret key is base64: about half of them hold a '/' (review of issue 34, item 1).
SLASHED = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
# What users paste: credentials as userinfo (two or one slash, or none), and a presigned URL.
LEAKY_URLS = [
    f"s3://{KEY}:{SECRET}@bucket/run",
    f"s3:/{KEY}:{SECRET}@bucket/run",
    f"s3:{KEY}:{SECRET}@bucket/run",
    f"gs://{KEY}:{SECRET}@bucket/run",
    f"https://bucket.s3.amazonaws.com/run?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={KEY}%2F20260101"
    f"&X-Amz-Signature={SECRET}&X-Amz-Security-Token={SECRET}",
    f"s3://{KEY}:{SLASHED}@bucket/run",
    f"s3:/{KEY}:{SLASHED}@bucket/run",
]
LEAKY_IDS = ["userinfo", "one-slash", "no-slash", "gs", "presigned", "slashed-secret", "slashed-secret-one-slash"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_real_s3(monkeypatch):
    """Should an s3:// URL reach boto3 after all, it meets a closed port at once, with
    fake credentials: never AWS, never a wait."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{_closed_port()}", "AWS_MAX_ATTEMPTS": "1",
                 "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def _all_text(e: BaseException) -> str:
    """What a traceback of ``e`` shows: its text and args and those of every exception
    chained to it."""
    texts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        texts += [f"{type(e).__name__}: {e}", repr(e.args)]
        e = e.__cause__ or e.__context__
    return "\n".join(texts)


def _no_secret(text: str) -> None:
    assert SECRET not in text and KEY not in text, text
    for half in SLASHED.split("/"):  # neither part of a secret that holds '/'
        assert half not in text, text


def _store(root, steps=(10, 20, 30)) -> ckptstore.Store:
    store = ckptstore.Store(root)
    for s in steps:
        store.save(s, {"w": torch.full((4,), float(s))}).result(timeout=60)
    return store


# ---------------------------------------------------------------------------- credentials
@pytest.mark.parametrize("url", LEAKY_URLS, ids=LEAKY_IDS)
def test_no_cli_command_prints_a_credential(tmp_path, url):
    """``ckptstore status 's3://KEY:SECRET@bucket/run'`` printed the secret; so did ls,
    verify and gc. Each refuses the URL (exit 2, one line) and shows no credential."""
    ckpt = str(tmp_path / "ckpt")
    ckptstore.save({"w": torch.ones(2)}, ckpt).result(timeout=60)
    runs = {
        "status": ["status", url], "ls": ["ls", url], "verify": ["verify", url], "gc": ["gc", url],
        "ls --json": ["ls", "--json", url], "verify --json": ["verify", "--json", url],
        "status --local": ["status", ckpt, "--local", url], "ls --local": ["ls", ckpt, "--local", url],
        "export": ["export", url, str(tmp_path / "out.zarr"), "--zarr"],
        "consolidate": ["consolidate", url, str(tmp_path / "c")],
        "consolidate to": ["consolidate", ckpt, url], "import": ["import", url, str(tmp_path / "i")],
        "import to": ["import", str(tmp_path), url], "doctor --health": ["doctor", "--health", "--store", url],
    }
    for name, argv in runs.items():
        r = cli(*argv)
        _no_secret(r.stdout + r.stderr)
        if name == "status --local":  # (the journal is missing first: exit 1)
            assert r.exit_code == 1, (name, r.output)
            continue
        if name == "doctor --health":  # the node is unhealthy: its store check failed
            assert r.exit_code != 0 and "store" in r.output, r.output
            continue
        assert r.exit_code == 2, (name, r.exit_code, r.output)
        assert r.stderr.startswith("ckptstore: ") and r.stderr.count("\n") == 1, (name, r.stderr)
        assert "Traceback" not in r.output


@pytest.mark.parametrize("url", LEAKY_URLS, ids=LEAKY_IDS)
def test_no_python_api_error_holds_a_credential(tmp_path, url):
    calls = {
        "load": lambda: ckptstore.load(url),
        "save": lambda: ckptstore.save({"w": torch.ones(2)}, url).result(timeout=60),
        "Store": lambda: ckptstore.Store(url),
        "open_storage": lambda: open_storage(url),
        "local tier": lambda: ckptstore.Store(str(tmp_path / "durable"), local=url),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as ei:  # (InvalidURLError: a ValueError and a CkptStoreError)
            call()
        assert isinstance(ei.value, InvalidURLError), (name, ei.value)
        _no_secret(_all_text(ei.value))
        assert "bucket" in str(ei.value), (name, str(ei.value))  # still says which URL
    (problem,) = ckptstore.verify(url)
    _no_secret(str(problem))
    assert not os.path.exists("s3:") and not os.path.exists(f"s3:{KEY}:{SECRET}@bucket"), "saved to a local path"


def test_an_s3_url_with_a_query_string_is_refused_without_its_secret():
    for url in (f"s3://bucket/run?X-Amz-Signature={SECRET}", f"s3://bucket/run?token={SECRET}#x"):
        with pytest.raises(InvalidURLError, match="query string") as ei:
            open_storage(url)
        _no_secret(_all_text(ei.value))
        r = cli("ls", url)
        assert r.exit_code == 2 and "query string" in r.stderr
        _no_secret(r.output)


def test_redact_url_masks_query_credentials_and_keeps_the_rest():
    text = redact_url(f"GET https://u:{SECRET}@h/b/k?X-Amz-Date=20260101&X-Amz-Signature={SECRET}"
                      f"&X-Amz-Credential={KEY}&partNumber=2#frag failed")
    assert text == ("GET https://h/b/k?X-Amz-Date=20260101&X-Amz-Signature=***&X-Amz-Credential=***"
                    "&partNumber=2#frag failed")
    assert redact_url("/data/run?token=abc/x") == "/data/run?token=abc/x"  # a path, not a URL


def test_a_secret_holding_a_slash_is_refused_and_redacted_everywhere(tmp_path):
    """``s3://KEY:wJal/K7MD/bPx@bucket/prefix`` opened the bucket ``KEY:wJal`` and showed
    the secret in repr(Store), repr(S3Storage), the SaveFuture, botocore's "Invalid
    bucket name", the exit report and the did-you-mean of ``s3:/...``. Now the URL is
    refused (no bucket name holds ':'), and redaction removes the whole userinfo."""
    from ckptstore.storage.s3 import S3Storage
    from ckptstore.storage.urls import shown
    url = f"s3://{KEY}:{SLASHED}@bucket/prefix"
    for call in (lambda: ckptstore.Store(url), lambda: open_storage(url), lambda: ckptstore.load(url),
                 lambda: ckptstore.save({"w": torch.ones(1)}, url), lambda: S3Storage(f"{KEY}:{SLASHED.split('/')[0]}"),
                 lambda: open_storage(f"s3://{KEY}:{SLASHED}/run"),  # no '@': the bucket part is no bucket
                 lambda: open_storage(f"s3:/{KEY}:{SLASHED}@bucket/prefix")):  # did you mean s3://bucket/prefix?
        with pytest.raises(ValueError) as ei:
            call()
        _no_secret(_all_text(ei.value))
    assert "did you mean s3://bucket/prefix?" in str(ei.value)
    # Redaction, in every message that shows a URL (repr, describe, the exit report, botocore's)
    for form in (url, f"s3:/{KEY}:{SLASHED}@bucket/prefix", f"s3:{KEY}:{SLASHED}@bucket/prefix",
                 f"https://{KEY}:{SLASHED}@s3.example.com/bucket/prefix", f"gs://{KEY}:{SLASHED}@bucket/prefix"):
        message = redact_url(f"<SaveFuture {form}/x step=1 in flight> Store('{form}')")
        assert "bucket/prefix/x step=1 in flight> Store(" in message and "bucket/prefix')" in message, message
        _no_secret(message)
        assert "bucket/prefix" in shown(form) and "***@" in shown(form), shown(form)
        _no_secret(redact_url(form) + shown(form))
    assert shown(f"s3://{KEY}:{SLASHED}") == "s3://***/..."
    # ... and never where an '@' is part of a path, or a ':' a port
    for kept in ("s3://bucket/model@v2/x", "http://minio:9000/bucket/model@v2/x", "http://[::1]:9000/b/m@v2",
                 "file://exp:a/model@v2", "s3://Legacy_Bucket.x/p@q"):
        assert redact_url(f"at {kept}: failed") == f"at {kept}: failed" and shown(kept) == kept
    assert open_storage("s3://Legacy_Bucket.x/p@q").bucket == "Legacy_Bucket.x"  # upper case, '_': the server judges


# ---------------------------------------------------------------------------- the URL rule
def test_s3_with_one_slash_is_refused_with_a_suggestion_not_saved_locally(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call in (lambda: ckptstore.save({"w": torch.ones(2)}, "s3:/bucket/x").result(timeout=60),
                 lambda: ckptstore.load("s3:/bucket/x"), lambda: ckptstore.Store("s3:/bucket/x")):
        with pytest.raises(InvalidURLError, match="did you mean s3://bucket/x"):
            call()
    assert os.listdir(tmp_path) == [], "s3:/bucket/x became a local directory"
    r = cli("ls", "s3:/bucket/x")
    assert r.exit_code == 2 and "did you mean s3://bucket/x" in r.stderr and "s3://bucket/prefix" in r.stderr
    for url, fix in (("S3://bucket/x", "s3://bucket/x"), ("s3:bucket/x", "s3://bucket/x"),
                     ("file:/tmp/x", "file:///tmp/x")):
        with pytest.raises(InvalidURLError, match=f"did you mean {fix}"):
            open_storage(url)


@pytest.mark.parametrize("url", ["gs://bucket/x", "hdfs://namenode/x", "hdfs:/x", "s4://bucket/x", "https://h/x"])
def test_an_unsupported_scheme_names_the_supported_ones(url):
    with pytest.raises(InvalidURLError) as ei:
        ckptstore.load(url)
    text = str(ei.value)
    assert f"unsupported URL scheme {url.split(':')[0]!r}" in text
    for form in ("s3://bucket/prefix", "file:///path", "memory://", "local path"):
        assert form in text, text
    r = cli("verify", url)
    assert r.exit_code == 2 and "s3://bucket/prefix" in r.stderr


def test_colons_later_in_a_relative_path_and_file_urls_stay_local(tmp_path, monkeypatch):
    """Only a leading scheme makes a URL: "runs/b://c" was refused as the scheme 'runs/b'."""
    monkeypatch.chdir(tmp_path)
    for path in ("runs/b://c", "runs/exp:1/ckpt", "ckpt:v1/model.pt", "./gs:/x", "C:/x"):
        ckptstore.save({"w": torch.ones(2)}, path).result(timeout=60)
        assert torch.equal(ckptstore.load(path)["w"], torch.ones(2)), path
    assert os.path.isdir(tmp_path / "runs" / "exp:1" / "ckpt") and os.path.isdir(tmp_path / "gs:" / "x")
    assert torch.equal(ckptstore.load(f"file://{tmp_path}/runs/exp:1/ckpt")["w"], torch.ones(2))
    assert cli("ls", "runs/exp:1/ckpt").exit_code == 0


# ---------------------------------------------------------------------------- a store where a checkpoint goes
def test_loading_a_store_root_says_it_is_a_store_and_what_to_pass(tmp_path):
    root = str(tmp_path / "runs" / "exp1")
    _store(root, steps=(10, 20, 30, 40))
    with pytest.raises(NotACheckpointError) as ei:
        ckptstore.load(root)
    text = str(ei.value)
    assert "a store root" in text and "newest steps 40, 30, 20" in text, text
    assert f"{root}/step-000000000040" in text and f"Store({root!r}).load()" in text, text
    for argv in (["export", root, str(tmp_path / "out.zarr"), "--zarr"], ["consolidate", root, str(tmp_path / "c")]):
        r = cli(*argv)
        assert r.exit_code == 2 and "a store root" in r.stderr and "step-000000000040" in r.stderr, r.output
        assert not os.path.exists(argv[2])


def test_store_load_of_a_missing_step_names_the_nearest_steps(tmp_path):
    store = _store(str(tmp_path / "run"), steps=(1000, 2000, 3000))
    with pytest.raises(CheckpointNotFoundError) as ei:
        store.load(2500)
    assert "nearest committed steps: 2000 (below) and 3000 (above)" in str(ei.value), str(ei.value)
    with pytest.raises(CheckpointNotFoundError, match=r"step: 3000 \(below\)"):
        store.load(12345)
    with pytest.raises(CheckpointNotFoundError, match=r"step: 1000 \(above\)"):
        store.manifest(5)
    with pytest.raises(CheckpointNotFoundError) as ei:  # a directory of stores is no store
        ckptstore.Store(str(tmp_path)).load()
    assert f"{tmp_path}/run (a store; newest steps 3000, 2000, 1000)" in str(ei.value), str(ei.value)


# ---------------------------------------------------------------------------- nothing here
def test_ls_and_verify_agree_on_nothing_here_and_point_below(tmp_path):
    runs = tmp_path / "runs"
    _store(str(runs / "exp1"), steps=(1, 2))
    ckptstore.save({"w": torch.ones(2)}, str(runs / "team" / "latest.pt")).result(timeout=60)
    (runs / "logs").mkdir()
    for argv in (["ls", str(runs)], ["ls", "--json", str(runs)], ["verify", str(runs)],
                 ["verify", "--json", str(runs)], ["ls", "--all", str(runs)]):
        r = cli(*argv)
        assert r.exit_code == 1, (argv, r.output)
        assert "no committed checkpoint here" in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert f"{runs}/exp1 (a store; newest steps 2, 1)" in r.stderr, r.stderr
        assert f"{runs}/team/latest.pt" in r.stderr and "logs" not in r.stderr, r.stderr
    assert json.loads(cli("ls", "--json", str(runs)).stdout) == []
    assert json.loads(cli("verify", "--json", str(runs)).stdout)["ok"] is False
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("ls", str(empty)).exit_code == cli("verify", str(empty)).exit_code == 1
    assert cli("ls", str(runs / "exp1")).exit_code == 0 and cli("verify", str(runs / "exp1")).exit_code == 0


def test_the_search_for_checkpoints_below_is_bounded(tmp_path):
    for i in range(60):
        (tmp_path / f"d{i:02d}" / "sub").mkdir(parents=True)
    ckptstore.save({"w": torch.ones(2)}, str(tmp_path / "d59" / "sub" / "ckpt")).result(timeout=60)
    listed = []

    class Counting(LocalStorage):
        def list(self, prefix=""):
            listed.append(self.root)
            return super().list(prefix)

        def child(self, prefix):
            return Counting(os.path.join(self.root, prefix))

    found = nearby.search(Counting(str(tmp_path)))
    assert len(listed) == nearby.MAX_LISTINGS and not found.complete
    assert found.listing(str(tmp_path)).endswith(", ...") or not found.below()


# ---------------------------------------------------------------------------- doctor
def test_doctor_prints_a_table_with_the_json_data(monkeypatch):
    import ckptstore.cli.doctor_cmd as cli_mod

    report = {"ckptstore": "9.9", "native": True, "native_reason": None, "hardware_threads": 2,
              "cuda": {"available": False, "runtime": None, "devices": [],
                       "native": {"compiled": True, "driver_version": 12040, "library": "",
                                  "error": "bad\x1b\nforged row"},
                       "native_off": "no driver"},
              "staging_pool": {"capacity": 3 * 1024 ** 3, "in_use": 0, "pinned": False, "backend": "native"},
              "backends": ["local", "memory"], "time": "2026-01-01T00:00:00+00:00"}
    monkeypatch.setattr(cli_mod, "doctor_report", lambda: report)
    assert json.loads(cli("doctor", "--json").stdout) == json.loads(json.dumps(report))
    r = cli("doctor")
    assert r.exit_code == 0
    text = r.stdout
    for bad in ("None", "True", "False", "{", "[", "'", "\x1b"):
        assert bad not in text, (bad, text)
    rows: dict[str, str] = {}
    for line in text.splitlines():  # label -> its first row
        rows.setdefault(re.split(r"\s{2,}", line.strip())[0], line)
    assert rows["native"].split() == ["native", "yes"] and rows["native reason"].split() == ["native", "reason", "-"]
    assert "3.0 GiB" in rows["capacity"] and "12.4" in rows["driver version"] and rows["devices"].endswith("none")
    assert rows["backends"].endswith("local, memory") and "bad\\x1b\\nforged row" in rows["error"]
    for key in ("hardware threads", "available", "compiled", "library", "in use", "pinned", "backend", "time"):
        assert key in rows, (key, text)
    assert text.splitlines()[-1].startswith("native CUDA path") and "OFF" in text.splitlines()[-1]
