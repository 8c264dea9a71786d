"""Speculative decoding on the CPU: a quantized copy of the model drafts, the model checks.

One stream of a large GPT-2 on the CPU is bound by reading the weights once a token.
A step over a few tokens of a row reads the same weights as a step over one, so if
a cheap draft proposes the next few tokens, one step of the model can check them
all, and keep as many as it would have chosen itself (`accept.py`: the same tokens
greedily; the model's own distribution when sampling).

A room of its own (`extensions.ROOMS`), built on the decode bursts' path
(`gpt2_max.bursts`): a pass's further tokens reach MAX through `BurstContext`, rows
that need MAX's loop a token (log-probabilities, grammars, ...) and rows near the end
of their KV page are left to it, and rounds stop at the burst budget or when a
request arrives. What is here:

- `draft.py`: the draft, the model's weights packed at load in the block type
  `GPT2_MAX_DRAFT` names, or the smaller GPT-2 whose folder or GGUF file it names,
  compiled by the model's own hooks, writing its cache into pages of its own behind
  the model's page table;
- `accept.py`: which drafted tokens a row keeps (greedy, or rejection sampling);
- `pace.py`: how many tokens a round drafts, none where drafting does not pay;
- `model.py`: the extension that runs a decode pass as rounds of drafting and checking.

Off unless `GPT2_MAX_DRAFT` is set, on an accelerator, where it has not been
measured, and under `GPT2_MAX_LAYERS=plain`, whose layers multiply no packed draft.
Rows with top-k, top-p or min-p, or an end-of-text mask pending, decode without a
draft.
"""

from typing import Any

from ..extensions import Beside
from ..model_config import serves_fast_layers
from ..settings import settings
from .draft import memory as draft_memory
from .model import Speculation

__all__ = ["Speculation"]


def extend(model: Any) -> Speculation | None:
    kind = settings().draft
    return None if kind is None else Speculation(kind)


def memory(pipeline_config: Any, huggingface_config: Any, kv_params: Any) -> Beside | None:
    """The draft's weights and pages, which the memory planner leaves it (where the
    CPU's fast layers serve, the only place it drafts)."""
    kind = settings().draft
    on_cpu = all(spec.device_type == "cpu" for spec in pipeline_config.model.device_specs)
    drafts = kind and serves_fast_layers(on_cpu)
    return draft_memory(kind, huggingface_config, kv_params) if drafts else None
