"""Benchmarks (`make bench-NAME`): paired, interleaved runs; ratios of medians with intervals."""
