"""Checking: the reference executor (every op in numpy, from its record), the conformance
harness that compares a backend op by op against it, and the binding to the real libggml
(llama-cpp-python's build) that the ggml comparisons run through."""
