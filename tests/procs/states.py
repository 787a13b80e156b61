"""States shared by the child scripts and the tests that check what they saved."""

from __future__ import annotations

import torch


def uniform_state(value: int, nbytes: int = 2 << 20) -> dict:
    """Several tensors of several dtypes, every element == ``value``, about ``nbytes``
    in all, plus the non-tensor ``step``."""
    q = max(1, nbytes // 16)
    return {
        "model": {
            "w": torch.full((q // 4, 8), float(value), dtype=torch.float32),
            "b": torch.full((q // 8,), value, dtype=torch.int64),
            "h": torch.full((4, q // 4), value, dtype=torch.float16),
        },
        "optim": {"state": {0: {"exp_avg": torch.full((q,), float(value), dtype=torch.float64)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "extra": [torch.full((3, 5), value, dtype=torch.int32), torch.full((7,), float(value), dtype=torch.bfloat16)],
        "step": value,
    }


def tensors_of(obj, path: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in tensors_of(v, f"{path}.{k}")]
    if isinstance(obj, (list, tuple)):
        return [t for i, v in enumerate(obj) for t in tensors_of(v, f"{path}[{i}]")]
    return []


def values_in(obj) -> dict[str, set]:
    """{where: {min, max}} for every tensor, and {step} for the non-tensor ``step``."""
    out = {path: {t.min().item(), t.max().item()} for path, t in tensors_of(obj)}
    out["step"] = {obj["step"]}
    return out


def single_value(obj) -> float:
    """The one value every tensor and ``step`` of ``obj`` holds; AssertionError on a mix."""
    vals = values_in(obj)
    everything = set().union(*vals.values())
    assert len(everything) == 1, f"a mix of saves in one checkpoint: {vals}"
    expected = uniform_state(0, 16)
    assert [p for p, _ in tensors_of(obj)] == [p for p, _ in tensors_of(expected)], "tensor tree differs"
    return everything.pop()


def big_state() -> dict:
    """A few MB of random (hardly compressible) data, the same in every process."""
    g = torch.Generator().manual_seed(4242)
    return {"w": torch.randn(1_500_000, generator=g), "b": torch.randint(0, 1 << 30, (500_000,), generator=g),
            "step": 9}


def rank_state(rank: int, step: int, numel: int = 50_000) -> dict:
    """Rank-local, step-dependent, bit-pattern-rich state (random, seeded)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "rank": rank,
        "w": torch.randn(numel, generator=g),
        "ids": torch.randint(-2**40, 2**40, (numel // 7,), generator=g, dtype=torch.int64),
        "half": torch.randn(3, 333, generator=g).to(torch.bfloat16),
    }


def equal_bitwise(a, b) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    if [p for p, _ in ta] != [p for p, _ in tb]:
        return False
    for (_, x), (_, y) in zip(ta, tb):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            return False
    strip = lambda o: {k: v for k, v in o.items() if not isinstance(v, torch.Tensor)}  # noqa: E731
    return strip(a) == strip(b)
