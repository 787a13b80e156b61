"""Hugging Face Trainer checkpoints in a ckptstore store (``ckptstore.hf``): a real
``transformers.Trainer`` on a tiny GPT-2 built from a config (no downloads) saves into
the store through the callback; after its output directory is lost, a restored step
resumes training to the same weights as an uninterrupted run."""

from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckptstore  # noqa: E402
import ckptstore.hf  # noqa: E402
from ckptstore.cli import main  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 16):
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def model(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def train(output_dir, seed: int = 0, callbacks=(), resume=None):
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=8, save_steps=4,
                                          per_device_train_batch_size=4, learning_rate=1e-3, seed=0,
                                          report_to=[], use_cpu=True, logging_strategy="no",
                                          dataloader_num_workers=0, disable_tqdm=True)
    m = model(seed)
    trainer = transformers.Trainer(model=m, args=args, train_dataset=Tokens(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return m


def test_a_lost_output_dir_resumes_from_the_store_to_the_same_weights(tmp_path):
    straight = train(tmp_path / "straight")
    url = tmp_path / "store"
    train(tmp_path / "run", callbacks=[ckptstore.hf.CheckpointCallback(str(url))])
    assert ckptstore.Store(str(url)).steps() == [4, 8]
    assert CliRunner().invoke(main, ["verify", str(url)]).exit_code == 0
    saved = ckptstore.Store(str(url)).load(4)
    assert saved["weights"]["model.safetensors"]["transformer.wte.weight"].shape == (64, 32)  # tensors, not bytes
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(saved["files"])

    shutil.rmtree(tmp_path / "run")  # the node and its disk are gone
    path = ckptstore.hf.restore(str(url), tmp_path / "new-node", step=4)
    assert path.endswith("checkpoint-4")
    resumed = train(tmp_path / "new-node", seed=99, resume=path)  # other initial weights: the checkpoint decides
    for (name, want), (_, got) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(got, want), name


def test_restore_refuses_what_it_cannot_restore(tmp_path):
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        ckptstore.hf.restore(str(tmp_path / "empty"), tmp_path / "out")
    store = ckptstore.Store(str(tmp_path / "store"))
    store.save(1, {"layout": ckptstore.hf.LAYOUT, "weights": {}, "metadata": "{}",
                   "files": {"../../escape.txt": torch.zeros(3, dtype=torch.uint8)}}).result()
    with pytest.raises(ValueError, match="leads outside"):
        ckptstore.hf.restore(str(tmp_path / "store"), tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "out" / "checkpoint-1").exists()
    store.save(2, {"w": torch.ones(2)}).result()
    with pytest.raises(ValueError, match="not a Hugging Face Trainer checkpoint"):
        ckptstore.hf.restore(str(tmp_path / "store"), tmp_path / "out2")


def _trainer_dir(out, step: int, extra: dict[str, bytes]):
    from safetensors.torch import save_file

    directory = out / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    save_file({"w": torch.arange(16.0).reshape(4, 4)}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name, data in extra.items():
        (directory / name).write_bytes(data)
    return directory


def test_an_empty_file_is_saved_and_a_failed_restore_leaves_nothing_in_the_way(tmp_path):
    """An empty file in checkpoint-N made the callback raise (torch.frombuffer refuses
    an empty buffer), which stops the Trainer; a restore killed or failed midway left
    its staging directory, and every later restore of the step failed on it."""
    from types import SimpleNamespace

    out, url = tmp_path / "out", str(tmp_path / "store")
    _trainer_dir(out, 4, {"trainer_state.json": b"{}", "empty.txt": b""})
    callback = ckptstore.hf.CheckpointCallback(url)
    callback.on_save(SimpleNamespace(output_dir=str(out)), SimpleNamespace(global_step=4, is_world_process_zero=True),
                     None)
    ckptstore.wait()
    back = tmp_path / "back"
    (back / ".checkpoint-4.restoring").mkdir(parents=True)  # what the killed restore left
    restored = ckptstore.hf.restore(url, back)
    assert (tmp_path / "back" / "checkpoint-4" / "empty.txt").read_bytes() == b""
    assert sorted(p.name for p in (tmp_path / "back" / "checkpoint-4").iterdir()) == \
        ["empty.txt", "model.safetensors", "trainer_state.json"]
    assert restored.endswith("checkpoint-4")


def _ddp_rank(rank: int, root: str, port: int) -> None:
    import datetime
    import os
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    out = Path(root) / "out"
    if rank == 0:
        _trainer_dir(out, 4, {"trainer_state.json": b"{}"})
    callback = ckptstore.hf.CheckpointCallback(str(Path(root) / "store"))
    callback.on_save(SimpleNamespace(output_dir=str(out)),
                     SimpleNamespace(global_step=4, is_world_process_zero=rank == 0), None)
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)  # the next training collective: it must meet the other rank's, not a save's
    ckptstore.wait()
    assert t.item() == 3.0
    dist.barrier()
    dist.destroy_process_group()


def test_under_ddp_only_the_main_process_saves_and_no_rank_waits_for_it(tmp_path):
    """Only world process zero saves the Trainer's directory, and a Store's save is
    collective over its group: with the default group, rank 0's save waited for a
    broadcast the others never made (gloo timed out; NCCL would hang)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_rank, args=(str(tmp_path), port), nprocs=2, join=True)
    assert ckptstore.Store(str(tmp_path / "store")).steps() == [4]
