"""Registers GPT-2 with MAX under the checkpoint's architecture name."""

from max.graph.weights import WeightsFormat
from max.pipelines.context import TextContext
from max.pipelines.lib import SupportedArchitecture
from max.pipelines.modeling.types import PipelineTask

from . import extensions
from .batch_processor import GPT2BatchProcessor
from .memory_planner import TokenBudgetMemoryPlanner
from .model import GPT2PipelineModel
from .model_config import GPT2ArchConfig
from .tokenizer import GPT2TextTokenizer
from .weights.formats import formats

gpt2_arch = SupportedArchitecture(
    name="GPT2LMHeadModel",
    example_repo_ids=[
        "openai-community/gpt2",
        "distilbert/distilgpt2",
        "openai-community/gpt2-medium",
        "openai-community/gpt2-large",
        "openai-community/gpt2-xl",
    ],
    default_encoding=GPT2ArchConfig.DEFAULT_ENCODING,
    supported_encodings=GPT2ArchConfig.SUPPORTED_ENCODINGS,
    pipeline_model=GPT2PipelineModel,
    tokenizer=GPT2TextTokenizer,
    context_type=extensions.context_type(TextContext),
    default_weights_format=WeightsFormat.safetensors,
    weight_adapters={format.name: format.adapter for format in formats()},
    task=PipelineTask.TEXT_GENERATION,
    config=GPT2ArchConfig,
    batching=GPT2BatchProcessor,
    memory_planner=TokenBudgetMemoryPlanner,
    multi_gpu_supported=False,
    supports_overlap_scheduler=False,
    supports_device_graph_capture=False,
)
