"""Sampling: turning logits into tokens, batched over requests with different parameters."""
