"""Where a model runs: layer placement over devices, plans over devices and hosts, the memory plan
without weights, and presets of real models' shapes."""
