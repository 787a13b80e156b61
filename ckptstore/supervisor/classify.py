"""Why an attempt ended, from its evidence alone (decide.py weighs it against the
failures before: a repeat, an outage that lasts, the limits).

Evidence, in order of strength:

1. the program said so: an exception of type ``DeterministicError`` (ckptstore's, or any
   class of that name) in a rank's torchelastic error file, as the exception raised or
   as the first of its chain: deterministic;
2. a rank's own exception: the program's error (its signature: type, message with
   numbers and addresses normalised, and the step reached; the same twice in a row is
   deterministic, decide.py);
3. an exception that names a fault outside the job (:data:`OUTAGE_PATTERNS`: a refused
   or timed-out connection, an unreachable endpoint, an I/O error or stale handle of a
   mount, a busy device, CUDA out of memory right after a relaunch): transient, an
   *outage*, which decide.py retries for the outage window before it calls it the
   program's;
4. a rank killed by a signal (SIGKILL, SIGBUS, the OOM killer, SIGSEGV): transient;
   after it, a ``SystemExit`` with a non-zero status (the program's, as in 2: a SIGTERM
   handler that calls ``sys.exit`` raises one in the ranks the launcher stops);
5. errors of the machinery (:data:`MACHINERY_PATTERNS`): collective timeouts and lost
   peers (gloo, NCCL, its watchdog), rendezvous and store errors, a commit that timed
   out waiting for a peer, GPU hardware errors (ECC, Xid), and the SIGTERM a launcher
   sends the surviving ranks: consequences of another fault, never taken for the cause
   when a rank has an error of its own.

Which exception of a rank counts: the first of its chain. A traceback holds every
chained exception, the first one first; a program's ``ValueError`` whose cleanup then
timed out in a collective is the ``ValueError``, and a lost connection that the program
turned into its own ``RuntimeError`` (while handling it, or ``raise ... from``) is the
lost connection. Patterns are matched against that exception's type and message only,
not against the code lines of the traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Consequences of a fault elsewhere: never the cause when a rank has an error of its own.
MACHINERY_PATTERNS = [
    r"(?i:connection (closed|reset) by peer)", r"(?i:broken pipe)", r"\bECONNRESET\b",
    r"(?i:ProcessGroup\w*[^\n]*timed? ?out)", r"(?i:watchdog caught collective operation timeout)",
    r"(?i:collective operation timeout)", r"NCCL (error|Error|WARN)", r"ncclRemoteError", r"ncclSystemError",
    r"ncclInternalError", r"Gloo[^\n]*(connect|read|write)", r"\[gloo/", r"third_party/gloo/",
    r"\bDistNetworkError\b", r"\bDistStoreError\b", r"\bRendezvous\w*Error\b", r"\bCommitTimeoutError\b",
    r"(?i:ECC error)", r"(?i:uncorrectable ECC)", r"\bXid\b", r"(?i:fallen off the bus)", r"(?i:GPU is lost)",
    r"CUDA error: (an illegal memory access|unspecified launch failure|uncorrectable ECC error|"
    r"device-side assert)?[^\n]*hardware",
]
# A fault of something outside the job (network, a remote service, a mount, a device):
# retried for the outage window (decide.py), then judged the program's.
OUTAGE_PATTERNS = [
    r"(?i:connection refused)", r"\bECONNREFUSED\b", r"\bConnectionRefusedError\b", r"(?i:timed out)",
    r"(?i:connect(ion)? timeout)", r"(?i:read timeout)", r"\b(Read|Connect)Timeout(Error)?\b",
    r"^(\w+\.)*TimeoutError\b", r"\bEndpointConnectionError\b", r"(?i:could not connect to the endpoint)",
    r"^(\w+\.)*ConnectionError\b", r"\bTransientStorageError\b", r"\bSlowDown\b", r"\bRequestTimeout\b",
    r"\bServiceUnavailable\b", r"(?i:503 Service Unavailable)", r"(?i:temporary failure in name resolution)",
    r"\[Errno 5\]", r"\bEIO\b", r"(?i:input/output error)", r"\[Errno 116\]", r"\bESTALE\b",
    r"(?i:stale file handle)", r"(?i:busy or unavailable)", r"(?i:device or resource busy)",
]
# Out of memory at start-up after a relaunch: the last attempt's memory is not yet free.
_OOM = re.compile(r"(?i:CUDA out of memory)|\bOutOfMemoryError\b")
_MACHINERY = re.compile("|".join(f"(?:{p})" for p in MACHINERY_PATTERNS), re.MULTILINE)
_OUTAGE = re.compile("|".join(f"(?:{p})" for p in OUTAGE_PATTERNS), re.MULTILINE)
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
# NCCL's own verdict on a call the program got wrong: the same error on every retry.
_MISUSE = re.compile(r"ncclInvalidUsage|ncclInvalidArgument|NCCL error[^\n]*invalid (usage|argument)")
# (InJobUnsupportedError: inprocess.run refused the program or this machine; a restart repeats it)
_DETERMINISTIC = re.compile(r"^(\w+\.)*(DeterministicError|InJobUnsupportedError)\b")
_EXIT = re.compile(r"^SystemExit\b")
_CHAIN = re.compile(r"\n[ \t]*\n(?:During handling of the above exception, another exception occurred|"
                    r"The above exception was the direct cause of the following exception):[ \t]*\n")
_FRAME = re.compile(r"^\s+File \"")


@dataclass
class Verdict:
    klass: str  # transient, deterministic, hang, preempted
    reason: str
    rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    traceback: str | None = None
    signature: str | None = None  # what makes two failures "the same" (decide.py)
    evidence: dict = field(default_factory=dict)
    outage: bool = False  # an error that names a fault outside the job (OUTAGE_PATTERNS)


def first_exception(error: str, traceback: str | None) -> str:
    """The first exception of the chain in ``traceback`` ("Type: message"), or
    ``error`` (the exception raised) when there is no chain to read."""
    if not traceback:
        return error
    parts = _CHAIN.split(traceback)
    if len(parts) < 2:
        return error
    return _exception_text(parts[0]) or error


def _exception_text(segment: str) -> str:
    """The "Type: message" lines of one exception of a formatted traceback: what
    follows its last frame (a ``File`` line, its code and caret lines, indented)."""
    lines = segment.strip("\n").split("\n")
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    start = 0
    if frames:
        start = frames[-1] + 1
        while start < len(lines) and lines[start][:1] in (" ", "\t"):
            start += 1
    elif lines and lines[0].startswith("Traceback (most recent call last)"):
        start = 1
    return "\n".join(lines[start:]).strip()


def kind(text: str, relaunched: bool = False) -> str:
    """"machinery", "outage" or "own" for one exception's type and message."""
    if _MISUSE.search(text):
        return "own"
    if _MACHINERY.search(text):
        return "machinery"
    if _OUTAGE.search(text) or (relaunched and _OOM.search(text)):
        return "outage"
    return "own"


