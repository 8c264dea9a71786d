"""Offline tools: writing checkpoints and GGUF files, and what a GGUF needs beside it.

Nothing MAX loads to serve imports this package; tests, benchmarks and users run
it before a server starts (`gpt2-max-checkpoint`, `gpt2-max-gguf-config`).
"""
