"""backends/cpu/membw.py's read_pieces: every piece read once, its 8-byte words only."""
import numpy as np

from ggraph.backends.cpu.membw import read_pieces


def test_read_pieces_reads_each_piece_once_by_whole_words():
    pieces = [np.ones(n, np.uint8) for n in (0, 7, 8, 4096 + 5, 1 << 16)]
    assert read_pieces(pieces) == 0 + 0 + 8 + 4096 + (1 << 16)
    assert read_pieces([]) == 0
