"""The shared-memory hand-off without a worker process: slot geometry, the writers writing into a
real memfd segment in this process, the parent's readers reading it back, chunk mode's join, and
the leaf walker's container rules."""

from __future__ import annotations

import pickle
from collections import OrderedDict, UserDict, namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from aioload._handoff.chunks import ChunkWriter, Unsupported, check_supported, join_chunks, load_chunk, move_chunk_into_slot
from aioload._handoff.shm import Segment
from aioload._handoff.layout import ALIGN, NO_SPEC, Column, Inline, Layout, LeafSpec, Overflow, in_column, leaf_spec, number_spec
from aioload._handoff.views import SlotView, collate_rows, load_batch, load_rows
from aioload._handoff.writers import RowWriter, SlotWriter, column_views, move_into_slot
from aioload._handoff.tree import leaves, map_leaves, map_tensors

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

Point = namedtuple("Point", "x y")


def same(a, b) -> None:
    """``a`` and ``b`` are equal, of the same types, all the way down."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    else:
        assert a == b


def in_segment(t: torch.Tensor, segment: Segment) -> bool:
    """``t``'s memory lies inside ``segment`` (a view of the slot, not a copy)."""
    return segment.address <= t.data_ptr() < segment.address + segment.size


@pytest.fixture
def segments():
    made = []

    def make(size: int) -> Segment:
        made.append(Segment.create(size))
        return made[-1]

    yield make
    for segment in made:
        segment.close()


def view_of(segment, layout) -> SlotView:
    return SlotView(segment, layout, lambda: None)


# ----------------------------------------------------------------------------- geometry


def test_columns_start_aligned_one_after_another_then_the_overflow_area():
    leaves_ = [LeafSpec("t", "torch.uint8", (3,)), LeafSpec("t", "torch.float32", (5,)), LeafSpec("p", "torch.int64", ())]
    layout = Layout(leaves_, rows=3, overflow=100)
    assert [spec.nbytes for spec in leaves_] == [3, 20, 8]
    # 3 rows of 3 bytes end at 9 -> 64; 3 rows of 20 end at 124 -> 128; 3 rows of 8 end at 152 -> 192
    assert layout.offsets == [0, 64, 128]
    assert layout.fixed_bytes == 192
    assert layout.overflow == 128 and layout.size == 320
    assert all(offset % ALIGN == 0 for offset in layout.offsets)


def test_more_rows_keep_the_leaves_and_the_overflow_share_per_row():
    layout = Layout([LeafSpec("n", "<f8", (2, 2))], rows=4, overflow=256)
    longer = layout.with_rows(10)
    assert longer.leaves == layout.leaves and longer.rows == 10
    assert longer.fixed_bytes == 10 * 32  # 320, already aligned
    assert longer.overflow == 640  # 64 bytes of overflow per row, as before
    wider = layout.with_overflow(1000)
    assert wider.rows == 4 and wider.overflow == 1024 and wider.fixed_bytes == layout.fixed_bytes


def test_a_layout_rebuilt_from_its_description_agrees_on_every_offset():
    layout = Layout([LeafSpec("t", "torch.bfloat16", (7,)), LeafSpec("n", "<i2", (3,))], rows=5, overflow=70)
    desc = pickle.loads(pickle.dumps(layout.describe()))
    again = Layout(*desc)
    assert (again.offsets, again.fixed_bytes, again.size) == (layout.offsets, layout.fixed_bytes, layout.size)


def test_which_leaves_can_live_in_a_slot():
    assert leaf_spec(torch.zeros(2, 3, dtype=torch.int16)) == LeafSpec("t", "torch.int16", (2, 3))
    assert leaf_spec(np.zeros(4, dtype=np.float32)) == LeafSpec("n", "<f4", (4,))
    assert leaf_spec(torch.zeros(2, requires_grad=True)) is None
    assert leaf_spec(torch.zeros(2).to_sparse()) is None
    assert leaf_spec(np.array(["a"], dtype=object)) is None
    assert leaf_spec(np.zeros(2, dtype=">f4")) is None  # not native byte order
    assert number_spec(3) == LeafSpec("p", "torch.int64", ()) and number_spec(True).dtype == "torch.bool"
    assert number_spec(2**63) is None and number_spec(-(2**63)) is not None
    assert pickle.loads(pickle.dumps(Overflow(128, LeafSpec("t", "torch.uint8", (9,))))) == Overflow(128, LeafSpec("t", "torch.uint8", (9,)))
    assert pickle.loads(pickle.dumps(in_column(3))) is in_column(3) and in_column(300) == Column(300)
    assert NO_SPEC.nbytes == 0


