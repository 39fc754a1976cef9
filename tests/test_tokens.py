"""``aioload.PackedTokens``: documents concatenated and cut into rows of ``seq_len + 1`` tokens.

Documents here are token ids that say where they come from (document ``d``'s token ``p`` is
``d * STRIDE + p``), so a row tells which document and position each of its tokens is; the
reference for the loader's behaviour (worker counts, resume, ranks) is the loader's own
uninterrupted run, compared row for row.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

import aioload

STRIDE = 100_000
SEQ = 16


def documents(n: int = 60, seed: int = 0, longest: int = 70) -> list[list[int]]:
    """``n`` documents of 0 to ``longest`` tokens (some empty, some longer than a row)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, longest, size=n)
    sizes[3] = 0
    sizes[5] = 3 * SEQ + 7
    return [[d * STRIDE + p for p in range(size)] for d, size in enumerate(sizes)]


class SplitDocs(aioload.Dataset):
    """Documents read on an event loop (as a remote source would be) and decoded in a worker."""

    def __init__(self, docs, fail: bool = False):
        self.docs, self.fail = docs, fail

    def __len__(self) -> int:
        return len(self.docs)

    async def read(self, index):
        if self.fail:
            raise OSError(f"document {index} is not there")
        await asyncio.sleep(0)
        return {"input_ids": self.docs[index], "n": len(self.docs[index])}

    def decode(self, raw):
        return {"input_ids": np.asarray(raw["input_ids"], dtype=np.int64), "n": raw["n"]}

    def describe(self, index):
        return f"docs/{index}.json"


def rows_of(loader) -> list[dict]:
    return [{k: v.clone() for k, v in batch.items()} for batch in loader]


def same_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


# ------------------------------------------------------------------------------------ packing
@pytest.mark.parametrize("bos,eos", [(None, None), (None, 7), (5, 7)])
@pytest.mark.parametrize("shuffle_documents", [True, False])
def test_every_token_of_every_document_is_in_exactly_one_row_but_the_tail(bos, eos, shuffle_documents):
    docs = documents()
    ds = aioload.PackedTokens(docs, SEQ, bos=bos, eos=eos, shuffle_documents=shuffle_documents)
    framed = [([bos] if bos is not None else []) + d + ([eos] if eos is not None else []) if d else [] for d in docs]
    total = sum(map(len, framed))
    assert len(ds) == total // (SEQ + 1) and ds.tail == total % (SEQ + 1)
    seen = Counter()
    for r in range(len(ds)):
        spans = ds.spans(r)
        assert sum(stop - start for _, start, stop in spans) == SEQ + 1
        row = [t for doc, start, stop in spans for t in framed[doc][start:stop]]
        sample = ds[r]
        assert sample["input_ids"].tolist() == row[:-1]
        seen.update((doc, p) for doc, start, stop in spans for p in range(start, stop))
    assert max(seen.values()) == 1, "a token in two rows"
    missing = [(d, p) for d, toks in enumerate(framed) for p in range(len(toks)) if (d, p) not in seen]
    assert len(missing) == ds.tail
    # The tail is the end of the stream: the last documents laid down, their last tokens.
    stream = [(int(d), p) for d in ds.packing.order for p in range(len(framed[d]))]
    assert sorted(missing) == sorted(stream[len(stream) - ds.tail:])
    assert 3 not in {d for d, _ in seen}, "an empty document gets no bos/eos"


def test_labels_never_cross_a_document_and_positions_restart_at_each():
    docs = documents(seed=1)
    ds = aioload.PackedTokens(docs, SEQ, eos=None)
    masked = 0
    for r in range(len(ds)):
        s = ds[r]
        ids, labels, pos, doc_ids = (s[k].tolist() for k in ("input_ids", "labels", "position_ids", "document_ids"))
        assert all(len(x) == SEQ for x in (ids, labels, pos, doc_ids))
        spans = ds.spans(r)
        row = [t for doc, start, stop in spans for t in docs[doc][start:stop]]
        for j in range(SEQ):
            same = row[j] // STRIDE == row[j + 1] // STRIDE
            assert labels[j] == (row[j + 1] if same else -100), (r, j)
            masked += not same
            starts = j == 0 or ids[j] // STRIDE != ids[j - 1] // STRIDE
            assert pos[j] == (0 if starts else pos[j - 1] + 1)
            assert doc_ids[j] == (0 if j == 0 else doc_ids[j - 1] + starts)
        assert s["input_ids"].dtype == s["labels"].dtype == s["position_ids"].dtype == torch.int64
    assert masked > 0  # the check above ran over document boundaries


