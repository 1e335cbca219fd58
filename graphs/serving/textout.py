"""The text one choice sends as its tokens come: whole UTF-8 characters only, and never the
start of a stop string that may still complete (llama-server holds back a partial stop
string the same way). The first token's leading space is dropped where the vocabulary adds a
space prefix, as `ggraph run` prints it, so a server answer equals the command's text."""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TextOut:
    """Feed tokens with `add`; each returns the text that is now safe to send."""
    tokenizer: Any
    stops: tuple[str, ...] = ()
    text: str = ""                 # everything decoded so far
    sent: int = 0                  # characters of `text` already handed out
    stopped_by: str | None = None  # the stop string that ended the text
    n_tokens: int = 0
    _decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(
        "replace"))

    def add(self, token: int) -> str:
        piece = self.tokenizer.piece(token)
        if self.n_tokens == 0 and self.tokenizer.add_space_prefix and piece.startswith(b" "):
            piece = piece[1:]
        self.n_tokens += 1
        self.text += self._decoder.decode(piece)
        return self._release()

    def finish(self) -> str:
        """The rest, once generation ended for another reason (a partial stop string held
        back is text after all; an incomplete character becomes U+FFFD)."""
        if self.stopped_by is None:
            self.text += self._decoder.decode(b"", final=True)
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        return ""

    def _release(self) -> str:
        if self.stopped_by is not None:
            return ""
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.sent - longest + 1)
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, s = min(hits)
            self.stopped_by = s
            self.text = self.text[:at]
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        safe = len(self.text) - self._held(longest)
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def _held(self, longest: int) -> int:
        """Characters at the end of the text that begin some stop string."""
        for k in range(min(longest - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
