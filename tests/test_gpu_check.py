"""bench/gpu_check.{sh,py}, the device check, on a machine without a GPU: its argument
parsing, its environment record, the dry run, the worker protocol and its report of
"no GPU" work, so that the script cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "gpu_check.py")
sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_check  # noqa: E402


def test_arguments_are_parsed_and_checked():
    args = gpu_check.parse(["--gib", "0.5", "--only", "a_default,f_roundtrip", "--budget", "300"])
    assert (args.gib_bytes, args.checks, args.budget) == (1 << 29, ["a_default", "f_roundtrip"], 300)
    assert gpu_check.parse([]).checks == gpu_check.CHECKS
    assert set(gpu_check.CHECKS) == set(gpu_check.WORKERS)
    assert {c[0] for c in gpu_check.CHECKS} == set("abcdefgh")  # one or more per item of the issue
    for bad in (["--only", "z_nope"], ["--gib", "0"]):
        with pytest.raises(SystemExit):
            gpu_check.parse(bad)


def test_dry_run_records_the_environment_and_lists_the_checks(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["gpu"] == torch.cuda.is_available()
    assert set(env["cuda_info"]) >= {"compiled", "available", "driver_version", "error"}
    assert report["checks"] == gpu_check.CHECKS and report["results"] == {}
    assert report["status"] == "dry run" + ("" if torch.cuda.is_available() else ": no GPU")
    assert report["status"] in (tmp_path / "summary.txt").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU reports")
def test_without_a_gpu_a_real_run_fails_and_a_worker_reports_its_failure(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "FAIL: no GPU" in r.stdout
    res = gpu_check.run_check("f_roundtrip", [])  # the subprocess protocol, failing here
    assert res["status"] == "FAIL" and res["reason"] and res["seconds"] >= 0
    assert gpu_check.run_check("f_roundtrip", [], left=5)["reason"].startswith("not run")


def test_the_shell_wrapper_dry_run(tmp_path):
    r = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_check.sh"), "--dry-run"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "dry run (rc=0)" in summary and "would run: native, a_default" in summary
    # step 6 (in-job on the GPU): its benches' arguments parse and make the NCCL commands
    assert "step 6 dry run (rc=0): 3 bench commands" in summary
    log = (tmp_path / "gpu_check.log").read_text()
    assert "--nproc-per-node 1" in log and "--device cuda --backend nccl" in log
    assert (tmp_path / "env.txt").exists() and json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
