"""Making GGUFs: llama-quantize's files and llama-imatrix's statistics.

Rooms: `mix` (llama.cpp's file types and the per-tensor rules that choose each tensor's type),
`quantize` (the streaming quantizer: a GGUF in, llama-quantize's bytes out; its row kernels are
the CPU backend's, backends/cpu/quantize_rows.py), `imatrix` (the importance matrix collected
through the eval callback, backends/observe.py) and `imatrix_file` (llama.cpp's two imatrix file
formats). docs/making-ggufs.md shows them together.
"""
