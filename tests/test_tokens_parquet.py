"""``aioload.PackedTokens`` over ``aioload.Parquet``: real Parquet files written by pyarrow, read
from disk and from a real HTTP server on 127.0.0.1.

The documents are token ids that say where they come from (``tests/test_tokens.py``'s
``documents``), in a column of lists beside their text and their token count, written in
several row groups; the reference is the same documents packed from a list in memory.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import aioload
from tests.httpserver import Server
from tests.test_tokens import SEQ, documents, row_ids, rows_of, rows_seen, same_batches, word_level, WORDS


pytestmark = pytest.mark.usefixtures("private_cache")  # footers kept in the test's own folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two Parquet files of documents (``input_ids``, ``text``, ``n``), row groups of 7 rows."""
    folder = tmp_path_factory.mktemp("tokens-parquet")
    docs = documents(n=80, seed=20)
    rng = np.random.default_rng(21)
    texts = [" ".join(rng.choice(WORDS, size=len(d) % 23 + 1)) for d in docs]
    paths = []
    for part, (a, b) in enumerate([(0, 50), (50, 80)]):
        table = pa.table({
            "input_ids": pa.array(docs[a:b], type=pa.list_(pa.int64())),
            "text": texts[a:b],
            "n": [len(d) for d in docs[a:b]],
        })
        path = folder / f"part-{part}.parquet"
        pq.write_table(table, path, row_group_size=7)
        paths.append(str(path))
    return folder, paths, docs, texts


def test_token_ids_in_a_parquet_column_pack_as_the_same_documents_in_memory(corpus):
    _, paths, docs, _ = corpus
    parquet = aioload.PackedTokens(aioload.Parquet(paths, columns=["input_ids"]), SEQ, column="input_ids")
    memory = aioload.PackedTokens(docs, SEQ)
    assert len(parquet) == len(memory) and parquet.tail == memory.tail
    for r in range(len(memory)):
        assert parquet.spans(r) == memory.spans(r)
        assert all(torch.equal(parquet[r][k], memory[r][k]) for k in memory[r])


def test_a_lengths_column_is_read_alone_without_a_pass_over_the_documents(corpus):
    _, paths, docs, _ = corpus
    # "n" is not among the columns each row reads: the lengths come from that column, read whole
    counted = aioload.PackedTokens(aioload.Parquet(paths, columns=["input_ids"]), SEQ, column="input_ids",
                                   lengths="n")
    memory = aioload.PackedTokens(docs, SEQ)
    assert [counted.spans(r) for r in range(len(counted))] == [memory.spans(r) for r in range(len(memory))]
    with pytest.raises(aioload.ParquetError, match="has no column 'tokens'"):
        aioload.PackedTokens(aioload.Parquet(paths, columns=["input_ids"]), SEQ, column="input_ids",
                             lengths="tokens")


def test_text_written_by_datasets_through_a_tokenizer_packs_as_the_same_text_in_memory(corpus, tmp_path):
    import datasets

    _, _, _, texts = corpus
    path = tmp_path / "texts.parquet"
    datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))}).to_parquet(str(path))
    tokenizer = word_level()
    text = aioload.PackedTokens(aioload.Parquet([str(path)], columns=["text"]), SEQ, tokenizer=tokenizer, eos=1)
    memory = aioload.PackedTokens(texts, SEQ, tokenizer=tokenizer, eos=1)
    with aioload.DataLoader(text, batch_size=8, shuffle=True, seed=2, num_workers=2) as a, \
            aioload.DataLoader(memory, batch_size=8, shuffle=True, seed=2, num_workers=0) as b:
        assert same_batches(rows_of(a), rows_of(b))


def test_over_parquet_the_batches_are_the_same_at_0_and_2_workers_and_resume_exactly(corpus):
    _, paths, _, _ = corpus
    ds = aioload.PackedTokens(aioload.Parquet(paths, columns=["input_ids"]), SEQ, column="input_ids")
    options = dict(batch_size=4, shuffle=True, seed=5)
    with aioload.DataLoader(ds, num_workers=0, **options) as zero, \
            aioload.DataLoader(ds, num_workers=2, **options) as two:
        expected = rows_of(zero)
        assert same_batches(rows_of(two), expected)
    with aioload.DataLoader(ds, num_workers=2, **options) as first:
        it = iter(first)
        head = [{k: v.clone() for k, v in next(it).items()} for _ in range(3)]
        state = first.state_dict()
        del it
    with aioload.DataLoader(ds, num_workers=2, **options) as resumed:
        resumed.load_state_dict(state)
        assert same_batches(head + rows_of(resumed), expected)


def test_parquet_behind_http_packs_the_rows_of_the_local_files(corpus):
    folder, paths, docs, _ = corpus
    memory = aioload.PackedTokens(docs, SEQ)
    ids = row_ids(memory)
    with Server(folder) as server:
        urls = [server.url(f"part-{i}.parquet") for i in range(2)]
        ds = aioload.PackedTokens(aioload.Parquet(urls, columns=["input_ids"]), SEQ, column="input_ids",
                                  lengths=[len(d) for d in docs])
        with aioload.DataLoader(ds, batch_size=4, shuffle=True, seed=1, num_workers=2) as dl:
            got = rows_of(dl)
    assert sorted(rows_seen(got, ids)) == list(range(len(memory)))


def test_a_window_reads_each_row_group_about_once_where_a_uniform_shuffle_reads_many(corpus):
    """Behind HTTP, one process, a row group cache of one: the requests each order makes."""
    folder, _, docs, _ = corpus

    def requests(window):
        with Server(folder) as server:
            urls = [server.url(f"part-{i}.parquet") for i in range(2)]
            source = aioload.Parquet(urls, columns=["input_ids"], cache_bytes=0, footer_cache=False)
            ds = aioload.PackedTokens(source, SEQ, column="input_ids", lengths=[len(d) for d in docs],
                                      window=window)
            before = sum(server.requests.values())
            with aioload.DataLoader(ds, batch_size=4, shuffle=True, seed=1, num_workers=0) as dl:
                assert sum(b["input_ids"].shape[0] for b in dl) == len(ds)
            return sum(server.requests.values()) - before, len(source.row_group_rows)

    windowed, groups = requests(1)
    uniform, _ = requests(None)
    # a block's rows read its row group and, for a row that runs on, the next one
    assert windowed <= 2 * groups + 2
    # reads in flight together share a row group's fetch, so the counts follow timing: uniform
    # made 36-44 requests against the window's 20-24 (1.8-2x) in ten runs
    assert uniform > 1.5 * windowed


def test_a_null_document_is_one_without_tokens(tmp_path):
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["the cat sat", None, "a dog ran far away", None, "on the mat"]}), path)
    ds = aioload.PackedTokens(aioload.Parquet([str(path)], columns=["text"], footer_cache=False), 3,
                              tokenizer=word_level(), eos=1, shuffle_documents=False)
    assert [doc for r in range(len(ds)) for doc, _, _ in ds.spans(r)] == [0, 2, 2, 4] and ds.tail == 2
    assert ds[0]["input_ids"].tolist() == [2, 3, 4]  # "the cat sat", then eos as the last label
