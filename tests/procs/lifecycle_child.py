"""Children for tests/test_lifecycle.py.

  sigterm <path>          save a few-MB state, print "staged", then block on stdin
                          (training goes on) until the parent's SIGTERM.
  exit <path>             save, print "staged", fall off the end (no wait()).
  loader <path>           load <path> again and again until stdin closes; prints "first <v>"
                          after the first load, then "summary <loads> <bad> <values seen>"
                          and one "bad <why>" line per load that saw an incomplete checkpoint.
  racer <path> <v> <fifo> print "waiting", block until the parent writes the FIFO, then save
                          uniform_state(v) to <path>; "committed <generation>" or "conflict".
"""

import os
import select
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from states import big_state, single_value, uniform_state  # noqa: E402


def say(*words):
    print(*words, flush=True)


what = sys.argv[1]
if what == "sigterm":
    fut = ckptstore.save(big_state(), sys.argv[2], chunk_bytes=256 << 10)
    say("staged", int(fut.done()))
    # The parent never writes: only SIGTERM ends this. Poll rather than block in read():
    # a signal that lands just before a blocking read() would leave its Python handler
    # pending until the read returns, which is never.
    while not select.select([sys.stdin], [], [], 0.2)[0]:
        pass
    say("stdin closed")  # not reached when the handler re-raises SIGTERM
elif what == "exit":
    fut = ckptstore.save(big_state(), sys.argv[2], chunk_bytes=256 << 10)
    say("staged", int(fut.done()))
elif what == "loader":
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    loads, bad, seen = 0, [], []
    while not stop.is_set():
        try:
            v = int(single_value(ckptstore.load(sys.argv[2])))
        except BaseException as e:  # noqa: BLE001 - every failure is reported
            bad.append(f"{type(e).__name__}: {e}")
        else:
            if not seen or seen[-1] != v:
                seen.append(v)
        loads += 1
        if loads == 1:
            say("first", seen[-1] if seen else "none")
    say("summary", loads, len(bad), ",".join(map(str, seen)))
    for b in bad[:5]:
        say("bad", b.replace("\n", " "))
elif what == "racer":
    path, value, fifo = sys.argv[2], int(sys.argv[3]), sys.argv[4]
    state = uniform_state(value, 1 << 20)
    say("waiting")
    with open(fifo, "rb") as f:
        assert f.read() == b"go\n"
    try:
        m = ckptstore.save(state, path, chunk_bytes=128 << 10).result()
    except ckptstore.CommitConflictError:
        say("conflict")
    else:
        say("committed", m.generation)
else:
    raise SystemExit(f"unknown scenario {what}")