# ----------------------------------------------------------------------------- rows mode


def _sample(i: int):
    return {
        "image": torch.arange(48, dtype=torch.uint8).reshape(3, 4, 4) + i,
        "mask": torch.tensor([i % 2 == 0, True]),
        "emb": torch.full((2,), i / 4, dtype=torch.bfloat16),  # no numpy dtype: a tensor column
        "array": np.arange(3, dtype=np.float32) * i,
        "label": i,
        "score": i / 2,
        "flag": i > 1,
        "name": f"sample-{i}",
        "point": Point(torch.tensor([i, -i], dtype=torch.int64), "p"),
        "nested": [(torch.tensor([i], dtype=torch.int16), b"raw")],
    }


def _rows_layout(sample, rows: int, overflow: int = 0) -> Layout:
    probe = RowWriter(None, None, None)
    probe.dump(sample, 0)  # no slot: every leaf inline, every leaf position's spec noted
    return Layout(probe.first_specs, rows, overflow)


def test_rows_written_into_a_slot_read_back_as_default_collate_makes_them(segments):
    samples = [_sample(i) for i in range(4)]
    layout = _rows_layout(samples[0], rows=4)
    segment = segments(layout.size)
    writer = RowWriter(segment, layout, (layout.fixed_bytes, layout.size))
    payloads = [(row, writer.dump(sample, row)) for row, sample in enumerate(samples)]
    assert writer.overflow_wanted == 0
    skeleton = pickle.loads(payloads[0][1])
    assert skeleton["image"] is in_column(0) and skeleton["array"] is in_column(3)
    assert skeleton["name"] == "sample-0" and skeleton["point"].y == "p"

    batch = collate_rows(load_rows(payloads), [0, 1, 2, 3], view_of(segment, layout))
    same(batch, default_collate(samples))
    assert in_segment(batch["image"], segment)  # a whole column: a view of the slot, not a stack
    assert batch["image"].data_ptr() == segment.address + layout.offsets[0]


def test_rows_out_of_order_are_read_cell_by_cell(segments):
    samples = [_sample(i) for i in range(3)]
    layout = _rows_layout(samples[0], rows=3)
    segment = segments(layout.size)
    writer = RowWriter(segment, layout, None)
    payloads = [(row, writer.dump(samples[row], row)) for row in (2, 0)]  # row 1 failed, say
    batch = collate_rows(load_rows(payloads), [2, 0], view_of(segment, layout))
    same(batch, default_collate([samples[2], samples[0]]))
    assert not in_segment(batch["image"], segment)  # not rows 0..n-1: stacked from the cells


def test_a_row_leaf_of_another_shape_goes_to_the_overflow_area_or_inline(segments):
    sample = {"tokens": torch.arange(5), "id": 0}
    layout = _rows_layout(sample, rows=2, overflow=2 * ALIGN)
    segment = segments(layout.size)
    writer = RowWriter(segment, layout, (layout.fixed_bytes, layout.size))
    longer = {"tokens": torch.arange(7) * 3, "id": 1}  # 56 bytes: fits the 128-byte area
    payload = writer.dump(longer, 1)
    place = pickle.loads(payload)["tokens"]
    assert type(place) is Overflow and place.offset == layout.fixed_bytes and place.spec.shape == (7,)
    batch = collate_rows(load_rows([(1, payload)]), [1], view_of(segment, layout))
    same(batch, default_collate([longer]))
    assert in_segment(batch["tokens"], segment) is False  # a batch of one row not at 0: a copy

    huge = {"tokens": torch.arange(40), "id": 2}  # 320 bytes: no room left
    place = pickle.loads(writer.dump(huge, 0))["tokens"]
    assert type(place) is Inline and torch.equal(place.value, huge["tokens"])
    assert writer.overflow_wanted == 320


def test_the_sample_that_taught_the_layout_is_moved_into_its_row(segments):
    samples = [_sample(i) for i in range(2)]
    probe = RowWriter(None, None, None)
    first = probe.dump(samples[0], 0)
    assert all(type(place) in (Inline, str, bytes) for place in leaves(pickle.loads(first), exact=True))
    layout = Layout(probe.first_specs, 2, 0)
    segment = segments(layout.size)
    moved = move_into_slot(first, segment, layout, 0)
    assert pickle.loads(moved)["image"] is in_column(0)
    second = RowWriter(segment, layout, None).dump(samples[1], 1)
    batch = collate_rows(load_rows([(0, moved), (1, second)]), [0, 1], view_of(segment, layout))
    same(batch, default_collate(samples))


