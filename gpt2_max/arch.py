"""Registers GPT-2 with MAX under the checkpoint's architecture name."""

from max.graph.weights import WeightsFormat
from max.pipelines.context import TextContext
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner
from max.pipelines.lib import SupportedArchitecture
from max.pipelines.modeling.types import PipelineTask

from .weights import gguf, safetensors
from .batch_processor import GPT2BatchProcessor
from .model import GPT2Model
from .model_config import GPT2Config
from .tokenizer import GPT2Tokenizer

gpt2_arch = SupportedArchitecture(
    name="GPT2LMHeadModel",
    example_repo_ids=[
        "openai-community/gpt2",
        "distilbert/distilgpt2",
        "openai-community/gpt2-medium",
        "openai-community/gpt2-large",
        "openai-community/gpt2-xl",
    ],
    default_encoding=GPT2Config.DEFAULT_ENCODING,
    supported_encodings=GPT2Config.SUPPORTED_ENCODINGS,
    pipeline_model=GPT2Model,
    tokenizer=GPT2Tokenizer,
    context_type=TextContext,
    default_weights_format=WeightsFormat.safetensors,
    weight_adapters={
        WeightsFormat.safetensors: safetensors.convert_safetensor_state_dict,
        WeightsFormat.gguf: gguf.convert_gguf_state_dict,
    },
    task=PipelineTask.TEXT_GENERATION,
    config=GPT2Config,
    batching=GPT2BatchProcessor,
    memory_planner=PagedMemoryPlanner,
    multi_gpu_supported=False,
    supports_overlap_scheduler=False,
    supports_device_graph_capture=False,
)
