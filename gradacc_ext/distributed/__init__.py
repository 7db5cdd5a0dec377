"""Gradient synchronisation across ranks: DDP, FSDP2 and the single-process case."""
