"""MAX's token sampler offered to the pipeline model, which may put another in its place
(`gpt2_max.sampler`), and handed to it for decode bursts (`gpt2_max.bursts`).

MAX 26.7's text pipeline builds the model first and its sampler graph after,
and keeps the sampler to itself. This patch of `TextGenerationPipeline.__init__`,
once the pipeline is built, asks a GPT-2 pipeline model which sampler the pipeline
should call (`model.sampler_for(sampler, device)`) and puts that one in the
pipeline's hands; then it hands it to a model that asks for it
(`model.takes("sampler")`, then `model.hand_over("sampler", sampler, device)`). A
burst samples with exactly the sampler MAX's loop calls: no second compile or
load, and no chance of two samplers that differ.
"""

from __future__ import annotations

from max.pipelines.lib.pipeline_variants.text_generation import TextGenerationPipeline

from .internals import pipeline_model, pipeline_sampler, replace_pipeline_sampler
from .patching import after_init, asks


def _hand_over(pipeline: TextGenerationPipeline) -> None:
    # Only a GPT-2 pipeline model: no other pipeline's private state is read.
    model = pipeline_model(pipeline)
    choose = getattr(model, "sampler_for", None)
    if not callable(choose):
        return
    _, sampler, device = pipeline_sampler(pipeline)
    chosen = choose(sampler, device)
    if chosen is not sampler:
        replace_pipeline_sampler(pipeline, chosen)
    if asks(model, "sampler"):
        model.hand_over("sampler", chosen, device)


def install() -> None:
    """Patches `TextGenerationPipeline.__init__` once per process."""
    after_init(TextGenerationPipeline, "shares_sampler", _hand_over)
