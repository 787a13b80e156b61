"""``ckptstore run`` (issue 13) with the store on a moto S3 server (tests/s3util.py: HTTP on
127.0.0.1): the supervisor, its launcher and the ranks find the endpoint and the test
credentials only through the environment (``AWS_ENDPOINT_URL`` and friends), as a user's
job would; the checkpoints and the journal live in the bucket, nowhere on local disk.

- a rank SIGKILLed after step 5 committed recovers to the end, bit-identical with an
  uninterrupted run (the reference is trained on local disk: where checkpoints live does
  not change the training), and the journal read from S3 and ``ckptstore status
  s3://... --json`` hold one restart and one transient failure with its lost work;
- a ``DeterministicError`` stops the run at once with the deterministic exit code, and
  the give-up is in the S3 journal.

The same scenarios on local disk, and the others: tests/test_supervisor.py."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto.server")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import s3util  # noqa: E402
from test_supervisor import (  # noqa: E402  (no test_* name imported: pytest would collect it here)
    Supervised,
    assert_bit_identical,
    injected,
    journal,
    kinds,
    nonzero,
    reasons,
    reference,  # noqa: F401 (an uninterrupted run, checkpoints on local disk: conftest's, one per session)
    status,
)

from ckptstore.supervisor import runner  # noqa: E402
from ckptstore.supervisor.journal import JOURNAL_DIR  # noqa: E402


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def endpoint():
    return s3util.moto_endpoint()


@pytest.fixture
def s3env(endpoint, monkeypatch):
    """This process (the journal reads, the status CLI) finds the moto server through
    boto3's standard configuration, as the supervisor's children do."""
    return s3util.point_boto3_at(endpoint, monkeypatch)


@pytest.fixture
def bucket(endpoint):
    name = s3util.new_bucket(endpoint)
    yield name
    s3util.empty_bucket(name, endpoint)


def s3_keys(bucket: str, prefix: str) -> list[str]:
    client = s3util.admin_client()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", ())]
    return keys


def assert_nothing_local(tmp_path: Path) -> None:
    """An s3:// URL mistaken for a path would have made a directory ``s3:``."""
    for where in (Path.cwd(), tmp_path):
        assert not (where / "s3:").exists(), where


# ---------------------------------------------------------------------------- scenarios
def test_a_killed_rank_recovers_bit_identical_with_the_store_on_s3(tmp_path, s3env, bucket, reference):  # noqa: F811
    store = f"s3://{bucket}/run"
    # Rank 1 stops about to train step 12 (once), so the kill sent from here lands there
    # whatever the machine's load: a kill sent as soon as "committed step 5" is read could
    # land as late as the last step, where it reads as a teardown failure
    # (test_supervisor.injected) and proves nothing.
    job = Supervised(store, tmp_path, fault=f"hang:12:{tmp_path / 'stopped-once'}", env=s3env)
    job.stopped(12, committed=10)  # (saved before the stop, committed in the background)
    os.kill(job.pids[1], signal.SIGKILL)
    job.expect(lambda l: l.startswith("rank 0: resumed at step"), "the relaunch")
    assert job.finish() == runner.EXIT_FINISHED, job.output()[-3000:]
    assert_bit_identical(job.final, reference)

    keys = s3_keys(bucket, "run/")
    assert any(k.startswith(f"run/{JOURNAL_DIR}/") for k in keys), keys
    assert any(not k.startswith(f"run/{JOURNAL_DIR}/") for k in keys), keys  # the checkpoints
    assert_nothing_local(tmp_path)

    events = journal(store)  # read from S3 through the environment
    assert len(kinds(events, "run_start")) == 1 and len(kinds(events, "finish")) == 1
    failures = kinds(events, "failure")
    assert [e["attempt"] for e in kinds(events, "attempt_start")] == list(range(len(failures) + 1))
    caused = injected(failures)
    assert [f["class"] for f in caused] == ["transient"], reasons(failures)
    f = caused[0]
    assert failures[0] is f  # a teardown failure (test_supervisor.injected) can only come after it
    assert (f["signal"], f["rank"]) == ("SIGKILL", 1), f
    assert f["checkpoint_step"] == 10, f
    assert f["step"] >= f["checkpoint_step"] and f["lost_steps"] == f["step"] - f["checkpoint_step"], f
    assert f["checkpoint_age_s"] is not None and f["checkpoint_age_s"] >= 0, f
    resumes = kinds(events, "resume")
    assert [r["step"] for r in resumes] == [None] + [x["checkpoint_step"] for x in failures], resumes
    resumed = {int(l.split()[5]) for l in job.lines if l.startswith("rank 0: resumed at step")}
    assert resumed == {x["checkpoint_step"] for x in failures}, resumed

    st = status(store)  # the CLI, through click's CliRunner, finds the endpoint in the environment
    n = len(failures)
    assert (st["state"], st["restarts"], nonzero(st["failures_by_class"])) == ("finished", n, {"transient": n})
    assert [(x["class"], x["step"], x["lost_steps"]) for x in st["failures"]] == \
        [("transient", x["step"], x["step"] - x["checkpoint_step"]) for x in failures], st["failures"]
    assert st["lost_steps"] == sum(x["lost_steps"] for x in failures)
    assert st["checkpoint_step"] == 25  # the last multiple of --every 5 below 30 steps, committed on S3
    assert 0 < st["goodput"] <= 1 and st["recommended_interval_steps"] >= 1
    assert [e["kind"] for e in job.alert_events()] == ["failure"] * n


def test_a_deterministic_error_stops_at_once_with_the_store_on_s3(tmp_path, s3env, bucket):
    store = f"s3://{bucket}/run"
    job = Supervised(store, tmp_path, fault="deterministic:8", env=s3env)
    assert job.finish() == runner.EXIT_DETERMINISTIC, job.output()[-3000:]
    assert_nothing_local(tmp_path)
    events = journal(store)
    assert len(kinds(events, "attempt_start")) == 1
    failures = kinds(events, "failure")
    assert [f["class"] for f in failures] == ["deterministic"], failures
    assert "DeterministicError" in failures[0]["reason"] and failures[0]["step"] == 7, failures
    give_up = kinds(events, "give_up")
    assert [(g["code"], g["class"]) for g in give_up] == [(runner.EXIT_DETERMINISTIC, "deterministic")], give_up
    assert not kinds(events, "finish")
    assert [e["kind"] for e in job.alert_events()] == ["failure", "give_up"]
    st = status(store)
    assert (st["state"], st["restarts"], nonzero(st["failures_by_class"])) == ("gave_up", 0, {"deterministic": 1})
