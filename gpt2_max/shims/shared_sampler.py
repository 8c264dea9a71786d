"""MAX's token sampler handed to the pipeline model, for decode bursts (`gpt2_max.bursts`).

MAX 26.7's text pipeline builds the model first and its sampler graph after,
and keeps the sampler to itself. A burst samples with exactly that graph, so
this patch of `TextGenerationPipeline.__init__` hands it to a model that asks
for it (`model.takes("sampler")`, then `model.hand_over("sampler", sampler,
device)`) once the pipeline is built: no
second compile or load, and no chance of a sampler that differs from MAX's.
"""

from __future__ import annotations

from max.pipelines.lib.pipeline_variants.text_generation import TextGenerationPipeline

from .internals import pipeline_model, pipeline_sampler
from .patching import after_init, asks


def _hand_over(pipeline: TextGenerationPipeline) -> None:
    # Only a model that asks: no other pipeline's private state is read.
    if not asks(pipeline_model(pipeline), "sampler"):
        return
    model, sampler, device = pipeline_sampler(pipeline)
    model.hand_over("sampler", sampler, device)


def install() -> None:
    """Patches `TextGenerationPipeline.__init__` once per process."""
    after_init(TextGenerationPipeline, "shares_sampler", _hand_over)
