"""Measuring models: perplexity, KL divergence against saved logits, and llama-bench's tests."""