def test_equal_payloads_share_one_skeleton():
    payload = pickle.dumps({"x": in_column(0), "name": "a"})
    skeletons = load_rows([(0, payload), (1, payload), (2, bytes(bytearray(payload)))])  # the same, and equal
    assert skeletons[0] is skeletons[1] is skeletons[2]


# ----------------------------------------------------------------------------- a whole batch


def _batch(lengths):
    return {
        "x": torch.arange(12, dtype=torch.float32).reshape(4, 3),
        "y": np.arange(4, dtype=np.int32),
        "names": ["a", "b", "c", "d"],
        "ragged": [torch.arange(n, dtype=torch.uint8) for n in lengths],
    }


def test_a_whole_batch_with_variable_leaves_reads_back_from_columns_and_overflow(segments):
    probe = SlotWriter(None, None, None)
    first = probe.dump(_batch([1, 2, 3, 4]), 0)
    same(load_batch(first, None), _batch([1, 2, 3, 4]))  # no slot: every leaf in the pickle
    layout = Layout(probe.first_specs, 1, 4 * ALIGN)
    segment = segments(layout.size)
    batch = _batch([5, 9, 2, 64])  # other lengths than the first: overflow leaves
    writer = SlotWriter(segment, layout, (layout.fixed_bytes, layout.size))
    loaded = load_batch(writer.dump(batch, 0), view_of(segment, layout))
    same(loaded, batch)
    assert writer.overflow_wanted == 0
    assert in_segment(loaded["x"], segment) and loaded["x"].data_ptr() == segment.address
    assert all(in_segment(t, segment) for t in loaded["ragged"])
    assert np.shares_memory(loaded["y"], np.frombuffer(segment.map, dtype=np.uint8))


def test_a_whole_batch_beyond_the_overflow_area_travels_inline_and_asks_for_more(segments):
    probe = SlotWriter(None, None, None)
    probe.dump(_batch([1, 2, 3, 4]), 0)
    layout = Layout(probe.first_specs, 1, ALIGN)
    segment = segments(layout.size)
    batch = _batch([10, 100, 20, 30])
    writer = SlotWriter(segment, layout, (layout.fixed_bytes, layout.size))
    loaded = load_batch(writer.dump(batch, 0), view_of(segment, layout))
    same(loaded, batch)
    assert writer.overflow_wanted == 128 + 64 + 64  # 10 fitted; 100, 20 and 30 did not
    assert in_segment(loaded["ragged"][0], segment) and not in_segment(loaded["ragged"][1], segment)


# ----------------------------------------------------------------------------- chunk mode


def _chunk_sample(i: int):
    return {"image": torch.full((2, 3), float(i)), "label": i, "name": f"n{i}",
            "point": Point(torch.tensor([i]), 0.5 * i), "vec": np.full(2, i, dtype=np.int64)}


def test_chunks_collated_into_the_slot_join_into_default_collates_batch(segments):
    samples = [_chunk_sample(i) for i in range(6)]
    probe = ChunkWriter(None, None, 0, None)
    first = probe.dump(samples[:1])
    layout = Layout(probe.specs, 6, 0)
    segment = segments(layout.size)
    columns = column_views(segment, layout)
    parts = [(0, 1, load_chunk(move_chunk_into_slot(first, segment, layout, columns, 0)))]
    for start, end in ((1, 4), (4, 6)):
        blob = ChunkWriter(segment, layout, start, columns).dump(samples[start:end])
        parts.append((start, end - start, load_chunk(blob)))
    assert parts[1][2]["image"] is in_column(0)
    batch = join_chunks(parts, view_of(segment, layout))
    same(batch, default_collate(samples))
    assert batch["image"].data_ptr() == segment.address  # all six rows: one view of the slot


def test_joined_numbers_take_default_collates_dtype_for_the_whole_batch(segments):
    samples = [{"v": 1}, {"v": 2}, {"v": 2.5}]  # an int first: torch.tensor() infers the dtype
    probe = ChunkWriter(None, None, 0, None)
    probe.dump(samples[:1])
    layout = Layout(probe.specs, 3, 0)
    segment = segments(layout.size)
    columns = column_views(segment, layout)
    parts = [(0, 2, load_chunk(ChunkWriter(segment, layout, 0, columns).dump(samples[:2]))),
             (2, 1, load_chunk(ChunkWriter(segment, layout, 2, columns).dump(samples[2:])))]
    same(join_chunks(parts, view_of(segment, layout)), default_collate(samples))


def test_chunks_of_different_lengths_do_not_join():
    a = [Inline(torch.zeros(1, 1))]
    b = [Inline(torch.zeros(1, 1)), Inline(torch.zeros(1, 1))]
    with pytest.raises(ValueError):
        join_chunks([(0, 1, a), (1, 1, b)], None)


