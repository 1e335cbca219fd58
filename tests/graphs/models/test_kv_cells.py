"""The KV cache's cells (graphs/models/kv_cells.py) and the batch checks
(graphs/models/batch.py), on their own: where tokens go, what each may attend to, the
sequence operations with llama.cpp's rules, and the one-line errors of a bad batch."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.graphs.models.batch import Batch, UBatch, prepare, split_equal, split_simple
from ggraph.graphs.models.kv_cells import KVCells


def put(c: KVCells, pos: list[int], seqs: list[tuple[int, ...]]) -> np.ndarray:
    cells = c.find_slot(len(pos))
    assert cells is not None
    c.apply(cells, np.array(pos), seqs)
    return cells


def seen(c: KVCells, pos: int, seq: int, n_kv: int | None = None) -> list[int]:
    m = c.mask(np.array([pos]), np.array([seq]), n_kv or c.size)
    return np.flatnonzero(m[0] == 0).tolist()


def test_one_sequence_fills_cells_in_order_and_masks_causally():
    c = KVCells(16)
    assert list(put(c, [0, 1, 2, 3], [(0,)] * 4)) == [0, 1, 2, 3]
    assert list(put(c, [4], [(0,)])) == [4]
    assert c.used == 5 and c.used_max_p1 == 5 and c.head == 5
    assert seen(c, 2, 0) == [0, 1, 2]
    assert c.seq_pos_min(0) == 0 and c.seq_pos_max(0) == 4


def test_sequences_see_only_their_own_cells_and_shared_ones():
    c = KVCells(16, n_seq_max=3)
    put(c, [0, 1], [(0, 1, 2)] * 2)             # a common prefix, stored once
    put(c, [2, 3], [(0,), (0,)])
    put(c, [2], [(1,)])
    put(c, [2, 3, 4], [(2,)] * 3)
    assert c.used == 8
    assert seen(c, 3, 0) == [0, 1, 2, 3]
    assert seen(c, 2, 1) == [0, 1, 4]
    assert seen(c, 4, 2) == [0, 1, 5, 6, 7]
    assert c.seq_pos_max(1) == 2 and c.seq_pos_max(2) == 4


def test_seq_rm_cp_keep_and_the_head():
    c = KVCells(8, n_seq_max=2)
    put(c, [0, 1, 2, 3], [(0,)] * 4)
    c.seq_cp(0, 1, 0, 2)                          # sequence 1 shares positions 0, 1
    assert seen(c, 5, 1) == [0, 1]
    c.seq_rm(0, 1, -1)                            # 0 keeps position 0; cell 1 stays for 1
    assert c.seq_positions(0).tolist() == [0] and c.used == 2 and c.head == 2
    assert list(put(c, [1], [(0,)])) == [2]       # the first free cell from the head
    c.seq_keep(1)
    assert c.used == 2 and c.seq_pos_max(0) == -1 and c.seq_positions(1).tolist() == [0, 1]
    c.seq_rm(-1, -1, -1)
    assert c.used == 0 and c.head == 0


def test_seq_add_moves_positions_and_records_the_shift():
    c = KVCells(8)
    put(c, list(range(6)), [(0,)] * 6)
    c.seq_rm(0, 1, 3)
    c.seq_add(0, 3, -1, -2)
    assert c.pos.tolist()[:6] == [0, -1, -1, 1, 2, 3]
    cells, delta = c.shifted()
    assert cells.tolist() == [3, 4, 5] and delta.tolist() == [-2, -2, -2]
    assert c.head == 0                            # llama.cpp: no cell freed -> head 0
    c.seq_add(0, 0, 1, -5)                        # below 0: the cell empties
    assert c.pos[0] == -1 and c.head == 0
    c.reset_shift()
    assert c.shifted()[0].size == 0
    c.seq_div(0, 0, -1, 2)                        # llama.cpp's sign: shift += old - new
    assert c.pos.tolist()[3:6] == [0, 1, 1] and c.shift.tolist()[3:6] == [1, 1, 2]


def test_sliding_window_cells_are_reused_once_outside_the_window():
    c = KVCells(8, n_seq_max=2, n_swa=4)
    put(c, list(range(8)), [(0,)] * 8)
    assert c.find_slot(1) is not None             # position 8 no longer sees 0..4
    assert c.find_slot(5).tolist() == [0, 1, 2, 3, 4] and c.find_slot(6) is None
    put(c, [8, 9], [(0,), (0,)])                  # cells 0 and 1, ring-like
    assert c.pos.tolist() == [8, 9, 2, 3, 4, 5, 6, 7]
    assert seen(c, 9, 0) == [0, 1, 6, 7]          # 9 sees 6..9 only
    put(c, [10, 11, 12], [(0,)] * 3)              # purges the positions below: one run
    assert c.seq_pos_min(0) == 5 and c.seq_pos_max(0) == 12


def test_find_slot_without_room_changes_nothing():
    c = KVCells(4, n_seq_max=2)
    put(c, [0, 1, 2], [(0,)] * 3)
    before = c.snapshot()
    assert c.find_slot(2) is None
    assert all(np.array_equal(a, b) for a, b in zip(c.snapshot()[:3], before[:3]))


def test_cells_refuse_bad_sequences():
    with pytest.raises(ValueError, match="1..256 sequences"):
        KVCells(8, n_seq_max=0)
    c = KVCells(8, n_seq_max=2)
    with pytest.raises(ValueError, match=r"sequence id 2 is out of range \[0, 2\)"):
        c.seq_rm(2)
    with pytest.raises(ValueError, match="divisor must be positive"):
        c.seq_div(0, 0, -1, 0)


class Mem:
    def __init__(self, ranges: dict[int, tuple[int, int]]) -> None:
        self.r = ranges

    def seq_pos_min(self, s: int) -> int:
        return self.r.get(s, (-1, -1))[0]

    def seq_pos_max(self, s: int) -> int:
        return self.r.get(s, (-1, -1))[1]


def test_prepare_fills_positions_and_outputs():
    ub = prepare(Batch.of_sequences([[5, 6, 7], [8, 9]]), 100, 4, Mem({1: (0, 3)}))
    assert ub.pos.tolist() == [0, 1, 2, 4, 5]
    assert ub.seq.tolist() == [0, 0, 0, 1, 1] and ub.out_rows.tolist() == [2, 4]
    parts = split_simple(ub, 2)
    assert [len(p) for p in parts] == [2, 2, 1] and parts[1].seq.tolist() == [0, 1]
    parts = split_simple(ub, 5)   # a batch that fits is its own ubatch
    assert len(parts) == 1 and parts[0] is ub
    one = prepare(Batch([1, 2]), 100, 1, Mem({}))
    assert one.out.tolist() == [False, True] and one.seq_ids == ((0,), (0,))


@pytest.mark.parametrize("batch,mem,message", [
    (Batch([1, 100]), {}, r"invalid token\[1\] = 100: ids are in \[0, 100\)"),
    (Batch([3, -1]), {}, r"invalid token\[1\] = -1: ids are in \[0, 100\)"),
    # past batch.SMALL tokens the ids are checked by numpy: the same message
    (Batch(list(range(40)) + [100, 7]), {},
     r"invalid token\[40\] = 100: ids are in \[0, 100\)"),
    (Batch([], None), {}, "non-empty list of integer token ids"),
    (Batch([1], seq_ids=[(4,)]), {}, r"invalid seq_id\[0\] = 4: ids are in \[0, 4\)"),
    (Batch([1], seq_ids=[()]), {}, "token 0 has no sequence id"),
    (Batch([1, 2], pos=[3, 4]), {0: (0, 1)}, "starts at position 3 but the cache holds it "
                                             "up to 1; positions must continue at 2"),
    (Batch([1, 2], pos=[0, 2]), {}, "positions 0..2 have gaps"),
    (Batch([1, 2], pos=[1, 0]), {}, "positions decrease at token 1"),
    (Batch([1], seq_ids=[(0, 1)]), {0: (0, 3)}, "share tokens of the batch but hold "
                                                "different positions"),
    (Batch([1, 2], logits=[True]), {}, "2 tokens but 1 logits flags"),
    (Batch([1], pos=[-1]), {}, r"invalid pos\[0\] = -1"),
])
def test_prepare_refuses_bad_batches_in_one_line(batch, mem, message):
    with pytest.raises(ValueError, match=message):
        prepare(batch, 100, 4, Mem(mem))


def test_ubatch_parts_keep_their_rows():
    ub = UBatch(np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32), ((0,),) * 4,
                np.array([True, False, False, True]))
    assert ub.part(1, 4).out_rows.tolist() == [2]


def test_split_equal_takes_equal_shares_of_consecutive_sequences():
    """llama.cpp's split_equal(sequential): sequences 0, 1, 2 with 5, 3 and 4 tokens,
    interleaved, in ubatches of at most 8: 2 each of the three (3 * 3 > 8), then 1 each of
    the three (what sequence 1 has left), then the rest of 0 and 2 (not consecutive ids:
    one ubatch each). Every ubatch keeps each token's place in the batch."""
    seqs = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 2, 0]
    ub = UBatch(np.arange(12, dtype=np.int32), np.zeros(12, np.int32),
                tuple((s,) for s in seqs), np.ones(12, bool))
    parts = split_equal(ub, 8)
    assert [p.seq.tolist() for p in parts] == [[0, 0, 1, 1, 2, 2], [0, 1, 2], [0, 0], [2]]
    assert sorted(np.concatenate([p.places for p in parts]).tolist()) == list(range(12))
    assert parts[0].places.tolist() == [0, 3, 1, 4, 2, 5]
    assert parts[0].tokens.tolist() == [0, 3, 1, 4, 2, 5]
    with pytest.raises(ValueError, match="token 1 belongs to sequences 0, 1: with a KV cache "
                                         "stream per sequence"):
        split_equal(UBatch(np.zeros(2, np.int32), np.zeros(2, np.int32), ((0,), (0, 1)),
                           np.ones(2, bool)), 8)
