"""docs/examples/fault_tolerant_training.py with faults injected, for tests/test_supervisor.py.

FAULT (environment) = KIND:STEP[:MARKER], or several joined by commas, on rank 1 when it
is about to train STEP (on every rank of this node with FAULT_ANY_RANK=1: a simulated
node's supervisor sets it for its own ranks, whatever global rank the rendezvous gives them):
  raise          RuntimeError with the same message every time (deterministic, found on repeat)
  deterministic  ckptstore.DeterministicError (stops the run at once)
  hang           says so and blocks forever, once (MARKER file: not again after a restart)
  kill           SIGKILL itself, once (MARKER)
  hangsave       blocks forever inside the save of STEP, once (MARKER): a save stuck on a peer
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
from ckptstore.supervisor.quick_exit import skip_final_collections  # noqa: E402

FAULTS = {}  # step -> (kind, marker)
for fault in os.environ.get("FAULT", "none:-1").split(","):
    kind, step, *rest = fault.split(":")
    if kind != "none":
        FAULTS[int(step)] = (kind, rest[0] if rest else None)
original_batch = example.batch


def once(marker) -> bool:
    if marker is None:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def batch(samples, rank, rows):
    global_batch = 16
    step = samples // global_batch
    if (rank == 1 or os.environ.get("FAULT_ANY_RANK") == "1") and step in FAULTS:
        kind, marker = FAULTS[step]
        if kind == "raise":
            raise RuntimeError(f"bad data shard at sample {samples}")
        if kind == "deterministic":
            raise ckptstore.DeterministicError(f"non-finite loss at step {step}")
        if kind == "hang" and once(marker):
            example.say(f"rank 1: stopped at step {step}")  # tests wait for this before killing it
            threading.Event().wait()
        if kind == "kill" and once(marker):
            os.kill(os.getpid(), signal.SIGKILL)
    return original_batch(samples, rank, rows)


example.batch = batch
_save = ckptstore.Store.save


def save(self, step, *args, **kwargs):
    kind, marker = FAULTS.get(step, (None, None))
    if os.environ.get("RANK") == "1" and kind == "hangsave" and once(marker):
        example.say(f"rank 1: stuck in the save of step {step}")
        threading.Event().wait()
    return _save(self, step, *args, **kwargs)


ckptstore.Store.save = save
sys.argv[0] = EXAMPLE
arguments = example.parse_args()
try:
    ckptstore.inprocess.run(example.main, arguments, backend=arguments.backend, warmup=example.build_model_once)
finally:  # the rank's exit, a second sooner: the interpreter's last collections skip torch's objects
    skip_final_collections()
