"""Which recovery ``ckptstore run`` chooses (supervisor/mode.py): in-job by default for a
script that enters through ``ckptstore.inprocess.run`` on a fixed number of nodes, a cold
relaunch otherwise, and the options that force either."""

from __future__ import annotations

import pytest
from torch.distributed.run import parse_args

from ckptstore.supervisor import mode


def _args(tmp_path, source: str, *opts):
    script = tmp_path / "train.py"
    script.write_text(source)
    return parse_args([*opts, str(script)])


@pytest.mark.parametrize("source", [
    "import ckptstore\nckptstore.inprocess.run(main, args)\n",
    "from ckptstore import inprocess\ninprocess.run(main)\n",
    "from ckptstore.inprocess import run, atomic\nrun(main)\n",
])
def test_a_script_entering_through_inprocess_run_gets_in_job_recovery(tmp_path, source):
    in_job, why = mode.choose(None, _args(tmp_path, source, "--standalone"))
    assert in_job and "inprocess.run" in why


@pytest.mark.parametrize("source", ["import torch\nmain()\n", "# ckptstore.inprocess is not used here\nmain()\n"])
def test_any_other_script_is_relaunched_cold_and_told_why(tmp_path, source):
    in_job, why = mode.choose(None, _args(tmp_path, source, "--standalone"))
    assert not in_job and "does not call ckptstore.inprocess.run" in why and "training.md" in why


def test_elastic_node_counts_and_programs_are_relaunched_cold(tmp_path):
    source = "ckptstore.inprocess.run(main)\n"
    in_job, why = mode.choose(None, _args(tmp_path, source, "--nnodes", "1:2"))
    assert not in_job and "fixed number of nodes" in why
    assert mode.choose(None, parse_args(["--no-python", "/bin/true"]))[0] is False


def test_the_options_force_either_mode(tmp_path):
    plain = _args(tmp_path, "main()\n", "--standalone")
    assert mode.choose(True, plain)[0] is True
    uses = _args(tmp_path, "ckptstore.inprocess.run(main)\n", "--standalone")
    in_job, why = mode.choose(False, uses)
    assert not in_job and "--no-in-job" in why


def test_a_module_is_found_without_running_it(tmp_path, monkeypatch):
    pkg = tmp_path / "mytrain.py"
    pkg.write_text("raise SystemExit('imported!')\nckptstore.inprocess.run(main)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert mode.choose(None, parse_args(["-m", "mytrain"]))[0] is True
    assert mode.choose(None, parse_args(["-m", "no_such_module_here"]))[0] is False
