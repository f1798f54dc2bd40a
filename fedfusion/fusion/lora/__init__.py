"""Heterogeneous-rank LoRA: the method and its aggregation math."""
