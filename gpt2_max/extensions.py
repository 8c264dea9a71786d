"""The one seam through which an optional room of the package extends the core.

The core (`arch`, `model`, the network, the plain layers, the safetensors weights)
serves GPT-2 exactly on its own. A feature beyond it (a speed policy that changes
how the model loads or runs a step, another weight format) is a room of its own
that the core never imports: it is named in `ROOMS`, imported by name when it is
there, and offers what it adds under agreed names, each optional:

- `extend(model)`: one `Extension` for the pipeline model, whose hooks wrap the
  model's load and each `execute` (composition: the model calls them in turn,
  outermost first; no room is a base class of the model) and may put another
  token sampler in the text pipeline's hands;
- `context_type(base)`: the architecture's context type, made from `base`;
- `WEIGHT_FORMAT`: a `weights.formats.WeightFormat` the architecture loads;
- `memory(pipeline_config, huggingface_config, kv_params)`: a `Beside`, the memory
  the room takes beside the model's weights and cache, which the memory planner
  leaves it (None: none).

A copy of the package that deletes a room loses that room's feature and nothing
else; a room that is there but fails to import fails the start, as any import would.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from .names import PACKAGE

ROOMS = ("speculate", "bursts", "cpu_runtime", "gguf", "sampler")
"""The rooms, in the order their extensions wrap the model, outermost first: a
speculative pass's checking steps go through the bursts' extension (which leaves
them be) and decode bursts run several of the runtime policy's steps."""

T = TypeVar("T")


@dataclass(frozen=True)
class Beside:
    """Memory a room takes beside the model's weights and KV cache."""

    fixed: int = 0
    """Bytes whatever the cache's size (a draft's weights)."""
    per_page: int = 0
    """Bytes for each page of the model's KV cache (a draft's own pages)."""

    def __add__(self, other: Beside) -> Beside:
        return Beside(self.fixed + other.fixed, self.per_page + other.per_page)


class Extension:
    """What a room may add to the pipeline model; each hook here leaves it as it is."""

    takes: frozenset[str] = frozenset()
    """Parts of MAX that shims hand over once MAX has built them ("sampler",
    "waiting_requests"; `GPT2PipelineModel.hand_over`) that this extension wants."""

    def load(self, model: Any, load: Callable[[], T]) -> T:
        """Runs `load()` (the model's load and compile, and the hooks inside this one)."""
        return load()

    def execute(self, model: Any, inputs: Any, run: Callable[[Any], Any]) -> Any:
        """One `execute` of the model: `run(inputs)` runs the step (and the hooks inside)."""
        return run(inputs)

    def receive(self, model: Any, part: str, *value: Any) -> None:
        """A part of MAX in `takes`, handed over."""

    def sampler(self, model: Any, sampler: Any, device: Any) -> Any:
        """The token sampler MAX's text pipeline should call in place of `sampler` (its
        own graph, or what an extension before this one made of it), on `device`."""
        return sampler


def rooms() -> list[ModuleType]:
    """The modules of the rooms in `ROOMS` that this copy of the package has."""
    found = []
    for room in ROOMS:
        name = f"{PACKAGE}.{room}"
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError as error:
            if error.name != name:
                raise  # the room is there; something it imports is not
    return found


def extensions_for(model: Any) -> tuple[Extension, ...]:
    """One extension per room that extends `model` (a room's `extend(model)` may
    return None: not on this device, or turned off)."""
    made = (getattr(room, "extend", lambda model: None)(model) for room in rooms())
    return tuple(extension for extension in made if extension is not None)


def context_type(base: type) -> type:
    """The architecture's context type: `base`, as each room's `context_type` makes it."""
    for room in rooms():
        base = getattr(room, "context_type", lambda base: base)(base)
    return base


def weight_formats() -> list[Any]:
    """The weight formats the rooms add (`weights.formats`)."""
    return [room.WEIGHT_FORMAT for room in rooms() if hasattr(room, "WEIGHT_FORMAT")]


def memory_beside(pipeline_config: Any, huggingface_config: Any, kv_params: Any) -> Beside:
    """The memory the rooms take beside the model's weights and cache (`Beside`)."""
    total = Beside()
    for room in rooms():
        if hasattr(room, "memory"):
            total += room.memory(pipeline_config, huggingface_config, kv_params) or Beside()
    return total
