"""Test-suite settings: every Engine scans its weights for inf/NaN at load (llama.cpp's
--check-tensors), so a corrupted model file fails loudly in any test that loads one."""
import os

os.environ.setdefault("GGRAPH_CHECK_TENSORS", "1")
