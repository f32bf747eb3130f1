"""Search: the search space, the cost models (analytical, learned, the first-round prior), the tuner, its database."""
