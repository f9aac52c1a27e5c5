"""What runs on each rank: the collector, the communication capture, the per-rank program and the numerics check."""
