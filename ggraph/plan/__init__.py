"""Memory planning, a pure planner over graphs: the graph allocator (ggml-alloc's rules, in-place
reuse, worst-case reservation), its orders, fits and traces, the multi-device scheduler's
splits, and the host-memory check. It computes offsets and sizes; backends own the bytes."""
