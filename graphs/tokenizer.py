"""Tokenizer built from a GGUF's vocabulary and merges (byte-level BPE, `tokenizers`), and the
chat template (the GGUF's Jinja template when jinja2 is present, ChatML otherwise)."""
from __future__ import annotations

from typing import Any

from .gguf_file import GGUFError


class Tokenizer:
    def __init__(self, metadata: dict[str, Any], path: str = "") -> None:
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise GGUFError(f"{path}: tokenizer model {model!r} is not supported (ggraph builds "
                            f"byte-level BPE, 'gpt2')")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        self._tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        types = metadata.get("tokenizer.ggml.token_type") or []
        specials = [t for t, ty in zip(tokens, types) if ty == 3]  # CONTROL tokens
        if specials:
            from tokenizers import AddedToken

            self._tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
        self.tokens = tokens
        self.bos = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos = metadata.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.template = metadata.get("tokenizer.chat_template")

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos is not None:
            ids = [self.bos] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def chat(self, user: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": user}]
        if self.template:
            try:
                import jinja2

                return jinja2.Template(self.template).render(
                    messages=messages, add_generation_prompt=True,
                    bos_token=self.tokens[self.bos] if self.bos is not None else "",
                    eos_token=self.tokens[self.eos] if self.eos is not None else "")
            except ImportError:
                pass
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                       for m in messages) + "<|im_start|>assistant\n"
