"""Hugging Face ``transformers.Trainer`` over an aioload loader, on the CPU; run by
tests/test_hf_trainer.py::

    python tests/frameworks/hf_trainer_run.py OUT

Writes ``OUT/result.json``: the indices of every training step, and the number of batches the
aioload loader delivered, of an uninterrupted run of 12 steps (``full``; 10 steps an epoch),
of a run that checkpoints at step 7 and stops there (``first``), and of a new Trainer, model
and loader resumed from that checkpoint (``rest``).

The recipe in docs/integrations.md is :class:`AioloadTrainer` and :class:`LoaderState`.

``python tests/frameworks/hf_trainer_run.py OUT --stream FILE...`` does the same over a Hugging
Face streaming dataset of the Parquet FILEs (mapped, in file order, 2 workers: 10 batches an
epoch; a shuffle buffer's own resume is tests/test_resume_hf.py's), which has no ``len()``: 14
steps (``max_steps``), a checkpoint at step 7.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import aioload


class Indices(aioload.Dataset):
    def __len__(self) -> int:
        return 40

    async def read(self, index: int) -> int:
        return index

    def decode(self, raw: int) -> dict:
        return {"x": torch.tensor([float(raw)]), "index": raw}


class AioloadTrainer(Trainer):
    """A Trainer that trains on the aioload loader it is given."""

    def __init__(self, *args, train_loader: aioload.DataLoader, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_loader = train_loader
        self.add_callback(LoaderState(train_loader))

    def get_train_dataloader(self) -> aioload.DataLoader:
        return self.train_loader


class LoaderState(TrainerCallback):
    """Saves the loader's position into every checkpoint the Trainer writes."""

    def __init__(self, loader: aioload.DataLoader):
        self.loader = loader

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            torch.save(self.loader.state_dict(), os.path.join(folder, "aioload_loader.pt"))


def resume(trainer: AioloadTrainer, checkpoint: str) -> None:
    """Put the loader where the checkpoint's run stopped, then let the Trainer resume."""
    trainer.train_loader.load_state_dict(torch.load(os.path.join(checkpoint, "aioload_loader.pt"), weights_only=True))
    trainer.train(resume_from_checkpoint=checkpoint)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def forward(self, x, index):
        self.seen.append(index.tolist())
        return {"loss": self.layer(x).pow(2).mean()}


def arguments(out: str, **kwargs) -> TrainingArguments:
    # ignore_data_skip: the loader resumes itself; the Trainer's own skipping would rebuild it
    # as a torch DataLoader (accelerate's skip_first_batches).
    return TrainingArguments(output_dir=out, use_cpu=True, report_to=[], disable_tqdm=True,
                             logging_strategy="no", ignore_data_skip=True, seed=0, **kwargs)


def run(out: str, max_steps: int, checkpoint: str | None = None, **kwargs) -> dict:
    """The indices the model saw, and how many of those batches the aioload loader delivered."""
    torch.manual_seed(0)
    model = Model()
    loader = aioload.DataLoader(Indices(), batch_size=4, shuffle=True, num_workers=1)
    return train(model, loader, out, max_steps, checkpoint, **kwargs)


def train(model, loader, out: str, max_steps: int, checkpoint: str | None, **kwargs) -> dict:
    """``model`` trained on ``loader`` (from ``checkpoint`` where given): what it saw, and how
    many batches the loader delivered."""
    trainer = AioloadTrainer(model=model, args=arguments(out, max_steps=max_steps, **kwargs), train_loader=loader)
    with loader:
        if checkpoint is None:
            trainer.train()
        else:
            resume(trainer, checkpoint)
        return {"seen": model.seen, "delivered": loader.stats().batches}


class StreamModel(Model):
    def forward(self, id, text, double, length):  # noqa: A002 - the stream's column names
        self.seen.append(id.tolist())
        return {"loss": self.layer(double.float().view(-1, 1)).pow(2).mean()}


def run_stream(out: str, paths: list[str], max_steps: int, checkpoint: str | None = None, **kwargs) -> dict:
    from tests.hf_data import stream

    torch.manual_seed(0)
    model = StreamModel()
    loader = aioload.DataLoader(stream(paths), batch_size=4, num_workers=2)
    return train(model, loader, out, max_steps, checkpoint, **kwargs)


def main_stream(out: str, paths: list[str]) -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    result = {}
    result["full"] = run_stream(os.path.join(out, "full"), paths, 14, save_strategy="no")
    first = os.path.join(out, "first")
    result["first"] = run_stream(first, paths, 7, save_strategy="steps", save_steps=7)
    result["rest"] = run_stream(os.path.join(out, "rest"), paths, 14, os.path.join(first, "checkpoint-7"),
                                save_strategy="no")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


def main(out: str) -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    result = {}
    result["full"] = run(os.path.join(out, "full"), 12, save_strategy="no")
    first = os.path.join(out, "first")
    result["first"] = run(first, 7, save_strategy="steps", save_steps=7)
    result["rest"] = run(os.path.join(out, "rest"), 12, os.path.join(first, "checkpoint-7"), save_strategy="no")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--stream":
        main_stream(sys.argv[1], sys.argv[3:])
    else:
        main(sys.argv[1])
