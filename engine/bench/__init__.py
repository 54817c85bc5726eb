"""Benchmarks: decode, speculation, cost, GPU what-if and plots (python -m engine.bench [decode|spec|cost])."""
