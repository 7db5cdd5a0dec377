"""Data parallelism for the accumulator: DDP (whole-buffer or overlapped), FSDP2 and HSDP, and one process."""
