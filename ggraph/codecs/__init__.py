"""Codecs: every type's numpy quantizers and dequantizers (ggml's bit layouts, K-quants and IQ4
with their search kernels) and the conversions between values and a tensor's stored bytes
(buffers). Importing this package registers each type's codec in its record (ggraph.ir); the
root package imports it before anything else, so a record is complete wherever it is read."""
from ggraph.codecs import quants  # noqa: F401  (registers every type's codec, in ggml's order)
from ggraph.codecs import buffers  # noqa: F401,E402  (installs Tensor.set_data's encoder)
