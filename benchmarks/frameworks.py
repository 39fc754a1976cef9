"""What Lightning and Accelerate do with aioload's loader, and with a subclass of torch's.

One process on the CPU. For each loader (``aioload.DataLoader``, and a plain subclass of
``torch.utils.data.DataLoader`` for comparison), the program prints what the framework
trained on: the loader object it iterated (the one given, or one it built), its sampler, the
samples seen, how many times ``iter()`` was called on the loader given, whether
``worker_init_fn`` was set, and how many worker processes loaded samples over two epochs.

* Lightning: ``Trainer(strategy="ddp", devices=1, use_distributed_sampler=True)`` (a gloo
  process group of one), ``seed_everything(workers=True)``, two epochs.
* Accelerate: ``Accelerator(cpu=True).prepare(loader)``, one epoch.

Run (about a minute; the results are in ``docs/migration.md``)::

    .venv/bin/python benchmarks/frameworks.py lightning
    .venv/bin/python benchmarks/frameworks.py accelerate
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

import aioload


class Numbers(torch.utils.data.Dataset):
    """Sample i is ``(i, pid of the process that loaded it)``."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        return torch.tensor(float(index)), os.getpid()


class Counted(aioload.DataLoader):
    iters = 0

    def __iter__(self):
        type(self).iters += 1
        return super().__iter__()


class TorchSubclass(torch.utils.data.DataLoader):
    pass


def lightning(make, label: str) -> None:
    import lightning as L

    seen: dict = {"samples": 0, "pids": set()}

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            values, pids = batch
            used = self.trainer.train_dataloader
            seen.update(loader=type(used).__name__, given=used is loader,
                        sampler=type(getattr(used, "sampler", None)).__name__)
            seen["samples"] += len(values)
            seen["pids"].update(pids.tolist())
            return self.layer(values.unsqueeze(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    L.seed_everything(1, workers=True, verbose=False)
    loader = make()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", use_distributed_sampler=True, max_epochs=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(Model(), train_dataloaders=loader)
    print(f"lightning, {label}: trained on {seen['loader']} (the loader given: {seen['given']}), "
          f"sampler {seen['sampler']}, {seen['samples']} samples, iter() on the given loader: "
          f"{getattr(type(loader), 'iters', 'n/a')}, its worker_init_fn set: {loader.worker_init_fn is not None}, "
          f"worker processes over 2 epochs: {len(seen['pids'])}")
    getattr(loader, "close", lambda: None)()
    torch.distributed.destroy_process_group()


def accelerate(make, label: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = make()
    prepared = accelerator.prepare(loader)
    samples = sum(len(values) for values, _ in prepared)
    print(f"accelerate, {label}: prepare() returned {type(prepared).__module__}.{type(prepared).__name__} "
          f"(the loader given: {prepared is loader}), {samples} samples")
    getattr(loader, "close", lambda: None)()


def main() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    run = {"lightning": lightning, "accelerate": accelerate}[sys.argv[1]]
    run(lambda: Counted(Numbers(), batch_size=4, num_workers=2, shuffle=True), "aioload.DataLoader")
    run(lambda: TorchSubclass(Numbers(), batch_size=4, num_workers=2, shuffle=True), "a torch DataLoader subclass")


if __name__ == "__main__":
    main()
