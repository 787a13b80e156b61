"""A pre-warmed process factory for the real-process tests.

Importing torch costs about two seconds; crash loops that start dozens of children
would spend most of their time there. This server imports torch and ckptstore once
(starting no threads: ckptstore creates its runtime lazily), then forks one child per
``run`` command. Each child is a real, separate process: the test SIGKILLs it by pid.

Protocol, one JSON object or word per line:
  zygote -> parent  "ready <path of the ckptstore package it imported>" once warm
  parent -> zygote  {"cmd": "run", "script": path, "argv": [...], "env": {...}}
  zygote -> parent  "pid <n>", then "out <line>" for each line the child prints on
                    stdout, then "eof" once the child's stdout closed (it died or exited).
  parent -> zygote  {"cmd": "reap"}   (sent after the parent is done signalling the
                    child, so its pid cannot be reused before the parent's kill)
  zygote -> parent  "exit <code>"    (negative signal number when killed, as subprocess)
The child's stderr is the zygote's stderr.
"""

import atexit
import json
import os
import runpy
import sys
import traceback

import torch  # noqa: F401  (the point: pay for the import once)
import ckptstore

try:  # ckptstore imports it on the first save (DTensor detection): warm it too
    import torch.distributed.tensor  # noqa: F401
except ImportError:
    pass


def _child(script: str, argv: list, env: dict, w: int) -> None:
    code = 0
    try:
        os.dup2(w, 1)
        os.close(w)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        os.environ.update(env)
        sys.argv = [script] + list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` does
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what a normal interpreter exit would run (ckptstore's drain)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main() -> None:
    out = sys.stdout
    out.write(f"ready {os.path.abspath(ckptstore.__file__)}\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] != "run":
            raise SystemExit(f"zygote: unexpected command {req!r}")
        r, w = os.pipe()
        out.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(req["script"], req.get("argv", []), req.get("env", {}), w)
        os.close(w)
        out.write(f"pid {pid}\n")
        out.flush()
        with os.fdopen(r, "r", errors="replace") as child_out:
            for cline in child_out:
                out.write("out " + cline.rstrip("\n") + "\n")
                out.flush()
        out.write("eof\n")
        out.flush()
        req = json.loads(sys.stdin.readline())
        if req["cmd"] != "reap":
            raise SystemExit(f"zygote: expected reap, got {req!r}")
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(f"exit {code}\n")
        out.flush()


if __name__ == "__main__":
    main()
