"""Packed token rows: aioload against a plain torch DataLoader, and what a training step consumes.

    python benchmarks/tokens.py                       # about a minute and a half on 2 vCPUs
    python benchmarks/tokens.py --source parquet      # the documents in a Parquet file (aioload.Parquet)
    python benchmarks/tokens.py --documents 500 --rows 256 --rounds 1 --steps 2 --json out.json

The documents are generated text (words drawn from a Zipf law over a made-up vocabulary, 50 to
2,000 words each), tokenized by a byte-level BPE trained on them here (``--vocab`` tokens; no
download). ``aioload.PackedTokens`` packs them into rows of ``--seq-len`` (+1) tokens with an
``eos`` after every document; its lengths come from one index pass, made once before the rounds.
The documents are a list in memory (``--source list``) or rows of a Parquet file written with
pyarrow and read through ``aioload.Parquet(columns=["text"])`` (``--source parquet``).

Rows of the table, each over the same ``PackedTokens`` with ``--workers`` worker processes and
batches of ``--batch-size`` rows:

* ``torch DataLoader``: torch's loader over the dataset (its ``__getitem__``), ``shuffle=True``;
* ``aioload``: ``aioload.DataLoader`` over it, ``shuffle=True, seed=0``.

Each measurement is a fresh loader's first ``--rows`` rows; rows/s and the training process's
CPU per row (``time.process_time``: every thread of the process) count the batches after the
first. Rounds are interleaved, the order alternating; medians are printed.

The consumer: a small GPT-like transformer (``--layers`` layers, ``--d-model`` wide, 4 heads,
causal, the BPE's vocabulary) trained with AdamW on this machine's CPU, on one batch of rows
(forward, backward, step): rows per second over ``--steps`` steps after two warm-up steps. The
summary prints the loader's rate over it (the goal: 20x or more; a loader at 20x keeps such a
trainer fed with 5 % of the machine) and aioload's CPU per row over torch's (the goal: 1 or
less). Numbers from a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

import aioload
from aioload._tools.bench import close_loader, median, script_main, script_parser

TORCH, AIOLOAD = "torch DataLoader", "aioload"


# -- data ----------------------------------------------------------------------------------
def make_texts(count: int, seed: int = 0) -> list[str]:
    """``count`` documents of made-up words, Zipf-distributed."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(5000)]
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    weights /= weights.sum()
    texts = []
    for _ in range(count):
        words = rng.choice(len(vocabulary), size=int(rng.integers(50, 2000)), p=weights)
        texts.append(" ".join(vocabulary[w] for w in words))
    return texts


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"], show_progress=False)
    tokenizer.train_from_iterator(texts[:500], trainer=trainer)
    return tokenizer


def source_of(texts: list[str], kind: str, folder: str):
    if kind == "list":
        return texts
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(folder, "documents.parquet")
    pq.write_table(pa.table({"text": texts}), path, row_group_size=256)
    return aioload.Parquet([path], columns=["text"], footer_cache=False)  # a temporary file: nothing to keep


# -- loaders -------------------------------------------------------------------------------
class Run:
    def __init__(self, rows: int, seconds: float, cpu_s: float):
        self.rows, self.seconds, self.cpu_s = rows, seconds, cpu_s

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms_per_row(self) -> float:
        return 1000 * self.cpu_s / self.rows if self.rows else 0.0


def measure(make_loader, limit: int) -> Run:
    """A fresh loader's first ``limit`` rows (the first batch not counted)."""
    gc.collect()
    loader = make_loader()
    rows, start, cpu0 = 0, None, 0.0
    try:
        for batch in loader:
            if start is None:
                start, cpu0 = time.perf_counter(), time.process_time()
            else:
                rows += batch["input_ids"].shape[0]
            del batch
            if rows >= limit:
                break
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    finally:
        close_loader(loader)
        del loader
        gc.collect()
    return Run(rows, seconds, cpu)


def loaders(packed, args) -> dict:
    common = dict(batch_size=args.batch_size, num_workers=args.workers)
    return {
        TORCH: lambda: torch.utils.data.DataLoader(packed, shuffle=True, **common),
        AIOLOAD: lambda: aioload.DataLoader(packed, shuffle=True, seed=0, **common),
    }


# -- the consumer --------------------------------------------------------------------------
class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.position = torch.nn.Embedding(seq_len, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, input_ids, position_ids):
        x = self.embed(input_ids) + self.position(position_ids)
        return self.head(self.blocks(x, mask=self.mask, is_causal=True))


