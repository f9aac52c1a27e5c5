"""Merging: rank event streams (rank files, TORCH_TRACE logs) into one report, the communication report included."""