def test_cu_seqlens_of_a_batch_bound_each_document_of_each_row():
    ds = aioload.PackedTokens(documents(seed=2), SEQ)
    batch = torch.stack([ds[r]["document_ids"] for r in range(4)])
    bounds, longest = aioload.PackedTokens.cu_seqlens(batch)
    expected = [0]
    for r in range(4):
        for _, start, stop in ds.spans(r):
            expected.append(min(expected[-1] + stop - start, (r + 1) * SEQ))
        if expected[-1] == expected[-2]:  # the row's last token alone began a document: no input of it
            expected.pop()
    assert bounds.dtype == torch.int32 and bounds.tolist() == expected
    assert longest == max(b - a for a, b in zip(expected, expected[1:]))


# --------------------------------------------------------------------------------------- plan
def test_the_packing_is_a_function_of_the_seed_and_the_order_of_seed_and_epoch():
    docs = documents(seed=3)
    a, b, c = (aioload.PackedTokens(docs, SEQ, seed=s) for s in (4, 4, 5))
    assert [a.spans(r) for r in range(len(a))] == [b.spans(r) for r in range(len(b))]
    assert [a.spans(r) for r in range(len(a))] != [c.spans(r) for r in range(len(c))]
    assert torch.equal(a.epoch_order(9, 2, True), b.epoch_order(9, 2, True))
    assert not torch.equal(a.epoch_order(9, 2, True), a.epoch_order(9, 3, True))
    assert not torch.equal(a.epoch_order(9, 2, True), a.epoch_order(10, 2, True))
    assert sorted(a.epoch_order(9, 2, True).tolist()) == list(range(len(a)))
    assert a.epoch_order(9, 2, False).tolist() == list(range(len(a)))


def test_without_shuffling_documents_rows_follow_the_documents_in_index_order():
    docs = documents(seed=4)
    ds = aioload.PackedTokens(docs, SEQ, shuffle_documents=False)
    order = [doc for r in range(len(ds)) for doc, _, _ in ds.spans(r)]
    assert order == sorted(order)


class Grouped(list):
    """Documents in a list that says its row groups (as ``aioload.Parquet`` does)."""

    def __init__(self, docs, group: int):
        super().__init__(docs)
        self.row_group_rows = [min(group, len(docs) - i) for i in range(0, len(docs), group)]


@pytest.mark.parametrize("window", [1, 3])
def test_a_window_draws_each_epoch_from_k_open_blocks_of_neighbouring_documents(window):
    docs = documents(n=120, seed=17)
    ds = aioload.PackedTokens(Grouped(docs, 10), SEQ, window=window)
    assert ds.deal == "blocks" and sum(ds.block_rows) == len(ds) and len(ds.block_rows) > 2 * window
    first_row = np.cumsum([0] + ds.block_rows)
    block_of = np.repeat(np.arange(len(ds.block_rows)), ds.block_rows)
    for r in range(len(ds)):  # a block's rows begin in one row group of the source
        assert ds.spans(r)[0][0] // 10 == ds.spans(int(first_row[block_of[r]]))[0][0] // 10
    for epoch in range(2):
        order = ds.epoch_order(3, epoch, True).tolist()
        assert sorted(order) == list(range(len(ds)))
        left = list(ds.block_rows)
        begun = set()
        for row in order:
            begun.add(int(block_of[row]))
            left[block_of[row]] -= 1
            assert sum(1 for b in begun if left[b] > 0) <= window
    assert ds.epoch_order(3, 0, True).tolist() != ds.epoch_order(3, 1, True).tolist()
    with pytest.raises(ValueError, match=r"^window= draws rows from blocks of documents that are neighbours"):
        aioload.PackedTokens(docs, SEQ, window=2, shuffle_documents=True)


