"""The worker's bootstrap runs a script as ``python SCRIPT`` does and records any
exception; the launcher reads the first exception of a chain from the whole traceback;
an alert's failure never prints the command (review 35)."""

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

from ckptstore.supervisor import alerts, bootstrap, launch
from ckptstore.supervisor.classify import classify

SCRIPT = textwrap.dedent("""
    import atexit, os, pickle, sys, threading
    class Job:
        pass
    def late():
        print("THREAD", len(pickle.dumps(Job())) > 0, flush=True)
    def at_exit():
        print("ATEXIT", len(pickle.dumps(Job())) > 0, flush=True)
    atexit.register(at_exit)
    import __main__
    print("FILE", __file__, "ARGV0", sys.argv[0], "SPEC", __spec__, "SAME", __main__.__dict__ is globals(), flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    os.chdir("/")
    print("DATA", open(os.path.join(here, "data.txt")).read(), flush=True)
    t = threading.Thread(target=late)
    t.start()
""")


def test_a_script_keeps_its_main_module_and_an_absolute_file(tmp_path):
    """After the top-level code returns, a thread and an atexit handler still pickle a
    class of the script (runpy.run_path put the old __main__ back); ``__file__`` is
    absolute (``sys.argv[0]`` as given), so a script that chdirs finds its data."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.py").write_text(SCRIPT)
    (tmp_path / "d" / "data.txt").write_text("hello")
    out = subprocess.run([sys.executable, bootstrap.__file__, "file", "d/train.py", "x"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"FILE {tmp_path / 'd' / 'train.py'} ARGV0 d/train.py SPEC None SAME True" in lines, out.stdout
    assert "DATA hello" in lines and "THREAD True" in lines and "ATEXIT True" in lines, out.stdout + out.stderr


class _BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str() broke")


def test_an_exception_whose_str_raises_is_still_recorded(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    # without torch's writer: the fallback is what must survive
    monkeypatch.setitem(sys.modules, "torch.distributed.elastic.multiprocessing.errors", None)
    try:
        raise _BadStr("bad config")
    except _BadStr as e:
        bootstrap._record(e)
    data = json.loads(path.read_text())["message"]
    assert data["message"] == "_BadStr: <exception str() failed>"
    assert "raise _BadStr" in data["extraInfo"]["py_callstack"]


def _chain_with_a_long_backtrace() -> str:
    frames = "\n".join(f"frame #{i}: 0x7f00deadbeef in c10d::ProcessGroupGloo::runLoop(int) + {i}"
                       for i in range(120))
    return ("Traceback (most recent call last):\n  File \"/job/train.py\", line 3, in <module>\n"
            "    raise ValueError(\"label 7 out of range\")\nValueError: label 7 out of range\n\n"
            "During handling of the above exception, another exception occurred:\n\n"
            "Traceback (most recent call last):\n  File \"/job/train.py\", line 5, in <module>\n"
            "    raise RuntimeError(msg)\nRuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
            "Connection closed by peer [127.0.0.1]:29500\n" + frames + "\n")


def test_the_first_exception_is_read_from_the_whole_traceback(tmp_path):
    """A ~9 KB backtrace in the second exception of the chain: the program's ValueError
    still decides (it was the gloo error: transient, retried as the machinery's)."""
    tb = _chain_with_a_long_backtrace()
    assert len(tb) > 8000
    error = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    (tmp_path / "e.json").write_text("{}")
    f = SimpleNamespace(error_file=str(tmp_path / "e.json"), local_rank=0, pid=1, exitcode=1, timestamp=0,
                        signal_name=lambda: None,
                        error_file_data={"message": {"message": error, "extraInfo": {"py_callstack": tb}}})
    failure = launch._failure(f)
    assert failure["first"] == "ValueError: label 7 out of range"
    kept = failure["traceback"]
    assert len(kept) < 8100 and kept.startswith("Traceback") and kept.endswith(tb[-200:])
    assert "characters left out" in kept and "ValueError: label 7 out of range" in kept
    v = classify({"ok": False, "failures": {"0": failure}}, step=4)
    assert v.signature and v.signature.startswith("ValueError: label N out of range"), v
    assert "ValueError: label 7 out of range" in v.reason and not v.outage


def test_a_timed_out_alert_does_not_print_its_command(capsys):
    alerts.run("sleep 5 # https://hooks.example.com/services/T0KEN", {"event": "x"}, timeout=0.3)
    err = capsys.readouterr().err
    assert "timed out" in err and "T0KEN" not in err and "hooks.example" not in err, err
