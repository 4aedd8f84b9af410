"""The communication layer: topology, flat and receives-first exchanges, TAPA, the algorithm
registry and the autotune. Knows nothing about xfuser or models."""
