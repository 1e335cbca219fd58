"""backends/cpu/membw.py: read_pieces reads every piece once, its 8-byte words only; the
bandwidth buffer starts OFFSET bytes past a cache line."""
import numpy as np

from ggraph.backends.cpu.membw import OFFSET, past_line, read_pieces


def test_read_pieces_reads_each_piece_once_by_whole_words():
    pieces = [np.ones(n, np.uint8) for n in (0, 7, 8, 4096 + 5, 1 << 16)]
    assert read_pieces(pieces) == 0 + 0 + 8 + 4096 + (1 << 16)
    assert read_pieces([]) == 0


def test_the_bandwidth_buffer_starts_offset_bytes_past_a_line():
    for n in (8, 4096, 1 << 20):
        b = past_line(n)
        assert b.nbytes == n and b.ctypes.data % 64 == OFFSET and int(b.sum()) == n