# ------------------------------------------------------------------------------------ loading
def loader(ds, **kwargs) -> aioload.DataLoader:
    options = dict(batch_size=4, shuffle=True, seed=11, num_workers=0)
    options.update(kwargs)
    return aioload.DataLoader(ds, **options)


@pytest.mark.parametrize("source", ["split", "plain", "window"])
def test_the_batches_are_the_same_at_0_and_2_workers(source):
    docs = documents(seed=5)
    if source == "window":
        ds = aioload.PackedTokens(Grouped(docs, 6), SEQ, window=2)
    else:
        ds = aioload.PackedTokens(SplitDocs(docs) if source == "split" else docs, SEQ,
                                  column="input_ids" if source == "split" else None)
    with loader(ds, num_workers=0) as zero, loader(ds, num_workers=2) as two:
        for epoch in range(2):
            zero.set_epoch(epoch)
            two.set_epoch(epoch)
            a, b = rows_of(zero), rows_of(two)
            assert same_batches(a, b), f"epoch {epoch}"
    assert len(a) == len(ds) // 4 + (len(ds) % 4 > 0)
    # and each is what the dataset says its rows are, in the epoch's computed order
    order = ds.epoch_order(11, 1, True).tolist()
    assert torch.equal(a[0]["input_ids"], torch.stack([ds[i]["input_ids"] for i in order[:4]]))


@pytest.mark.parametrize("pool", ["processes", "threads"])
def test_an_executor_gives_the_batches_of_the_workers(pool, request):
    ds = aioload.PackedTokens(SplitDocs(documents(seed=16)), SEQ, column="input_ids")
    executor = request.getfixturevalue(pool)
    with aioload.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2) as workers, \
            aioload.DataLoader(ds, batch_size=4, shuffle=True, executor=executor) as pooled:
        assert same_batches(rows_of(workers), rows_of(pooled))


def test_a_resumed_epoch_delivers_exactly_the_rest():
    ds = aioload.PackedTokens(SplitDocs(documents(seed=6)), SEQ, column="input_ids")
    with loader(ds, num_workers=2) as full:
        expected = rows_of(full)
    with loader(ds, num_workers=2) as first:
        it = iter(first)
        head = [next(it) for _ in range(3)]
        state = first.state_dict()
        del it
    with loader(ds, num_workers=0) as resumed:
        resumed.load_state_dict(state)
        rest = rows_of(resumed)
    assert same_batches([{k: v.clone() for k, v in b.items()} for b in head] + rest, expected)


