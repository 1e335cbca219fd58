"""Text to tokens and back as llama.cpp does it: BPE with llama.cpp's pre-tokenizers,
SentencePiece, the vocabulary and special tokens, text pieces, and chat templates rendered in a
sandbox."""
