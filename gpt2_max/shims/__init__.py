"""Every place gpt2-max leans on MAX beyond its documented API, in one package.

MAX's Python API moves between releases, and a plugin has to reach past it in a
few places: a private helper, an internal kernel name, a serving-layer bug to
work around. Each such reach lives here, in a module that says what it leans on
and why, so nothing else in the package imports a private MAX name:

- `internals`: private MAX names and behaviours read directly (the memory
  estimator's free-memory query, the quantization-encoding resolver, the GGUF
  reader under `GGUFWeights`, the quantized CPU kernels' op names, the row-seed
  stride of MAX's generate loop, a graph tensor's value, a token buffer's
  processing window, the server's grammar backend factory, the chat route's
  conversion of an OpenAI `response_format`, the sampler's inputs, seeds,
  masks and call as the text pipeline makes them, and a poll of the model
  worker's request queue).
- `completion_prompts`: a completions body with no prompt, or with several
  prompts and `stream`, answered 400 naming the cause (MAX 26.7 answers 500).
- `weight_files`: a damaged local weight file named before MAX 26.7 reads its
  header and refuses the checkpoint without naming the file.
- `stop_strings`: exact `stop` strings under `max serve`, a patch of MAX's
  serving pipeline on the releases that cut stop strings wrongly.
- `structured_output`: `--enable-structured-output` on the CPU for this
  package's pipelines, which MAX 26.7 refuses for every model on the CPU.
- `fast_forward`: opt-in fast-forward tokens under `max serve`
  (`GPT2_MAX_FAST_FORWARD=1`), a `TextContext` subclass registered as the
  architecture's context type.
- `log_probabilities`: MAX's log-probabilities mixin with its graph compiled on
  first use instead of at every start.
- `shared_sampler`: the text pipeline's token sampler handed to the pipeline
  model, whose decode bursts (`gpt2_max.bursts`) sample with it. Installed by
  `gpt2_max.bursts` on import, not by `install`: MAX's model worker builds the
  pipeline from a pickled factory, importing the model's module but never
  `gpt2_max.arch`.
- `waiting_requests`: whether a request waits in MAX's scheduler's queue, told
  to the pipeline model, whose decode bursts end when one does. Installed
  with `shared_sampler`, for the same reason.
  Both hook the `__init__` of the MAX class that holds what they hand over,
  one way (`patching.after_init`).

(How MAX's CPU threads are scheduled is a speed policy, not a reach past MAX's
API: `gpt2_max.cpu_runtime`.)

`WRITTEN_FOR` names the MAX releases these were checked against;
`tests/shims/` assert that every leaned-on name and behaviour is still there,
and that the installed MAX is one of those releases, so a new MAX release fails
those tests by name instead of failing a user at serve time.

`install` runs when the architecture is registered (`gpt2_max.arch`), in every
process that imports it: the API process, whose serving layer the stop patch
changes, and the model worker.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from pathlib import Path

from . import completion_prompts, stop_strings, structured_output, weight_files

WRITTEN_FOR = ("26.7.",)
"""MAX releases (version prefixes) whose internals this package was checked against."""


def max_version() -> str:
    return importlib.metadata.version("max")


def install(tokenizer_type: type, check_weight_files: Callable[[list[Path]], None]) -> None:
    """Installs the patches `tokenizer_type`'s requests need on this MAX release;
    `check_weight_files` raises naming a damaged weight file (`weight_files`).

    Idempotent, and safe for several architectures (or copies of this package)
    in one process: each adds its own tokenizer type.
    """
    completion_prompts.install()
    weight_files.install(tokenizer_type, check_weight_files)
    stop_strings.install(tokenizer_type)
    structured_output.install(tokenizer_type)
