"""The ``ckptstore`` command: ls, doctor, consolidate, --help everywhere, exit codes.

Fast cases run the click command in-process (CliRunner); what a shell sees (exit codes,
one-line errors without a traceback, ``python -m ckptstore.cli``) runs as real
subprocesses, started together because importing torch dominates their cost.
verify and gc have their own files (test_verify.py, test_gc.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cliutil import age_files, cli, cli_env, failed_attempt, run_cli_processes

import ckptstore

pytestmark = pytest.mark.usefixtures("observe_earlier_failures")

COMMANDS = {
    "ls": ["--json", "--all"],
    "verify": ["--quick", "--json"],
    "gc": ["--keep-last", "--keep-every", "--keep-within", "--keep-best", "--grace", "--dry-run", "--json"],
    "doctor": ["--json"],
    "consolidate": ["--torch", "--rank", "--weights-only"],
    "export": ["--zarr", "--rank", "--extension-types", "--json"],
    "import": [],
}


# ---------------------------------------------------------------------------- helpers
def one_line_error(r) -> str:
    """An expected error: exit 2, nothing on stdout, one line on stderr, no traceback."""
    assert r.returncode == 2, (r.args, r.returncode, r.stdout, r.stderr)
    assert r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptstore: "), r.stderr
    return lines[0]


def state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "b": torch.arange(64) + step, "step": step}


def make_store(root, steps=(0, 10, 20)) -> ckptstore.Store:
    store = ckptstore.Store(root)
    for s in steps:
        store.save(s, state(s), metrics={"loss": 1.0 / (s + 1), "acc": s / 100}).result()
    return store


# ---------------------------------------------------------------------------- --help, --version, real processes
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_on_every_command(command):
    for flag in ("--help", "-h"):
        r = cli(command, flag)
        assert r.exit_code == 0, r.output
        assert r.stdout.startswith("Usage: ") and f" {command} [OPTIONS]" in r.stdout.splitlines()[0]
        for option in COMMANDS[command]:
            assert option in r.stdout, f"{command} --help does not mention {option}"


def test_version():
    r = cli("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"ckptstore, version {ckptstore.__version__}"


def test_cli_processes_exit_codes_and_one_line_errors(tmp_path):
    """What a shell sees: ``python -m ckptstore.cli`` for help, ls, and the expected errors
    (missing store, a file instead of a store, a bad option)."""
    root = str(tmp_path / "store")
    make_store(root)
    some_file = tmp_path / "file.pt"
    torch.save({"x": torch.ones(2)}, some_file)
    missing = str(tmp_path / "no-such-store")
    procs = run_cli_processes(["--help"], ["ls", root], ["ls", missing], ["ls", str(some_file)],
                              ["gc", "--keep-best", "loss:avg:1", root])
    helped, table, ls_missing, ls_file, bad_best = procs
    assert helped.returncode == 0
    for command in COMMANDS:
        assert f"\n  {command} " in helped.stdout, helped.stdout
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "STEP", "COMMITTED"]
    assert [r.split()[:2] for r in rows] == [["step-000000000000", "0"], ["step-000000000010", "10"],
                                             ["step-000000000020", "20"]]
    assert "no-such-store" in one_line_error(ls_missing)
    assert "file.pt" in one_line_error(ls_file)
    assert bad_best.returncode == 2 and "Traceback" not in bad_best.stderr, bad_best.stderr
    assert "Error: Invalid value for '--keep-best'" in bad_best.stderr, bad_best.stderr
    assert os.path.isdir(os.path.join(root, "step-000000000000")), "a refused gc deleted something"
    assert ckptstore.Store(root).steps() == [0, 10, 20]


# ---------------------------------------------------------------------------- ls
def test_ls_json_lists_committed_checkpoints_oldest_first(tmp_path):
    root = str(tmp_path / "store")
    store = make_store(root, steps=(30, 0, 10))  # saved out of step order
    store.pin(10, note="release")
    r = cli("ls", "--json", root)
    assert r.exit_code == 0
    recs = json.loads(r.stdout)
    assert [x["name"] for x in recs] == ["step-000000000000", "step-000000000010", "step-000000000030"]
    for rec in recs:
        m = store.manifest(rec["step"])
        assert {"name", "step", "committed_at", "bytes"} <= set(rec)
        assert rec["committed"] is True and rec["generation"] == 1 and rec["world_size"] == 1
        assert rec["committed_at"] == m.committed_at
        assert (rec["bytes"], rec["raw_bytes"]) == (m.stored_bytes, m.raw_bytes)
        assert rec["metrics"] == {"loss": 1.0 / (rec["step"] + 1), "acc": rec["step"] / 100}
        assert rec["pinned"] is (rec["step"] == 10)
        assert rec["url"] == os.path.join(root, rec["name"])
        assert "attempts" not in rec
    table = cli("ls", root).stdout.splitlines()
    assert len(table) == 4
    assert "pinned" in table[2] and "pinned" not in table[1] + table[3]
    assert "loss=0.09090909090909091, acc=0.1" in table[2]


def test_ls_on_a_single_checkpoint_path(tmp_path):
    path = str(tmp_path / "latest.pt")
    ckptstore.save(state(1), path).result()
    m = ckptstore.save(state(2), path).result()  # a second generation
    recs = json.loads(cli("ls", "--json", path).stdout)
    assert len(recs) == 1
    rec = recs[0]
    assert (rec["name"], rec["step"], rec["generation"], rec["committed_at"], rec["bytes"]) == (
        ".", None, 2, m.committed_at, m.stored_bytes)
    assert cli("ls", path).stdout.splitlines()[1].split()[0] == "."


def test_ls_all_shows_uncommitted_attempts_with_age_and_votes(tmp_path):
    root = str(tmp_path / "store")
    store = make_store(root, steps=(0, 5))
    lone_rank1 = failed_attempt(store.location(7), state(7), rank=1, step=7)
    lone_rank0 = failed_attempt(store.location(7), state(7), rank=0, step=7)
    debris = failed_attempt(store.location(5), state(5), rank=1, step=5)  # beside a committed checkpoint
    age_files(os.path.join(root, "step-000000000007", "attempts", lone_rank1), 3600)

    plain = json.loads(cli("ls", "--json", root).stdout)
    assert [r["name"] for r in plain] == ["step-000000000000", "step-000000000005"]

    recs = {r["name"]: r for r in json.loads(cli("ls", "--json", "--all", root).stdout)}
    assert list(recs) == ["step-000000000000", "step-000000000005", "step-000000000007"]
    un = recs["step-000000000007"]
    assert (un["committed"], un["step"], un["committed_at"], un["generation"], un["bytes"]) == (False, 7, None, None, 0)
    attempts = {a["attempt"]: a for a in un["attempts"]}
    assert set(attempts) == {lone_rank1, lone_rank0}
    a1, a0 = attempts[lone_rank1], attempts[lone_rank0]
    assert (a1["voted"], a1["aborted"], a1["committed"]) == ([1], False, False)
    assert (a0["voted"], a0["aborted"], a0["committed"]) == ([0], True, False)
    assert 3600 <= a1["age_s"] < 3600 + 600 and 0 <= a0["age_s"] < 3600
    assert a1["files"] == 2 and a0["files"] == 4 and a1["bytes"] > 0  # a0: data, no-vote, abort marker, outcome
    committed = {a["attempt"]: a for a in recs["step-000000000005"]["attempts"]}
    assert committed[store.manifest(5).attempt]["committed"] is True
    assert committed[debris]["committed"] is False and committed[debris]["voted"] == [1]

    table = cli("ls", "--all", root).stdout
    row = next(line for line in table.splitlines() if lone_rank1 in line)
    assert "uncommitted, age 3" in row and "voted [1]" in row
    row = next(line for line in table.splitlines() if lone_rank0 in line)
    assert "voted [0]" in row and "aborted" in row
    assert "step-000000000007" in table and "uncommitted" in table


def test_ls_all_shows_an_attempt_left_by_a_killed_save(tmp_path):
    """A process SIGKILLed mid-save (by itself, right after its vote became durable and
    before the manifest) leaves an attempt that ls --all reports and plain ls does not."""
    root = str(tmp_path / "store")
    make_store(root, steps=(0,))
    code = (
        "import os, signal, sys, torch\n"
        "from ckptstore import format as fmt\n"
        "from ckptstore.checkpoint.save import SaveOptions, start_save\n"
        "from ckptstore.runtime import runtime\n"
        "from ckptstore.storage import LocalStorage\n"
        "class DieAfterVote(LocalStorage):\n"
        "    def put(self, key, data, *, if_absent=False):\n"
        "        super().put(key, data, if_absent=if_absent)\n"
        "        if key.endswith('/vote-r00000.json'):\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "where = DieAfterVote(os.path.join(sys.argv[1], fmt.step_dir_name(3)))\n"
        "start_save({'w': torch.ones(1000)}, where, rt=runtime(), attempt=fmt.new_attempt_id(), step=3,\n"
        "           rank=0, world_size=2, metrics=None, options=SaveOptions()).result()\n"
    )
    p = subprocess.run([sys.executable, "-c", code, root], env=cli_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == -9, p.stderr
    recs = json.loads(cli("ls", "--json", "--all", root).stdout)
    assert [(r["name"], r["committed"]) for r in recs] == [("step-000000000000", True), ("step-000000000003", False)]
    (a,) = recs[1]["attempts"]
    assert a["voted"] == [0] and a["aborted"] is False and a["files"] == 2
    assert [r["name"] for r in json.loads(cli("ls", "--json", root).stdout)] == ["step-000000000000"]


def test_ls_empty_and_error_cases(tmp_path):
    """Nothing at the URL is exit 1 for ls as for verify (docs/operations.md, "Nothing
    here"): --json still prints its (empty) list; the table prints nothing."""
    os.makedirs(tmp_path / "empty")
    r = cli("ls", "--json", str(tmp_path / "empty"))
    assert r.exit_code == 1 and json.loads(r.stdout) == []
    assert "no committed checkpoint here" in r.stderr and r.stderr.count("\n") == 1
    r = cli("ls", str(tmp_path / "empty"))
    assert r.exit_code == 1 and r.stdout == "" and "no committed checkpoint here" in r.stderr
    r = cli("ls", str(tmp_path / "missing"))
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "missing" in r.stderr
    r = cli("ls")
    assert r.exit_code == 2 and "Missing argument 'URL'" in r.stderr


# ---------------------------------------------------------------------------- doctor, consolidate
def test_doctor_json_reports_environment():
    r = cli("doctor", "--json")
    assert r.exit_code == 0
    rep = json.loads(r.stdout)
    for key in ("ckptstore", "native", "python", "torch", "zstandard", "xxhash", "cuda", "staging_pool", "backends"):
        assert key in rep, key
    assert rep["ckptstore"] == ckptstore.__version__ and rep["torch"] == torch.__version__
    assert isinstance(rep["native"], bool) and rep["cuda"]["available"] == torch.cuda.is_available()
    assert {"local", "memory"} <= set(rep["backends"])
    assert set(rep["staging_pool"]) >= {"capacity", "in_use"}
    assert rep["staging_pool"]["backend"] == ckptstore.pipeline.runtime().pool.backend
    native_cuda = rep["cuda"]["native"]
    assert set(native_cuda) >= {"compiled", "available", "devices", "error"}
    assert native_cuda["available"] == ckptstore.native.cuda_available()
    text = cli("doctor").stdout
    assert text.splitlines()[0].split() == ["ckptstore", ckptstore.__version__]


def test_consolidate_to_checkpoint_and_to_torch_file(tmp_path):
    root = str(tmp_path / "store")
    make_store(root, steps=(4,))
    src = os.path.join(root, "step-000000000004")
    dst = str(tmp_path / "consolidated")
    r = cli("consolidate", src, dst)
    assert r.exit_code == 0 and r.stdout.strip() == f"wrote {dst}"
    got = ckptstore.load(dst)
    assert torch.equal(got["w"], state(4)["w"]) and torch.equal(got["b"], state(4)["b"]) and got["step"] == 4
    assert ckptstore.verify(dst) == []
    pt = str(tmp_path / "model.pt")
    assert cli("consolidate", "--torch", src, pt).exit_code == 0
    got = torch.load(pt, weights_only=True)
    assert torch.equal(got["b"], state(4)["b"]) and got["step"] == 4
    r = cli("consolidate", "--torch", src, pt)  # never overwrites
    assert r.exit_code == 2 and "already exists" in r.stderr
    r = cli("consolidate", str(tmp_path / "nothing"), str(tmp_path / "x"))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1


def test_consolidate_never_replaces_an_existing_checkpoint(tmp_path):
    """Like --torch, the checkpoint form refuses an existing destination (exit 2) instead
    of committing a new generation over it (which retires what was there)."""
    root = str(tmp_path / "store")
    make_store(root, steps=(4, 5))
    src, dst = os.path.join(root, "step-000000000004"), os.path.join(root, "step-000000000005")
    before = ckptstore.Store(root).manifest(5)
    r = cli("consolidate", src, dst)
    assert r.exit_code == 2 and "already exists" in r.stderr, r.output
    assert ckptstore.Store(root).manifest(5) == before and ckptstore.load(dst)["step"] == 5


def test_long_commands_show_progress_on_a_terminal_and_stay_quiet_otherwise(tmp_path):
    """verify, gc, consolidate and export draw a bar (with its ETA) on a terminal's
    stderr; piped, or with --json, they print none."""
    import pty

    path = str(tmp_path / "ckpt")
    ckptstore.save({"w": torch.randn(512, 1024)}, path).result()
    runs = {"verify": ["verify", path], "export": ["export", path, str(tmp_path / "out.zarr"), "--zarr"],
            "gc": ["gc", path], "consolidate": ["consolidate", path, str(tmp_path / "whole")]}
    for name, args in runs.items():
        if name == "export":
            pytest.importorskip("tensorstore")
        main_fd, tty = pty.openpty()
        try:
            r = subprocess.run([sys.executable, "-m", "ckptstore.cli", *args], stdout=subprocess.PIPE, stderr=tty,
                               env=cli_env(), timeout=300)
            os.close(tty)
            seen = b""
            while True:
                try:
                    piece = os.read(main_fd, 65536)
                except OSError:  # the terminal closed: all read
                    break
                if not piece:
                    break
                seen += piece
        finally:
            os.close(main_fd)
        assert r.returncode == 0, (name, r.stdout, seen)
        label = {"verify": b"verifying", "export": b"exporting", "gc": b"deleting", "consolidate": b"reading"}[name]
        assert label in seen, (name, seen)
    piped = subprocess.run([sys.executable, "-m", "ckptstore.cli", "verify", path], capture_output=True,
                           env=cli_env(), timeout=300)
    assert piped.returncode == 0 and b"verifying" not in piped.stderr


def test_text_output_escapes_what_the_store_says_and_survives_names_that_are_not_utf8(tmp_path):
    """A metric is any JSON string: a lone surrogate ("\\udcff") made ls and gc die with
    a UnicodeEncodeError traceback (gc after it had deleted), and a newline forged a row
    of the ls table. So did a file name that is not UTF-8."""
    import glob

    root = str(tmp_path / "store")
    store = ckptstore.Store(root)
    store.save(1, {"w": torch.ones(4)}, metrics={"loss": 1.0}).result(timeout=60)
    store.save(2, {"w": torch.ones(4)}, metrics={"loss": 2.0}).result(timeout=60)
    store.save(3, {"w": torch.ones(4)}, metrics={"loss": 3.0}).result(timeout=60)
    forged = "x\x1b[2J\nstep-000000000999  999  2099-01-01 00:00:00  1  1 B  1 B"
    for step, value in ((2, "\udcff"), (3, forged)):
        (path,) = glob.glob(os.path.join(root, f"step-{step:012d}", "manifest-*.json"))
        with open(path) as f:
            doc = json.load(f)
        doc["metrics"]["loss"] = value
        with open(path, "w") as f:
            json.dump(doc, f)  # strict JSON: the surrogate travels as "\udcff"
    (attempt,) = glob.glob(os.path.join(root, "step-000000000001", "attempts", "*"))
    open(os.fsencode(attempt) + b"/\xff-not-utf8", "wb").close()
    env = {**cli_env(), "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    runs = {}
    for argv in (["ls", root], ["verify", root], ["gc", "--dry-run", "--keep-last", "1", root],
                 ["gc", "--keep-last", "1", root]):
        r = subprocess.run([sys.executable, "-m", "ckptstore.cli", *argv], capture_output=True, text=True,
                           env=env, timeout=180)
        assert "Traceback" not in r.stderr, (argv, r.stderr)
        assert "\x1b" not in r.stdout and "\udcff" not in r.stdout
        runs[" ".join(argv[:2])] = r
    ls = runs[f"ls {root}"]
    assert ls.returncode == 0
    rows = ls.stdout.splitlines()
    assert [row.split()[0] for row in rows] == ["NAME", "step-000000000001", "step-000000000002", "step-000000000003"]
    assert "loss=\\udcff" in rows[2] and "loss=x\\x1b[2J\\nstep-000000000999" in rows[3]
    assert runs[f"verify {root}"].returncode == 0
    gc = runs["gc --keep-last"]
    assert gc.returncode == 0 and "left    foreign    step-000000000001/attempts/" in gc.stdout
    assert "/\\udcff-not-utf8: not a name ckptstore writes" in gc.stdout
    assert ckptstore.Store(root).steps() == [3]
