"""Training the drafters that learn from the target: Medusa heads and EAGLE's one-layer head
(:mod:`specdec.training.heads`), run by ``specdec train-heads``."""