@pytest.fixture
def ranks():
    """``rank_of(rank, world)``: this process becomes that rank of torch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def rank_of(rank, world):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield rank_of
    if dist.is_initialized():
        dist.destroy_process_group()


def row_ids(ds) -> dict[tuple, int]:
    return {tuple(ds[r]["input_ids"].tolist()): r for r in range(len(ds))}


def rows_seen(batches, ids) -> list[int]:
    return [ids[tuple(row.tolist())] for b in batches for row in b["input_ids"]]


def test_a_dataset_made_under_torch_distributed_counts_every_document_on_every_rank(ranks):
    docs = documents(n=40, seed=12)
    alone = aioload.PackedTokens(SplitDocs(docs), SEQ, column="input_ids")
    for rank in range(2):  # the index pass reads all the documents, not this rank's share
        ranks(rank, 2)
        made = aioload.PackedTokens(SplitDocs(docs), SEQ, column="input_ids")
        assert len(made) == len(alone) and [made.spans(r) for r in range(len(made))] == \
            [alone.spans(r) for r in range(len(alone))]


@pytest.mark.parametrize("drop_last,window", [(False, None), (True, None), (False, 2)])
def test_ranks_get_equal_rows_and_a_state_resumes_on_another_world_size(ranks, drop_last, window):
    ds = aioload.PackedTokens(Grouped(documents(n=90, seed=7), 8), SEQ, window=window)
    ids = row_ids(ds)
    k = 2
    before, per_rank, state = [], [], None
    for rank in range(2):  # saved on 2 ranks after k batches each (the ranks move in lockstep)
        ranks(rank, 2)
        with loader(ds, drop_last=drop_last) as one:
            batches = rows_of(one)
            per_rank.append(len(batches))
            it = iter(one)
            before += rows_seen([next(it) for _ in range(k)], ids)
            if rank == 0:
                state = one.state_dict()
            del it
    assert per_rank[0] == per_rank[1]
    after, counts = [], []
    for rank in range(3):  # resumed on 3
        ranks(rank, 3)
        with loader(ds, drop_last=drop_last) as resumed:
            resumed.load_state_dict(state)
            batches = rows_of(resumed)
        counts.append(len(batches))
        after += rows_seen(batches, ids)
    assert len(set(counts)) == 1, f"every rank gets the same number of batches, got {counts}"
    seen = Counter(before + after)
    if drop_last:
        assert max(seen.values()) == 1 and len(seen) >= len(ds) - 3 * 4 * 2
    else:
        assert set(seen) == set(range(len(ds))), "every row is seen in the epoch"
        assert sum(seen.values()) - len(ds) < 2 + 3, "only the remainder rule's padding repeats rows"


def test_inside_a_mix_weights_count_rows():
    web = aioload.PackedTokens(documents(n=200, seed=8), SEQ)
    code = aioload.PackedTokens(SplitDocs(documents(n=200, seed=9)), SEQ, column="input_ids")
    mix = aioload.Mix({"web": web, "code": code}, {"web": 3, "code": 1}, epoch_length=80, source_field="source")
    with aioload.DataLoader(mix, batch_size=8, shuffle=True, seed=1, num_workers=2) as two, \
            aioload.DataLoader(mix, batch_size=8, shuffle=True, seed=1, num_workers=0) as zero:
        got = rows_of(two)
        assert same_batches(got, rows_of(zero))
    sources = torch.cat([b["source"] for b in got])
    assert sources.numel() == 80 and abs(int((sources == 0).sum()) - 60) <= 2
    assert got[0]["input_ids"].shape == (8, SEQ)
    web_rows, code_rows = row_ids(web), row_ids(code)
    for b in got:
        for row, s in zip(b["input_ids"], b["source"]):
            assert tuple(row.tolist()) in (web_rows if s == 0 else code_rows)


# ---------------------------------------------------------------------------- text, lengths
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away"]


def texts(n: int = 40) -> list[str]:
    rng = np.random.default_rng(10)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(n)]


def word_level():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_text_is_tokenized_by_a_callable_a_tokenizers_model_and_a_transformers_tokenizer():
    from transformers import PreTrainedTokenizerFast

    docs = texts()
    by_hand = {w: i + 2 for i, w in enumerate(WORDS)}
    tokenizers = {
        "callable": lambda text: [by_hand[w] for w in text.split()],
        "tokenizers": word_level(),
        "transformers": PreTrainedTokenizerFast(tokenizer_object=word_level(), unk_token="[UNK]", eos_token="</s>"),
    }
    stream = [t for d in docs for t in [by_hand[w] for w in d.split()] + [1]]
    for name, tokenizer in tokenizers.items():
        ds = aioload.PackedTokens([{"text": d} for d in docs], 8, tokenizer=tokenizer, eos=1,
                                  shuffle_documents=False)
        assert len(ds) == len(stream) // 9, name
        with aioload.DataLoader(ds, batch_size=len(ds), num_workers=2, shuffle=False) as dl:
            (batch,) = list(dl)
        assert batch["input_ids"].tolist() == [stream[r * 9 : r * 9 + 8] for r in range(len(ds))], name


def test_lengths_given_or_read_from_a_field_pack_as_counted_ones():
    docs = documents(seed=12)
    counted = aioload.PackedTokens(SplitDocs(docs), SEQ, column="input_ids")
    given = aioload.PackedTokens(SplitDocs(docs), SEQ, column="input_ids", lengths=[len(d) for d in docs])
    field = aioload.PackedTokens(SplitDocs(docs), SEQ, column="input_ids", lengths="n")
    for other in (given, field):
        assert [other.spans(r) for r in range(len(other))] == [counted.spans(r) for r in range(len(counted))]


def test_an_index_pass_is_kept_in_the_cache_file_and_not_made_again(tmp_path):
    docs = documents(seed=13)
    cache = tmp_path / "lengths.npz"
    first = aioload.PackedTokens(SplitDocs(docs), SEQ, column="input_ids", cache=cache, index_workers=2)
    assert cache.exists()
    # The same source, unreadable now: the counts come from the cache, no document is read.
    again = aioload.PackedTokens(SplitDocs(docs, fail=True), SEQ, column="input_ids", cache=cache)
    assert [again.spans(r) for r in range(len(again))] == [first.spans(r) for r in range(len(first))]
    # Another column is another key: a pass again, which fails on the unreadable source.
    with pytest.raises(OSError, match="document 0 is not there"):
        aioload.PackedTokens(SplitDocs(docs, fail=True), SEQ, column="n", cache=cache)


# ------------------------------------------------------------------------------------- errors
def test_lengths_that_do_not_match_the_documents_fail_naming_the_document_and_the_row():
    docs = documents(seed=14)
    wrong = [len(d) for d in docs]
    wrong[5] += 1
    ds = aioload.PackedTokens(SplitDocs(docs), SEQ, column="input_ids", lengths=wrong, shuffle_documents=False)
    row = next(r for r in range(len(ds)) if any(doc == 5 for doc, _, _ in ds.spans(r)))
    with aioload.DataLoader(ds, batch_size=1, num_workers=2, shuffle=False) as dl:
        with pytest.raises(ValueError, match=r"document 5 \(docs/5.json\) has 55 tokens now and had 56 when the "
                                             r"packing was computed") as caught:
            list(dl)
    assert f"packed row {row}" in "".join(getattr(caught.value, "__notes__", []))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(seq_len=0), ValueError, r"^seq_len must be an int >= 1, got 0$"),
    (dict(eos=-1), ValueError, r"^eos must be a token id \(an int >= 0\) or None, got -1$"),
    (dict(tokenizer=3), TypeError, r"^tokenizer must be a callable str -> list\[int\]"),
    (dict(lengths=[1, 2]), ValueError, r"^lengths has 2 entries of shape \(2,\) for 3 documents"),
    (dict(column="ids"), TypeError, r"document 0 is list, not a dict: column='ids' names a field of dict"),
    (dict(seq_len=6), ValueError, r"^the 3 documents hold 6 tokens, fewer than one row of seq_len \+ 1 = 7: no row "),
])
def test_bad_arguments_are_refused_where_they_are_given(kwargs, error, message):
    options = dict(seq_len=4)
    options.update(kwargs)
    with pytest.raises(error, match=message):
        aioload.PackedTokens([[1, 2, 3], [4], [5, 6]], **options)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(["a b"])


def test_text_without_a_tokenizer_and_a_missing_column_say_what_to_pass():
    with pytest.raises(TypeError, match=r"document 0 is text: pass tokenizer= to tokenize it"):
        aioload.PackedTokens(["a b", "c"], 4)
    with pytest.raises(ValueError, match=r"document 0 has no field 'text' \(it has 'body'\): pass column="):
        aioload.PackedTokens([{"body": "a b"}], 4, tokenizer=str.split)
    with pytest.raises(TypeError, match=r"source is an IterableDataset"):
        aioload.PackedTokens(Stream(), 4)


class Flaky(SplitDocs):
    """Documents ``bad`` cannot be read (the second read of a row fails after the first)."""

    def __init__(self, docs, bad):
        super().__init__(docs)
        self.bad = {bad} if isinstance(bad, int) else set(bad)

    async def read(self, index):
        if index in self.bad:
            for _ in range(index % 3):
                await asyncio.sleep(0)
            raise OSError(f"document {index} is damaged")
        return await super().read(index)


def test_on_error_skip_skips_the_rows_of_a_document_that_fails_and_keeps_the_rest():
    docs = documents(seed=15)
    ds = aioload.PackedTokens(Flaky(docs, bad=5), SEQ, column="input_ids", lengths=[len(d) for d in docs])
    broken = {r for r in range(len(ds)) if any(doc == 5 for doc, _, _ in ds.spans(r))}
    assert len(broken) >= 3  # document 5 is longer than three rows
    with aioload.DataLoader(ds, batch_size=4, num_workers=2, shuffle=True, seed=0, on_error="skip") as dl:
        got = rows_of(dl)
        skipped = dl.stats().skipped
    clean = aioload.PackedTokens(docs, SEQ, lengths=[len(d) for d in docs])
    ids = row_ids(clean)
    assert sorted(rows_seen(got, ids)) == sorted(set(range(len(ds))) - broken)
    assert len(skipped) == len(broken)


def test_a_long_document_is_tokenized_once_while_its_rows_come_in_turn():
    calls = Counter()

    def tokenizer(text):
        calls[text] += 1
        return [len(w) for w in text.split()]

    docs = [" ".join(["word"] * n) for n in (5, 40 * SEQ, 7)]
    ds = aioload.PackedTokens(docs, SEQ, tokenizer=tokenizer, lengths=[5, 40 * SEQ, 7], shuffle_documents=False)
    with aioload.DataLoader(ds, batch_size=8, num_workers=0, shuffle=False) as dl:
        assert sum(b["input_ids"].shape[0] for b in dl) == len(ds) == (5 + 40 * SEQ + 7) // (SEQ + 1)
    assert sorted(calls.values()) == [1, 1, 1]


class Hanging(SplitDocs):
    """Even documents fail at once; the reads of odd ones never end unless cancelled."""

    def __init__(self, docs):
        super().__init__(docs)
        self.events: list[int] = []  # +d: document d's read began; -d: it ended

    async def read(self, index):
        if index % 2 == 0:
            raise OSError(f"document {index} is damaged")
        self.events.append(index)
        try:
            await asyncio.Event().wait()
        finally:
            self.events.append(-index)


def test_when_one_read_of_a_row_fails_the_rows_other_reads_end_with_it():
    docs = [[d * STRIDE + p for p in range(5)] for d in range(40)]
    source = Hanging(docs)
    ds = aioload.PackedTokens(source, SEQ, column="input_ids", lengths=[5] * 40, shuffle_documents=False)
    assert all(len(ds.spans(r)) >= 3 for r in range(len(ds)))
    with aioload.DataLoader(ds, batch_size=1, num_workers=0, io_concurrency=1, shuffle=False,
                            on_error="skip") as dl:
        assert list(dl) == []
        assert len(dl.stats().skipped) == len(ds)
    # One row is read at a time: a row's reads that hang end when it fails, so no more are open
    # at once than one row has (left running, they would pile up until the epoch's loop closed).
    per_row = max(sum(doc % 2 for doc, _, _ in ds.spans(r)) for r in range(len(ds)))
    open_reads, most = 0, 0
    for event in source.events:
        open_reads += 1 if event > 0 else -1
        most = max(most, open_reads)
    assert open_reads == 0 and most <= per_row, source.events


def test_the_index_pass_counts_without_a_data_loader(tmp_path):
    """The tokens package stands below the loader: a pass in worker processes imports no loader."""
    script = ("import sys, aioload._tokens.dataset as d\n"
              "docs = [{'input_ids': list(range(n % 7 + 1))} for n in range(600)]\n"
              "ds = d.PackedTokens(docs, 8, column='input_ids', index_workers=2)\n"
              "assert len(ds) > 0\n"
              "print(sorted(m for m in sys.modules if m in ('aioload._front.loader', 'aioload._front.iterator')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
