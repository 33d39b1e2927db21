"""Benchmarks: `gradsync bench kernels` times every codec against a plain copy of the same tensor."""
