"""KV strategies: what happens to the layers an exited token skips (issue 4)."""

KV_STRATEGIES = ("river", "recompute", "state_propagation", "mask", "mono_decreasing")
