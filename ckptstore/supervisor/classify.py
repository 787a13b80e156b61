"""Why an attempt ended, from evidence: transient faults are retried, deterministic
errors stop the run at once instead of burning the restart budget.

Evidence, in order of strength:

1. the program said so: an exception of type ``DeterministicError`` (ckptstore's, or any
   class of that name) in a rank's torchelastic error file: deterministic;
2. a rank's own exception (not one of the machinery's below): its signature (type,
   message with numbers and addresses normalised, and the step reached) is compared
   with the previous failure's: the same twice in a row is deterministic; the first
   time, transient (retried once);
3. a rank killed by a signal (SIGKILL, SIGBUS, the OOM killer, SIGSEGV): transient;
4. errors of the machinery: collective timeouts and lost peers (gloo, NCCL), storage
   errors ckptstore marks retryable, known CUDA hardware errors (ECC, Xid-class), and
   the SIGTERM a launcher sends the surviving ranks: transient, and never taken for
   the cause when a rank has an error of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TRANSIENT_PATTERNS = [
    r"Connection (closed|reset) by peer", r"Broken pipe", r"ProcessGroup\w*.*timed? ?out", r"Timed out",
    r"NCCL (error|Error|WARN)", r"ncclRemoteError", r"ncclSystemError", r"Gloo.*(connect|read|write)",
    r"\[gloo/", r"TransientStorageError", r"SlowDown", r"RequestTimeout", r"ECC error",
    r"uncorrectable ECC", r"Xid", r"CUDA error: (an illegal memory access|unspecified launch failure|"
    r"uncorrectable ECC error|device-side assert)?.*hardware", r"DistNetworkError", r"DistStoreError",
    r"RendezvousClosedError", r"RendezvousTimeoutError",
]
_TRANSIENT = re.compile("|".join(f"(?:{p})" for p in TRANSIENT_PATTERNS))
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
# NCCL's own verdict on a call the program got wrong: the same error on every retry.
_MISUSE = re.compile(r"ncclInvalidUsage|ncclInvalidArgument|NCCL error[^\n]*invalid (usage|argument)")


def _machinery(error: str, traceback: str) -> bool:
    """Whether a rank's error is the machinery's (transient): its message or its
    traceback (chained exceptions included: a cleanup that failed while handling a lost
    peer is that fault's consequence) names a transient fault, and NCCL did not say the
    program called it wrongly."""
    return not _MISUSE.search(error) and bool(_TRANSIENT.search(error) or _TRANSIENT.search(traceback))


@dataclass
class Verdict:
    klass: str  # transient, deterministic, hang, preempted
    reason: str
    rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    traceback: str | None = None
    signature: str | None = None
    evidence: dict = field(default_factory=dict)


def signature(error: str, step: int | None) -> str:
    """What makes two failures "the same": exception type and message with every number
    and address replaced, and the step reached."""
    return f"{_NUMBERS.sub('N', error.strip())[:500]} @ step {step}"


def classify(result: dict, step: int | None, previous_signature: str | None) -> Verdict:
    """The verdict on an attempt whose launcher reported ``result`` (launch.py's JSON)."""
    failures = {int(r): f for r, f in (result.get("failures") or {}).items()}
    if result.get("launcher_signal"):
        return Verdict("preempted", f"the launcher was stopped by {result['launcher_signal']}",
                       signal=result["launcher_signal"])
    errors = {r: f for r, f in failures.items() if f.get("error")}
    for r, f in sorted(errors.items()):
        if re.match(r"^(\w+\.)*DeterministicError\b", f["error"]):
            return _verdict("deterministic", f"rank {r} raised {f['error'][:1000]}", r, f)
    # A rank's own exception is the most specific evidence; the errors of the machinery
    # (a peer's connection closed) and the SIGTERM the launcher sends the surviving
    # ranks are consequences of some other rank's failure.
    own = {r: f for r, f in errors.items() if not _machinery(f["error"], f.get("traceback") or "")}
    if own:
        r, f = min(own.items(), key=lambda kv: (kv[1].get("timestamp") or 0, kv[0]))
        sig = signature(f["error"], step)
        if sig == previous_signature:
            return _verdict("deterministic", f"rank {r} failed the same way twice at step {step}: "
                            f"{f['error'][:1000]}", r, f, sig)
        return _verdict("transient", f"rank {r}: {f['error'][:1000]} (first time: retried)", r, f, sig)
    killed = {r: f for r, f in failures.items() if f.get("signal") and f["signal"] != "SIGTERM"}
    if killed:
        r, f = min(killed.items())
        return _verdict("transient", f"rank {r} was killed by {f['signal']}", r, f)
    if errors:
        r, f = min(errors.items())
        return _verdict("transient", f"rank {r}: {f['error'][:1000]}", r, f)
    if failures:
        r, f = min(failures.items())
        how = f"was stopped by {f['signal']}" if f.get("signal") else \
            f"exited with code {f.get('exitcode')} and no error file"
        return _verdict("transient", f"rank {r} {how}", r, f)
    return Verdict("transient", f"the launcher failed: {result.get('launcher_error', 'no result')}")


def _verdict(klass: str, reason: str, rank: int, f: dict, sig: str | None = None) -> Verdict:
    return Verdict(klass, reason, rank, f.get("exitcode"), f.get("signal"), f.get("traceback"), sig,
                   {"error": f.get("error")})