def test_chunk_mode_refuses_a_mapping_it_cannot_rebuild_as_collate_does():
    check_supported({"a": [in_column(0), Inline(1)], "b": OrderedDict(c=in_column(1))})
    with pytest.raises(Unsupported):
        check_supported({"a": UserDict(b=in_column(0))})
    with pytest.raises(Unsupported):
        check_supported([in_column(0), torch.zeros(1)])


# ----------------------------------------------------------------------------- the walker


class Refuses(dict):
    def __init__(self, a, b):  # cannot be built from a dict: rebuilt as a plain dict
        super().__init__(a=a, b=b)


class Pair(list):
    def __init__(self, a, b):
        super().__init__([a, b])


def test_the_walker_rebuilds_each_container_as_it_was():
    tree = {"b": [1, (2, 3)], "a": Point(4, 5), "o": OrderedDict(z=6, y=7), "s": "text", "t": (), "u": UserDict(k=8)}
    out = map_leaves(lambda leaf: leaf * 10, tree)
    assert list(out) == ["b", "a", "o", "s", "t", "u"]  # the mapping's own key order
    assert out["b"] == [10, (20, 30)] and type(out["b"][1]) is tuple
    assert type(out["a"]) is Point and out["a"] == Point(40, 50)
    assert type(out["o"]) is OrderedDict and list(out["o"].items()) == [("z", 60), ("y", 70)]
    assert out["s"] == "text" * 10  # a string is a leaf, not a sequence of characters
    assert out["t"] == () and type(out["u"]) is UserDict and out["u"]["k"] == 80
    assert list(leaves(tree)) == [1, 2, 3, 4, 5, 6, 7, "text", 8]


def test_a_container_that_refuses_its_values_becomes_a_plain_one():
    out = map_leaves(lambda leaf: -leaf, {"r": Refuses(1, 2), "p": Pair(3, 4)})
    assert type(out["r"]) is dict and out["r"] == {"a": -1, "b": -2}
    assert type(out["p"]) is list and out["p"] == [-3, -4]


def test_exact_walks_only_the_builtin_containers_and_namedtuples():
    seen = []
    tree = {"o": OrderedDict(a=1), "l": Pair(1, 2), "n": Point(1, [2]), "d": {"x": (3,)}}
    out = map_leaves(lambda leaf: seen.append(type(leaf)) or leaf, tree, exact=True)
    assert seen == [OrderedDict, Pair, int, int, int]
    assert out["o"] is tree["o"] and type(out["n"]) is Point
    assert list(leaves(tree, exact=True)) == [tree["o"], tree["l"], 1, 2, 3]


def test_is_leaf_stops_the_walk_and_lockstep_pairs_the_leaves():
    tree = {"a": [1, 2], "b": {"c": 3}}
    assert map_leaves(lambda leaf: leaf if isinstance(leaf, dict) else leaf + 1, tree,
                      is_leaf=lambda node: isinstance(node, dict) and "c" in node) == {"a": [2, 3], "b": {"c": 3}}
    other = {"a": [10, 20], "b": {"c": 30}, "extra": 0}  # the first tree's keys decide
    assert map_leaves(lambda x, y: x + y, tree, other) == {"a": [11, 22], "b": {"c": 33}}
    with pytest.raises(ValueError):
        map_leaves(lambda x, y: x, {"a": [1]}, {"a": [1, 2]})
    with pytest.raises(KeyError):
        map_leaves(lambda x, y: x, {"a": 1}, {"b": 1})


def test_map_tensors_touches_tensors_only():
    batch = {"x": torch.ones(2), "meta": [("n", 3)], "p": Point(torch.zeros(1), None)}
    out = map_tensors(lambda t: t + 1, batch)
    assert torch.equal(out["x"], torch.full((2,), 2.0)) and out["meta"] == [("n", 3)]
    assert type(out["p"]) is Point and torch.equal(out["p"].x, torch.ones(1)) and out["p"].y is None


def test_the_slot_goes_back_once_the_last_tensor_viewing_it_is_gone(segments):
    import gc

    layout = Layout([LeafSpec("t", "torch.int64", (2,))], rows=2, overflow=0)
    segment = segments(layout.size)
    freed = []
    view = SlotView(segment, layout, lambda: freed.append(True))
    column, cell = view.column(0, 2), view.cell(0, 1, as_numpy=False)
    view.release()
    del column
    gc.collect()
    assert freed == []  # ``cell`` still views the slot
    del cell
    gc.collect()
    assert freed == [True]
