"""The HTTP side of `ggraph serve` (tools/serve.py): the Starlette app (`app`) and the shapes
of its answers (`responses`). Starlette and uvicorn are the `ggraph[server]` extra; nothing
outside this package and the command imports them."""
