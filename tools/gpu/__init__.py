"""The parts of `ggraph gpu-check` (tools/gpu_check.py): its child processes (shards, the
sanitizer), the speed sections, and the decode measurement. No commands."""
