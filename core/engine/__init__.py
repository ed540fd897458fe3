"""Our decoding engine: the target's decode steps and attention, speculative decoding (chains, trees, sampling), CPU linears."""
