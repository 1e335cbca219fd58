"""GGUF files: the bounded reader (header, metadata, tensor table), loading a model's tensors
(mapped or read), edits that write a changed copy, scanning weights for inf/NaN, and fetching
the named models (sha256-checked)."""
