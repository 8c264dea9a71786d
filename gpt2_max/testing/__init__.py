"""A test harness for anything that serves or calls GPT-2 through MAX, exact and offline.

- `gpt2_max.testing.reference`: tiny random checkpoints (written by
  `gpt2_max.tools.checkpoint`) and transformers' exact answers for them;
- `gpt2_max.testing.server`: `max serve` on a free loopback port, stopped as a
  whole process group;
- `gpt2_max.testing.load`: a bounded load generator whose every answer is
  checked token for token;
- `gpt2_max.testing.plugin`: pytest fixtures over the three, registered as the
  `gpt2_max` pytest plugin when the package is installed.

Needs the `test` extra (torch, openai, httpx, psutil, pytest).
"""