def training_rate(batch: dict, vocab: int, args) -> float:
    """Rows per second a training step of the small model consumes here."""
    torch.manual_seed(0)
    model = TinyGPT(vocab, args.seq_len, args.d_model, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        logits = model(batch["input_ids"], batch["position_ids"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), batch["labels"].reshape(-1),
                                                 ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(2):  # warm-up: the first steps allocate (AdamW's state, the allocator's caches)
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return args.steps * batch["input_ids"].shape[0] / (time.perf_counter() - start)


# -- the run -------------------------------------------------------------------------------
def run(args) -> dict:
    texts = make_texts(args.documents)
    tokenizer = train_tokenizer(texts, args.vocab)
    eos = tokenizer.token_to_id("<eos>")
    with tempfile.TemporaryDirectory(prefix="aioload-tokens-") as folder:
        source = source_of(texts, args.source, folder)
        began = time.perf_counter()
        packed = aioload.PackedTokens(source, args.seq_len, tokenizer=tokenizer, eos=eos, index_workers=args.workers)
        index_s = time.perf_counter() - began
        makers = loaders(packed, args)
        rates: dict[str, list[float]] = {name: [] for name in makers}
        cpu: dict[str, list[float]] = {name: [] for name in makers}
        counted: dict[str, list[int]] = {name: [] for name in makers}
        for round_ in range(args.rounds):
            for name in (list(makers) if round_ % 2 == 0 else list(reversed(makers))):
                print(f"  round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                measured = measure(makers[name], args.rows)
                rates[name].append(measured.rate)
                cpu[name].append(measured.cpu_ms_per_row)
                counted[name].append(measured.rows)
        batch = torch.utils.data.default_collate([packed[i] for i in range(args.batch_size)])
    print("  the training step", file=sys.stderr, flush=True)
    train = training_rate(batch, tokenizer.get_vocab_size(), args)
    rows = {name: {"rows_s": median(rates[name]), "cpu_ms_per_row": median(cpu[name]), "rows": median(counted[name]),
                   "rows_s_rounds": rates[name]} for name in makers}
    return {
        "rows": rows,
        "training_rows_s": train,
        "packed": {"rows": len(packed), "documents": len(texts), "tail": packed.tail, "index_pass_s": index_s},
        "settings": {key: getattr(args, key.replace("-", "_")) for key in
                     ("source", "documents", "seq-len", "vocab", "workers", "batch-size", "rows", "rounds",
                      "layers", "d-model", "steps")} | {"environment": environment()},
        "command": "python benchmarks/tokens.py " + " ".join(sys.argv[1:]),
    }


def environment() -> str:
    import tokenizers

    return (f"python {sys.version.split()[0]}, torch {torch.__version__}, tokenizers {tokenizers.__version__}, "
            f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, {sys.platform}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}")


def report(result: dict) -> None:
    rows, s, p = result["rows"], result["settings"], result["packed"]
    print(f"\npacked tokens: {p['documents']} documents ({s['source']}) -> {p['rows']} rows of {s['seq-len']} "
          f"tokens (index pass {p['index_pass_s']:.1f} s), batch {s['batch-size']}, {s['workers']} workers, "
          f"{s['rows']} rows x {s['rounds']} round(s); {s['environment']}")
    print(f"  {'loader':<20}{'rows/s':>10}{'/ torch':>9}{'main CPU ms/row':>17}{'/ training':>12}")
    train = result["training_rows_s"]
    base = rows[TORCH]["rows_s"] or float("nan")
    for name, row in rows.items():
        print(f"  {name:<20}{row['rows_s']:>10.1f}{row['rows_s'] / base:>8.2f}x{row['cpu_ms_per_row']:>17.3f}"
              f"{row['rows_s'] / train:>11.1f}x")
    ours = rows[AIOLOAD]
    result["summary"] = {
        "aioload_over_training": ours["rows_s"] / train,
        "cpu_over_torch": ours["cpu_ms_per_row"] / rows[TORCH]["cpu_ms_per_row"]
        if rows[TORCH]["cpu_ms_per_row"] > 0 else math.nan,
    }
    print(f"  training step ({s['layers']} layers, d={s['d-model']}, seq {s['seq-len']}, AdamW, CPU): "
          f"{train:.1f} rows/s")
    print(f"  aioload / training step: {result['summary']['aioload_over_training']:.1f}x (goal >= 20x); "
          f"main CPU per row / torch's: {result['summary']['cpu_over_torch']:.2f} (goal <= 1)")
    print(f"  {result['command']}")


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--source", choices=("list", "parquet"), default="list", help="where the documents are")
    parser.add_argument("--documents", type=int, default=3000, help="generated documents")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000, help="the BPE's vocabulary")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of every loader")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1024, help="rows measured per loader and round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians are printed")
    parser.add_argument("--layers", type=int, default=2, help="the training step's transformer layers")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="training steps timed")
    return script_main(parser, argv, run, report)


if __name__ == "__main__":
    sys.exit(main())
