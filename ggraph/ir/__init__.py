"""The IR, the lowest layer: tensor element types (the GGMLType enum and its type records),
op kinds, tensors with their views and contexts, and graphs. It records metadata only and
imports nothing of ggraph above it; the codecs layer registers each type's conversions into the
records (ggraph/codecs), and the ops (ggraph.ops) build tensors of it."""
