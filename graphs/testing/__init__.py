"""Models and files made for tests and measurements: tiny GGUF writers per architecture, synthetic
models in real shapes, and the GGUF fuzzer with its mutations."""
