"""docs/examples/fault_tolerant_training.py with faults injected, for tests/test_supervisor.py.

FAULT (environment) = KIND:STEP[:MARKER], on rank 1 when it is about to train STEP:
  raise          RuntimeError with the same message every time (deterministic, found on repeat)
  deterministic  ckptstore.DeterministicError (stops the run at once)
  hang           blocks forever, once (MARKER file: not again after a restart)
  kill           SIGKILL itself, once (MARKER)
"""

import importlib.util
import os
import signal
import sys
import threading

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "examples",
                       "fault_tolerant_training.py")
spec = importlib.util.spec_from_file_location("fault_tolerant_training", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

import ckptstore  # noqa: E402

kind, step, *rest = os.environ.get("FAULT", "none:-1").split(":")
step = int(step)
marker = rest[0] if rest else None
original_batch = example.batch


def once() -> bool:
    if marker is None:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def batch(samples, rank, rows):
    global_batch = 16
    if rank == 1 and samples // global_batch == step and kind != "none":
        if kind == "raise":
            raise RuntimeError(f"bad data shard at sample {samples}")
        if kind == "deterministic":
            raise ckptstore.DeterministicError(f"non-finite loss at step {step}")
        if kind == "hang" and once():
            threading.Event().wait()
        if kind == "kill" and once():
            os.kill(os.getpid(), signal.SIGKILL)
    return original_batch(samples, rank, rows)


example.batch = batch
sys.argv[0] = EXAMPLE
example.main()