def signature(error: str, step: int | None) -> str:
    """What makes two failures "the same": exception type and message with every number
    and address replaced, and the step reached (or that none was reported)."""
    where = f"step {step}" if step is not None else "no step reported"
    return f"{_NUMBERS.sub('N', error.strip())[:500]} @ {where}"


def at_step(step: int | None) -> str:
    return f"at step {step}" if step is not None else "no step reported"


def classify(result: dict, step: int | None, relaunched: bool = False) -> Verdict:
    """The verdict on an attempt whose launcher reported ``result`` (launch.py's JSON,
    or agent.py's), from that attempt alone. ``step``: the last step a rank reported
    (None: none did). ``relaunched``: a relaunch that trained no step yet (its CUDA out
    of memory is an outage: the previous attempt's memory may not be free yet)."""
    v = _classify(result, step, relaunched)
    gave_up = result.get("in_job_gave_up")
    if gave_up and v.klass != "deterministic":  # the in-job agent went cold: say why
        v.reason = f"in-job recovery gave up: {str(gave_up)[:500]}; {v.reason}"
    return v


def _classify(result: dict, step: int | None, relaunched: bool) -> Verdict:
    failures = {int(r): f for r, f in (result.get("failures") or {}).items()}
    if result.get("rendezvous_timeout") and not failures:  # several nodes: one never came (decide.py)
        v = Verdict("transient", "node(s) missing: torch's rendezvous did not complete within its join timeout")
        v.evidence["nodes_missing"] = True
        return v
    if result.get("stop_reason"):  # the in-job agent's verdict (agent.py): deterministic, judged there
        r = _int_or_none(result.get("stop_rank"))
        f = failures.get(r, {}) if r is not None else {}
        return _verdict("deterministic", str(result["stop_reason"]), r, f, f.get("signature"))
    if result.get("hang_reason"):  # the in-job agent's hang watch, before any step (agent.py)
        return Verdict("hang", str(result["hang_reason"]))
    if result.get("rendezvous_unreachable") and not failures and step is None:  # before any rank trained
        endpoint = result["rendezvous_unreachable"]
        if not relaunched:  # the first launch: the nodes may start minutes apart; the relaunch waits again
            return Verdict("transient", f"the rendezvous endpoint {endpoint} did not answer within torch's read "
                           "timeout: is the node whose address it is (its launcher hosts the c10d store) up?")
        v = Verdict("transient", f"node(s) missing: the rendezvous endpoint {endpoint} did not answer within the "
                    "join timeout (its c10d store is hosted by the launcher of the node whose address it is: that "
                    "node is gone)")
        v.evidence["nodes_missing"] = True
        return v
    if result.get("launcher_signal"):
        return Verdict("preempted", f"the launcher was stopped by {result['launcher_signal']}",
                       signal=result["launcher_signal"])
    errors = {r: f for r, f in failures.items() if f.get("error")}
    # launch.py read the first exception from the whole traceback (the one kept is clipped)
    first = {r: f.get("first") or first_exception(f["error"], f.get("traceback")) for r, f in errors.items()}
    for r, f in sorted(errors.items()):
        if _DETERMINISTIC.match(f["error"]) or _DETERMINISTIC.match(first[r]):
            return _verdict("deterministic", f"rank {r} raised {_error(f['error'], first[r])}", r, f)
    # A rank's own exception is the most specific evidence; the errors of the machinery
    # (a peer's connection closed) and the SIGTERM the launcher sends the surviving
    # ranks are consequences of some other rank's failure.
    kinds = {r: kind(first[r], relaunched) for r in errors}
    own = {r: f for r, f in errors.items() if kinds[r] == "own" and not _EXIT.match(first[r])}
    outage = {r: f for r, f in errors.items() if kinds[r] == "outage"}
    # A SystemExit with a non-zero status (argparse's usage error, a sys.exit(1)) is the
    # program's too, but weaker than a rank killed by a signal: a SIGTERM handler that
    # calls sys.exit in the ranks the launcher stops after a peer died raises one as well.
    exits = {r: f for r, f in errors.items() if kinds[r] == "own" and _EXIT.match(first[r])}
    killed = {r: f for r, f in failures.items() if f.get("signal") and f["signal"] != "SIGTERM"}
    if own or outage:
        return _raised(own or outage, first, step, outage=not own)
    if killed:
        r, f = min(killed.items())
        return _verdict("transient", f"rank {r} was killed by {f['signal']}", r, f)
    if exits:
        return _raised(exits, first, step)
    if errors:
        r, f = min(errors.items())
        return _verdict("transient", f"rank {r}: {_error(f['error'], first[r])}", r, f)
    if failures:
        r, f = min(failures.items())
        how = f"was stopped by {f['signal']}" if f.get("signal") else \
            f"exited with code {f.get('exitcode')} and no error file"
        return _verdict("transient", f"rank {r} {how}", r, f)
    return Verdict("transient", f"the launcher failed: {result.get('launcher_error', 'no result')}")


