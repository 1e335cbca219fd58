"""Text the commands share: command-line arguments read as valid Unicode, llama.cpp's escape
processing, and errors printed as one line (`ggraph COMMAND: error: ...`)."""
from __future__ import annotations

import sys

__all__ = ["argv_text", "process_escapes", "error_text", "fail"]


def argv_text(s: str) -> str:
    """Text from the command line as valid Unicode. On POSIX Python decodes argv with
    surrogateescape, so bytes that are not UTF-8 arrive as lone surrogates that no tokenizer or
    encoder accepts; like llama.cpp, read them as U+FFFD (the replacement character)."""
    try:
        raw = s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # surrogates that did not come from surrogateescape
        raw = s.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a",
            "b": "\b", "f": "\f", "v": "\v", "?": "?"}


def process_escapes(s: str) -> str:
    """llama.cpp's string_process_escapes for the common escapes and \\xHH; anything else is
    kept as written."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            e = s[i + 1]
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
                i += 2
                continue
            h = s[i + 2:i + 4]
            if e == "x" and len(h) == 2 and all(ch in "0123456789abcdefABCDEF" for ch in h):
                out.append(chr(int(h, 16)))
                i += 4
                continue
        out.append(c)
        i += 1
    return "".join(out)


def error_text(e: BaseException | str) -> str:
    """An error as one line: a KeyError's message without the quotes of its repr, the lines of
    a multi-line message joined, and the exception's type when it has no message."""
    if isinstance(e, str):
        text = e
    elif isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        text = e.args[0]
    elif isinstance(e, OSError) and e.strerror and e.filename is not None:
        text = f"{e.filename}: {e.strerror}"   # not "[Errno 2] No such file ...: 'x'"
    else:
        text = str(e)
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return text or (type(e).__name__ if isinstance(e, BaseException) else "failed")


def fail(command: str, e: BaseException | str) -> None:
    """Print `ggraph COMMAND: error: ...` as one line on stderr (after flushing stdout, so the
    message follows what was printed before it)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed or broken stdout: the message still goes out
        pass
    print(f"ggraph {command}: error: {error_text(e)}", file=sys.stderr, flush=True)
