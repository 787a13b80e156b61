"""Rank functions for tests/test_resume.py, run by ``sharded_procs.run_job`` on real
gloo process groups. Each returns a dict that the parent asserts on."""

from __future__ import annotations

import warnings

import torch

import ckptstore


def shared_tensor(step: int) -> torch.Tensor:
    return torch.arange(16, dtype=torch.float32) + step


def rank_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"rank": rank, "step": step, "mine": torch.randn(256, generator=g), "shared": shared_tensor(step)}


def save_steps(rank, world, events, root, steps):
    store = ckptstore.Store(root, compression="none")
    for step in steps:
        store.save(step, rank_state(rank, step)).result()
    return {}


def resume_and_report(rank, world, events, root):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptstore.CheckpointSkippedWarning)
        state, info = ckptstore.Store(root).resume()
    want = rank_state(rank, info.step)
    return {"step": info.step, "state_step": state["step"], "state_rank": state["rank"],
            "same": bool(torch.equal(state["mine"], want["mine"])),
            "skipped": [s.step for s in info.skipped], "reasons": [s.reason for s in info.skipped]}


def resume_with_failing_validate(rank, world, events, root):
    def validate(state, manifest):
        if rank == 1:
            raise RuntimeError("validate blew up")

    return _raised(lambda: ckptstore.Store(root).resume(validate=validate))


def _raised(call) -> dict:
    """What ``call()`` raised: its type name and message (None and "" when nothing)."""
    try:
        call()
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None, "message": ""}


def resume_and_draw(rank, world, events, root):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, info = ckptstore.Store(root).resume()
    ckptstore.set_rng_state(state["rng"])
    return {"rank_state_of": info.rank_state_of, "rng_rederived": info.rng_rederived,
            "warned": any(issubclass(w.category, ckptstore.WorldSizeChangedWarning) for w in caught),
            "draw": torch.rand(4)}


def resume_claiming(rank, world, events, root):
    return _raised(lambda: ckptstore.Store(root).resume(claim=True))


def resume_with_warnings_as_errors(rank, world, events, root):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptstore.CheckpointSkippedWarning)
        try:
            _, info = ckptstore.Store(root).resume()
        except Exception as e:
            return {"raised": type(e).__name__, "step": None}
    return {"raised": None, "step": info.step}