def classify_one(failure: dict, rank: int, step: int | None, previous: str | None = None) -> Verdict:
    """The verdict on one rank's death during an in-job round (agent.py): ``failure`` is
    its record (results.failure_record), ``step`` the highest step reached, ``previous``
    the signature of the attempt's previous in-job failure. ``deterministic`` when the
    program said so (DeterministicError) or raised the same error at the same step as
    last time; else what :func:`classify` says of a one-rank result."""
    v = classify({"failures": {str(rank): failure}}, step)
    if v.klass != "deterministic" and v.signature is not None and v.signature == previous:
        v.klass, v.reason = "deterministic", f"failed the same way twice: {v.reason}"
    return v


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _raised(errors: dict, first: dict, step: int | None, outage: bool = False) -> Verdict:
    """The verdict on the earliest of ``errors`` (by its error file's time, then rank)."""
    r, f = min(errors.items(), key=lambda kv: (_num(kv[1].get("timestamp")), kv[0]))
    v = _verdict("transient", f"rank {r}: {_error(f['error'], first[r])} ({at_step(step)})", r, f,
                 signature(first[r], step))
    v.outage = outage
    return v


def _error(error: str, first: str) -> str:
    """The exception that decides, and the one raised last when that is another."""
    if first.strip() == error.strip():
        return error[:1000]
    return f"{first[:1000]} (then: {error.splitlines()[0][:300] if error else ''})"


def _num(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _verdict(klass: str, reason: str, rank: int, f: dict, sig: str | None = None) -> Verdict:
    return Verdict(klass, reason, rank, f.get("exitcode"), f.get("signal"), f.get("traceback"), sig,
                   {"error": f.get("error")})
