"""Latency and throughput benchmarks of the mesh against a raw gRPC baseline (make bench)."""
