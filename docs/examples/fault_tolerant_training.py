"""A fault-tolerant training loop with ckptstore (docs/training.md).

    torchrun --nproc-per-node 2 fault_tolerant_training.py STORE [--steps 60] [--every 5]
    ckptstore run --store STORE --in-job --nproc-per-node 2 fault_tolerant_training.py STORE --every 1
    ... fault_tolerant_training.py STORE --device cuda [--backend nccl]   # one GPU per rank (LOCAL_RANK)

Kill it at any moment (a rank, the launcher, during a save) and start it again with
the same command: it resumes from the newest step that every rank can load, and ends
bit-identical to a run that was never interrupted. SIGTERM (preemption) makes it save
at the next step boundary and exit once that save is committed.
"""

import time

STARTED = time.time()  # for "time to first step", which includes the imports

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ckptstore  # noqa: E402


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's stdout."""
    print(line + "\n", end="", flush=True)


def batch(samples: int, rank: int, rows: int):
    """This rank's part of the global batch that starts at global sample ``samples``:
    the data position is a count of global samples, so it survives a world-size change.
    Drawn on the CPU: the same numbers whatever the device."""
    g = torch.Generator().manual_seed(samples * 1000 + rank)
    x = torch.randn(rows, 16, generator=g)
    return x, x[:, :4].sin() + 0.1 * torch.randn(rows, 4, generator=g)


def _every(value: str):
    return value if value == "auto" else int(value)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("store", help="a path or s3:// URL that outlives the node")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=_every, default=5, help="save every N steps, or 'auto' (from the save cost and MTBF)")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--final", help="write the trained parameters here (rank 0) when done")
    p.add_argument("--hidden", type=int, default=64, help="width of the model's hidden layer")
    p.add_argument("--step-delay", type=float, default=0.0, help="simulated compute per step, seconds")
    p.add_argument("--durable-every", type=_every, default=None,
                   help="with a memory tier: promote every N-th save to the store, or 'auto' (default: the Store's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model trains; cuda: cuda:LOCAL_RANK, one GPU per rank")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="the process group's (nccl needs --device cuda; gloo carries CUDA tensors too)")
    args = p.parse_args()
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    return args


def device_of(args: argparse.Namespace) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK (a spare's warm-up, which has no rank yet: the
    current one); made current, so that NCCL and torch.device("cuda") mean it."""
    if args.device == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def build_model(hidden: int, device: torch.device):
    """The FSDP2 model and its optimizer, over the default group."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, on any device)
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 4)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def build_model_once() -> None:
    """A spare's warm-up under `ckptstore run --in-job` (a one-rank group): FSDP's and the
    optimizer's first-call costs are paid before the spare takes a failed rank's place."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    args = parse_args()
    model, opt = build_model(args.hidden, device_of(args))
    get_state_dict(model, opt)


def main(args: argparse.Namespace) -> None:
    # Everything that holds the process group is built here: under `ckptstore run --in-job`
    # main runs again in this process after a peer's failure, in a re-formed group.
    began, round_ = time.time(), ckptstore.inprocess.round()  # (0 outside in-job mode)
    device = device_of(args)
    if not dist.is_initialized():
        dist.init_process_group(args.backend)
    rank = dist.get_rank()
    model, opt = build_model(args.hidden, device)
    warmup = 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    progress = {"samples": 0}  # global samples consumed: the data position
    torch.manual_seed(1000 + rank)  # dropout draws differ per rank; the RNG state is checkpointed

    ckpt = ckptstore.Checkpointer(
        # memory="auto": under `ckptstore run --in-job` every save commits to the node's memory
        # first (a replaced rank restores from there); elsewhere the store has one tier.
        ckptstore.Store(args.store, memory="auto", durable_every=args.durable_every), model=model, optimizer=opt,
        state={"scheduler": sched, "progress": progress}, every=args.every,
        on_commit=lambda s: say(f"rank {rank}: committed step {s}"))
    start = ckpt.resume()  # collective: every rank starts from the same step
    info = ckpt.info
    if info.step is not None:
        say(f"rank {rank}: resumed at step {info.step} (saved by {info.saved_world_size} ranks, "
            f"{info.age_s:.1f}s old, skipped {[s.step for s in info.skipped]})")
    rows = info.local_batch(args.global_batch)  # keeps the global batch on any world size

    step = start - 1
    for step in range(start, args.steps):
        x, y = (t.to(device) for t in batch(progress["samples"], rank, rows))
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        progress["samples"] += args.global_batch
        time.sleep(args.step_delay)
        if step == start and not round_:
            say(f"rank {rank}: first step {time.time() - STARTED:.2f}s after start")
        elif step == start:  # a later in-job round: the process started long ago
            say(f"rank {rank}: first step {time.time() - began:.2f}s after round {round_} began")
        say(f"rank {rank}: step {step} pid {os.getpid()}")
        if ckpt.step(step, metrics={"loss": round(loss.item(), 6)}):
            say(f"rank {rank}: preempted, saved step {step}")
            break
    ckptstore.wait()
    done = step == args.steps - 1
    if done and args.final:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # torch's own gather waits for every all-gather on every rank. A bare
        # ``v.full_tensor()`` that a rank never reads leaves its all-gather in flight:
        # finishing during interpreter exit, gloo's thread aborts the process.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, args.final)
    ckpt.close()
    dist.destroy_process_group()
    if done:
        say(f"rank {rank}: done")


if __name__ == "__main__":
    # torchrun, `ckptstore run`, python: main(args) once; `ckptstore run --in-job`: again after each recovery
    arguments = parse_args()
    ckptstore.inprocess.run(main, arguments, backend=arguments.backend, warmup=build_model_once)
