"""The benchmark harness: mlxchat beside mlx-lm (and llama.cpp when installed) on random-weight checkpoints
with the real shapes of released models, against this machine's memory bandwidth and GEMM limits.

Run it with ``python -m benchmarks`` (see benchmarks/README.md). Not part of the test suite.
"""
