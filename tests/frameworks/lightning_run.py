"""Lightning ``Trainer.fit`` runs over aioload loaders; run by tests/test_lightning.py.

    python tests/frameworks/lightning_run.py OUT --devices 2    # Lightning launches rank 1 itself
    python tests/frameworks/lightning_run.py OUT --devices 1 --elastic-from CKPT   # resume on 1

Each rank writes ``OUT/rank<r>.json``: ``{case: [[index, ...] per training step], ...}`` plus
``"observed"``, what the Trainer did with the loader. The cases, in one process group:

* ``sharding/<built>/<uds>``: one epoch over 40 indices, the loader built in
  ``LightningDataModule.__init__`` (``init``: before the process group exists) or in
  ``train_dataloader()`` (``hook``), with ``use_distributed_sampler`` True or False;
* ``resume/full``: 12 steps (5 batches an epoch and rank) without a stop;
  ``resume/first``: the same run stopped at step 7, mid-epoch, by a checkpoint there;
  ``resume/rest``: a new model, data module and loader, ``fit(ckpt_path=...)`` to step 12.
  Each run starts from ``seed_everything(0, workers=True)``, as a fresh process would, and
  its loader has ``seed=0``;
* ``elastic/rest`` (with ``--elastic-from``): ``resume/rest`` from a checkpoint saved with
  another number of devices.

The recipe in docs/integrations.md is the ``Data`` class below: build the loader wherever you
like; return it from ``train_dataloader()``.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import aioload

SAMPLES = 40
BATCH = 4


class Indices(aioload.Dataset):
    """Sample ``i`` is ``i``; ``read`` runs on the loader's event loop, ``decode`` in a worker."""

    def __len__(self) -> int:
        return SAMPLES

    async def read(self, index: int) -> int:
        return index

    def decode(self, raw: int) -> int:
        return raw


def make_loader(workers: int, seed: int | None) -> aioload.DataLoader:
    return aioload.DataLoader(Indices(), batch_size=BATCH, shuffle=True, num_workers=workers, seed=seed)


class Data(L.LightningDataModule):
    """The loader may be built here, before ``torch.distributed`` is initialised: aioload
    shards by rank when an epoch starts, not when the loader is built."""

    def __init__(self, build_now: bool, workers: int, seed: int | None = None):
        super().__init__()
        self.workers, self.seed = workers, seed
        self.loader = make_loader(workers, seed) if build_now else None

    def train_dataloader(self) -> aioload.DataLoader:
        if self.loader is None:
            self.loader = make_loader(self.workers, self.seed)
        return self.loader


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.tolist())
        return self.layer(batch.float().view(-1, 1)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(args, **kwargs) -> L.Trainer:
    devices = args.devices
    return L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kwargs)


def observe(fitted: L.Trainer, data: Data) -> dict:
    """What the Trainer did with the loader it was given."""
    loader = data.loader
    init = loader.worker_init_fn
    return {
        "same_object": fitted.train_dataloader is loader,
        "type": type(fitted.train_dataloader).__name__,
        "worker_init_fn": getattr(init, "func", init).__name__ if init is not None else None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--elastic-from", help="only resume this checkpoint (saved on other devices) to step 12")
    args = p.parse_args()
    result: dict = {}
    rank = int(os.environ.get("LOCAL_RANK", 0))

    def write() -> None:  # after every case: a failing case leaves the others to read
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)

    if args.elastic_from:
        L.seed_everything(0, workers=True)
        data, model = Data(build_now=True, workers=args.workers, seed=0), Model()
        trainer(args, max_steps=12, enable_checkpointing=False).fit(model, data, ckpt_path=args.elastic_from)
        result["elastic/rest"] = model.seen
        data.loader.close()
        write()
        return

    # Built before any Trainer exists: no process group yet.
    early = {uds: Data(build_now=True, workers=args.workers) for uds in (True, False)}
    for built in ("init", "hook"):
        for uds in (True, False):
            L.seed_everything(0, workers=True)
            data = early[uds] if built == "init" else Data(build_now=False, workers=args.workers)
            model = Model()
            fit = trainer(args, max_epochs=1, use_distributed_sampler=uds, enable_checkpointing=False)
            fit.fit(model, data)
            result[f"sharding/{built}/{uds}"] = model.seen
            if built == "init" and uds:
                result["observed"] = observe(fit, data)
            data.loader.close()
            write()
    ckpt_dir = os.path.join(args.out, "checkpoints")
    runs = {"full": dict(max_steps=12, enable_checkpointing=False),
            "first": dict(max_steps=7, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="step7",
                                                                  every_n_train_steps=7, save_top_k=-1)]),
            "rest": dict(max_steps=12, enable_checkpointing=False)}
    for name, kwargs in runs.items():
        L.seed_everything(0, workers=True)
        # seed=: the epochs after the resumed one are drawn from (seed, epoch), not from torch's
        # global RNG, which Lightning does not checkpoint.
        data, model = Data(build_now=True, workers=args.workers, seed=0), Model()
        fit = trainer(args, **kwargs)
        ckpt = os.path.join(ckpt_dir, "step7.ckpt") if name == "rest" else None
        fit.fit(model, data, ckpt_path=ckpt)
        result[f"resume/{name}"] = model.seen
        data.loader.close()
        write()


if __name__ == "__main__":
    main()
