"""The text a choice streams (graphs/serving/textout.py): whole characters, stop strings held
back until they cannot complete, and cut where they do."""
from __future__ import annotations

from dataclasses import dataclass

from ggraph.graphs.serving.textout import TextOut


@dataclass
class Pieces:
    """A tokenizer whose token i is pieces[i] (bytes)."""
    pieces: list[bytes]
    add_space_prefix: bool = False

    def piece(self, t: int) -> bytes:
        return self.pieces[t]


def feed(out: TextOut, toks: list[int]) -> list[str]:
    return [out.add(t) for t in toks] + [out.finish()]


def test_utf8_split_across_tokens_is_held_until_whole():
    e = "é".encode()
    out = TextOut(Pieces([b"ab", e[:1], e[1:] + b"c"]))
    assert feed(out, [0, 1, 2]) == ["ab", "", "éc", ""]


def test_stop_string_across_tokens_is_cut_and_never_sent():
    out = TextOut(Pieces([b"Hello", b" wor", b"ld", b"!"]), stops=("world",))
    got = feed(out, [0, 1, 2, 3])
    assert "".join(got) == "Hello " and out.stopped_by == "world"
    assert got[1] == " "   # "wor" could start the stop string: held back


def test_a_partial_stop_string_that_does_not_complete_is_text():
    out = TextOut(Pieces([b"a wo", b"nder"]), stops=("world",))
    assert "".join(feed(out, [0, 1])) == "a wonder"
    out = TextOut(Pieces([b"a wo"]), stops=("world",))
    assert feed(out, [0]) == ["a ", "wo"]   # ended for another reason: the rest is text


def test_earliest_of_several_stops():
    out = TextOut(Pieces([b"xx END yy STOP"]), stops=("STOP", "END"))
    assert "".join(feed(out, [0])) == "xx " and out.stopped_by == "END"


def test_space_prefix_of_the_first_token_dropped_as_ggraph_run_prints_it():
    out = TextOut(Pieces([b" Hi", b" there"], add_space_prefix=True))
    assert "".join(feed(out, [0, 1])) == "Hi there"
