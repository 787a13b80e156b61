"""PyTorch Lightning through ckptstore (``ckptstore.lightning.CheckpointIO``): a real
``Trainer.fit`` of a tiny LightningModule saves ckptstore checkpoints, ModelCheckpoint's
top-k removal deletes them safely, and a resume continues bit-identically, locally and
on the moto S3 server."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import ckptstore  # noqa: E402
import ckptstore.lightning  # noqa: E402
from ckptstore.cli import main  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)), batch_size=8)


def trainer(epochs: int, root, **kw) -> "pl.Trainer":
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(max_epochs=epochs, plugins=[ckptstore.lightning.CheckpointIO()], default_root_dir=str(root),
                      logger=False, enable_progress_bar=False, enable_model_summary=False, **kw)


def fresh_model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def test_model_checkpoint_writes_ckptstore_checkpoints_and_top_k_removes_them(tmp_path):
    ck = tmp_path / "ck"
    model = fresh_model()
    callback = pl.callbacks.ModelCheckpoint(dirpath=str(ck), save_top_k=1, every_n_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(3, tmp_path, enable_checkpointing=True, callbacks=[callback]).fit(model, data())
    assert sorted(os.listdir(ck)) == ["epoch=2-step=24.ckpt"]  # the two older ones were removed
    path = ck / "epoch=2-step=24.ckpt"
    assert path.is_dir() and any(p.name.startswith("manifest-") for p in path.iterdir())
    assert CliRunner().invoke(main, ["verify", str(path)]).exit_code == 0
    saved = ckptstore.load(str(path))
    assert saved["global_step"] == 24 and saved["epoch"] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(saved["state_dict"][k], v), k


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_resume_continues_bit_identical_to_an_uninterrupted_fit(tmp_path, where, monkeypatch):
    if where == "s3":
        pytest.importorskip("moto.server")
        import s3util

        endpoint = s3util.moto_endpoint()
        s3util.point_boto3_at(endpoint, monkeypatch)
        path = f"s3://{s3util.new_bucket(endpoint)}/run/half.ckpt"
    else:
        path = str(tmp_path / "half.ckpt")
    straight = fresh_model()
    trainer(4, tmp_path).fit(straight, data())

    first = trainer(2, tmp_path)
    first.fit(fresh_model(), data())
    first.save_checkpoint(path)  # returns once staged; the resume below waits for its commit
    resumed_model = fresh_model(seed=99)  # other initial weights: all must come from the checkpoint
    resumed = trainer(4, tmp_path)
    resumed.fit(resumed_model, data(), ckpt_path=path)
    assert resumed.global_step == 32
    for k, v in straight.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[k], v), k
    ckptstore.wait()


def test_a_damaged_checkpoint_fails_the_resume_naming_the_file(tmp_path):
    path = tmp_path / "half.ckpt"
    first = trainer(1, tmp_path)
    first.fit(fresh_model(), data())
    first.save_checkpoint(str(path))
    ckptstore.wait()
    [data_file] = path.rglob("data-*.bin")
    raw = bytearray(data_file.read_bytes())
    raw[100] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with pytest.raises(ckptstore.IntegrityError, match="data-r00000-s00.bin"):
        trainer(2, tmp_path).fit(fresh_model(), data(), ckpt_path=str(path))


def test_a_bad_stream_is_refused_when_the_plugin_is_made(tmp_path, monkeypatch):
    """``stream=`` (as for ckptstore.save) is checked where it is given, naming the plugin,
    not at the first checkpoint of a long fit; a valid one is what each save waits for."""
    with pytest.raises(TypeError, match=r"ckptstore\.lightning\.CheckpointIO: stream= must be"):
        ckptstore.lightning.CheckpointIO(stream="cuda:0")
    with pytest.raises(TypeError, match="dict keys must be CUDA device indexes"):
        ckptstore.lightning.CheckpointIO(stream={"cuda": None})
    seen = []
    real_save = ckptstore.api.save

    def spy(*args, **kwargs):  # the real save, noting what the plugin passed
        seen.append(kwargs.get("stream", "missing"))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckptstore.api, "save", spy)
    io = ckptstore.lightning.CheckpointIO(stream={})  # no device named: each device's current stream, as the default
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "c")
    assert seen == [{}]
    assert torch.equal(io.load_checkpoint(tmp_path / "c")["w"], torch.ones(3))
