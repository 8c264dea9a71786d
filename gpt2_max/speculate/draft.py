"""The draft: the model's own weights quantized at load, or a smaller GPT-2, compiled
beside the model.

`GPT2_MAX_DRAFT` names it. A block type packs the model's own projections and head
at load (no second file, and a copy that agrees with the model wherever it is
confident). A path names a checkpoint folder or a GGUF file of another GPT-2 with the
same vocabulary (distilgpt2 for gpt2, gpt2 for gpt2-xl), read through the weight
format's own adapter and check, as the model's are.

The draft is built by the model's own hooks, in the order MAX's `load_model` calls
them (`_create_model_config` reads the weights plan off the draft's state dict, a
smaller GPT-2 taking its shape from its own config, `_prepare_state_dict` repacks
what MAX's kernel multiplies, `_instantiate_module` builds a `GPT2`), so it is the
model's graph over the draft's weights: the fast layers multiply packed ones as they
multiply a GGUF's.

Its keys and values go into pages of its own, as many as the model's cache has and
addressed through the model's page table: a row's draft entries sit in the pages MAX
gave the row, so MAX's allocation, eviction and reuse of pages bound the draft's too
and nothing needs freeing. Which of a row's tokens the draft's pages hold is the
extension's to track (`model.Speculation`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import psutil
from max import tree
from max.driver import Buffer
from max.experimental import functional as F
from max.experimental.tensor import default_dtype
from max.graph.weights import WeightData, Weights, load_weights, weights_format
from transformers import AutoConfig

from ..bursts.model import step_inputs
from ..encodings import PACKED_TYPES, block_geometry
from ..extensions import Beside
from ..gguf.adapter import huggingface_config as gguf_huggingface_config
from ..gguf.adapter import metadata
from ..gguf.quants import quantize
from ..inputs import GPT2Inputs
from ..model_config import GPT2ArchConfig, shape_fields, validate_huggingface_config
from ..names import PACKAGE
from ..settings import setting
from ..weights.formats import formats, held_bytes, release
from ..weights.hugepages import hugepage_array
from ..weights.plan import block_type, packed_weight
from ..weights.schema import expected_shapes, is_projection_weight, ties_word_embeddings

logger = logging.getLogger("max.pipelines")

ENV = setting("draft").variable


def float_weight(weight: WeightData) -> np.ndarray:
    """`weight` as float32, its GGUF blocks dequantized if it is packed."""
    kind = block_type(weight)
    if kind is None:
        return np.asarray(weight.data).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    return gguf.quants.dequantize(np.asarray(weight.data), qtype).astype(np.float32)


def quantized_state(state: dict[str, WeightData], kind: str, tied: bool) -> dict[str, WeightData]:
    """`state` (the model's weights as its adapter loaded them) with the matrices a
    decode step streams (the blocks' projections, the head) packed as `kind`: a tied
    head multiplies a packed copy of the token table, which is still gathered as
    floats, as a quantized GGUF's is (`gguf.adapter`).

    Raises:
        ValueError: a matrix's rows are not whole blocks of `kind`.
    """
    qtype = gguf.GGMLQuantizationType[kind.upper()]

    def packed(name: str, weight: WeightData) -> WeightData:
        try:
            blocks = quantize(float_weight(weight), qtype)
        except ValueError as error:
            raise ValueError(
                f"{ENV}={kind}: cannot pack {name} {tuple(weight.shape)} as {kind} "
                f"({error}); name a block type whose blocks divide it, such as q4_0 or q8_0."
            ) from error
        return packed_weight(hugepage_array(blocks), name, kind)

    draft = {
        name: packed(name, weight) if is_projection_weight(name) or name == "lm_head.weight"
        else weight
        for name, weight in state.items()
    }
    if tied and "lm_head.weight" not in draft:
        draft["lm_head.weight"] = packed("lm_head.weight", state["wte.weight"])
    return draft


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of the draft `path` names: a GGUF file, or a folder's files of
    the first format it holds (`weights.formats`)."""
    if path.is_file():
        return [path]
    for weight_format in formats():
        if files := sorted(path.glob(f"*{weight_format.suffix}")):
            return files
    suffixes = ", ".join(f.suffix for f in formats())
    raise ValueError(f"{ENV}={path}: the folder holds no weights ({suffixes})")


def checkpoint_config(path: Path, files: list[Path]) -> Any:
    """The draft's transformers config: the folder's `config.json`, else the GGUF's own
    metadata."""
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    reader = gguf.GGUFReader(files[0])
    return gguf_huggingface_config(metadata(reader), {t.name for t in reader.tensors})


def check_fits(config: Any, model: Any) -> None:
    """Refuses a draft whose tokens or positions are not the model's.

    Raises:
        ValueError: naming the setting, the draft's field and the model's.
    """
    validate_huggingface_config(config)
    if config.vocab_size != model.huggingface_config.vocab_size:
        raise ValueError(
            f"{ENV}: the draft has a vocabulary of {config.vocab_size} tokens, the model "
            f"{model.huggingface_config.vocab_size}; a draft proposes the model's token ids"
        )
    if config.n_positions < model.max_seq_len:
        raise ValueError(
            f"{ENV}: the draft has {config.n_positions} positions, fewer than the "
            f"{model.max_seq_len} the model serves"
        )


def memory(source: str, model_config: Any, kv_params: Any) -> Beside:
    """What the draft `source` takes beside a model of `model_config` whose cache has
    pages of `kv_params`: its weights (a self-draft's packed matrices and float
    tables; a path's files), and a page of its own for each of the model's."""
    if source in PACKED_TYPES:
        config = model_config
        block, size = block_geometry(source)
        width = config.n_embd
        matrices = sum(
            math.prod(shape) for name, shape in expected_shapes(config).items()
            if is_projection_weight(name)
        ) + config.vocab_size * width  # and the head
        packed = matrices * size // block
        tables = (config.vocab_size + config.n_positions) * width * 4
        fixed = packed + tables
    else:
        files = checkpoint_files(Path(source))
        config = checkpoint_config(Path(source), files)
        fixed = sum(file.stat().st_size for file in files)
        fixed = max(fixed, held_bytes(files, config) or 0)  # e.g. half precision, widened
    # A page holds keys and values of every layer, `width` each a token.
    per_page = (kv_params.bytes_per_block * config.n_layer * config.n_embd
                // (model_config.n_layer * model_config.n_embd))
    return Beside(fixed=fixed, per_page=per_page)


class Draft:
    """The compiled draft and the pages it writes."""

    def __init__(self, model: Any, source: str) -> None:
        """Reads or packs the draft's weights (`source`: a block type or a path) and
        compiles it (a second compile, cached by MAX as the model's is)."""
        weights: Weights | None = None
        if source in PACKED_TYPES:
            hf_config = model.huggingface_config
            state = quantized_state(
                model._load_state_dict(), source, ties_word_embeddings(hf_config)
            )
        else:
            path = Path(source)
            files = checkpoint_files(path)
            hf_config = checkpoint_config(path, files)
            check_fits(hf_config, model)
            fmt = next(f for f in formats() if f.name == weights_format(files))
            for file in files:
                fmt.check(file)
            weights = load_weights(files)
            state = fmt.adapter(dict(weights.items()), huggingface_config=hf_config)
        # Its packed weights take the kernel with the faster one-row step: a draft
        # runs one row a step, and nothing it computes is served.
        config = model._create_model_config(state)
        config = dataclasses.replace(
            config, weights=dataclasses.replace(config.weights, work="decode")
        )
        if hf_config is not model.huggingface_config:
            config = dataclasses.replace(
                config, **shape_fields(hf_config),
                kv_params=GPT2ArchConfig.construct_kv_params(
                    huggingface_config=hf_config, pipeline_config=model.pipeline_config,
                    devices=config.devices, kv_cache_config=model.kv_cache_config,
                    cache_dtype=config.kv_params.dtype,
                ),
            )
        state = model._prepare_state_dict(state, config)
        logger.info(f"{PACKAGE}: compiling the draft ({ENV}={source})")
        with F.lazy(), default_dtype(model._module_default_dtype(state, config)):
            module = model._instantiate_module(config)
        self._graph: Callable[..., Any] = module.compile(
            *model._get_compile_input_types(config), weights=state
        )
        if weights is not None:
            release(weights)
        self.kv_params = config.kv_params
        self.description = (
            f"the model's own weights in {source}" if weights is None else
            f"{path} (a GPT-2 of {config.num_layers} layer"
            f"{'s' if config.num_layers > 1 else ''}, {config.hidden_size} wide)"
        )
        self._share = model.kv_cache_config.device_memory_utilization
        self._blocks: Buffer | None = None

    def allocate(self, first: GPT2Inputs) -> str | None:
        """Allocates the draft's pages, as many as the model's cache has, on the first
        step; or says why not: they would not fit in the memory left, as a share of
        it as large as MAX's planner uses (the package's planner leaves the draft its
        pages unless `--max-batch-total-tokens` sized the model's cache; memory taken
        since the start may still leave too little)."""
        if self._blocks is not None:
            return None
        (kv,) = first.kv_cache_inputs
        shape = (int(kv.kv_blocks.shape[0]), *self.kv_params.shape_per_block)
        need = math.prod(shape) * self.kv_params.dtype.size_in_bytes
        # The model's pages may not be resident yet: counted as if they will all be.
        model = kv.kv_blocks.num_elements * kv.kv_blocks.dtype.size_in_bytes
        free = psutil.virtual_memory().available
        if need + model > self._share * free:
            return (
                f"the draft's cache ({need / 2**20:.0f} MiB for the model's {shape[0]} "
                f"pages) and the model's ({model / 2**20:.0f} MiB) do not fit in the "
                f"{free / 2**20:.0f} MiB left; size the model's cache with "
                "--max-batch-total-tokens (or a smaller --max-batch-size)"
            )
        self._blocks = Buffer(shape=shape, dtype=self.kv_params.dtype, device=first.tokens.device)
        logger.info(f"{PACKAGE}: the draft's cache takes %.0f MiB beside the model's", need / 2**20)
        return None

    def logits(self, first: GPT2Inputs, rows: Sequence[np.ndarray], starts: np.ndarray
               ) -> np.ndarray:
        """The draft's next-token logits (`[len(rows), vocab]`) after each row's tokens
        `rows[r]`, placed from position `starts[r]`, where the row's draft cache ends."""
        assert self._blocks is not None, "allocate() the draft's pages first"
        inputs = step_inputs(first, self.kv_params, rows, starts, kv_blocks=self._blocks)
        # Raw, as the model's own steps run (`cpu_runtime`): no `Tensor` wrapping.
        out = tree.unflatten(self._graph.out_tree, self._graph.execute_raw(*inputs.buffers))
        return out.next_token_logits.to_numpy()
