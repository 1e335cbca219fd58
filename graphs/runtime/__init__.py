"""Running a model: the engine (load, reserve, evaluate, generate, context shift) and the
samplers."""
