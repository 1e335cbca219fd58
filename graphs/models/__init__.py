"""Model graphs: the architecture registry and its builders (archs/), attention (split by -amb),
MLA and MoE, the KV caches, hyperparameters and tensor names."""
