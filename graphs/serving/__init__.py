"""Serving many clients from one model: requests checked into records (`requests`), the
continuous-batching scheduler over the KV cache's sequences (`scheduler`), the text each
choice streams (`textout`), the longest cached prefix a new prompt can reuse (`prefix`) and
the server's counters (`metrics`). No HTTP here: `ggraph serve` (tools/serve.py,
tools/server/) puts these behind an OpenAI-compatible API."""
