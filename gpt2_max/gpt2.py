"""The GPT-2 network in MAX's ModuleV3 API, over a paged KV cache.

Embeddings, the blocks (`layers/block.py`: attention and MLP, a file each in
`layers/`), the final norm and the LM head. The module tree mirrors the Hugging
Face checkpoint (`wte`, `wpe`, `h.{i}.attn.c_attn`, `h.{i}.mlp.c_fc`, `ln_f`,
...), so weights load under their own names; the one layout difference, Conv1D's
`[in, out]` weights, is undone in `weights/`.

A batch is ragged: the active tokens of every sequence are concatenated into one
`[total_tokens]` stream and `input_row_offsets[b] : input_row_offsets[b + 1]` is
sequence `b`'s slice. Each step embeds only those tokens, writes their keys and
values into the cache and attends over everything cached for the sequence.
"""

from __future__ import annotations

from max import tree
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.sequential import ModuleList
from max.experimental.tensor import Tensor
from max.graph import ops
from max.nn.kv_cache import KVCacheInputsPerDevice
from max.nn.transformer import ReturnLogits
from max.pipelines.lib import ModuleV3Outputs

from .layers import Layers
from .layers.block import layer_norm
from .model_config import GPT2ArchConfig
from .shims.internals import graph_value


def last_rows(input_row_offsets: Tensor, return_n_logits: Tensor, drafts: bool) -> Tensor:
    """The rows of the ragged batch whose logits a step returns as `next_token_logits`:
    the last `return_n_logits[0]` of each sequence, sequence by sequence. MAX's steps
    ask for one (the last token's); checking a draft's tokens asks for them all
    (`gpt2_max.speculate`), from the one graph, where the graph checks `drafts`.

    Elsewhere (off the CPU, where no draft runs) the rows are MAX's own transformer's
    last rows, `input_row_offsets[1:] - 1`. On an H200 the range form, in a bfloat16
    graph that also returns every row's logits (echo), chose another token than
    transformers at most steps and differed between two runs of one batch; this form
    chose transformers' token at every clear step of those batches
    (`benchmarks/results/2026-11-30-gpu-h200-fourth-run.md`)."""
    if not drafts:
        return input_row_offsets[1:] - 1
    back = ops.range(
        return_n_logits[0], 0, -1, out_dim="return_n_logits_range",
        device=input_row_offsets.device, dtype=DType.int64,
    )
    ends = F.unsqueeze(F.cast(input_row_offsets[1:], DType.int64), -1)
    return F.reshape(ends - back, [-1])


class GPT2(Module[..., ModuleV3Outputs]):
    """GPT-2 language model: embeddings, `n_layer` blocks, final norm, LM head."""

    def __init__(self, config: GPT2ArchConfig, layers: Layers) -> None:
        self.config = config
        self.layers = layers
        # A tied head's table has the head's rows (`head_rows`: padded off the CPU);
        # no token id reaches the padding.
        table_rows = config.head_rows if config.head_reads_wte else config.vocab_size
        self.wte = layers.embedding("wte", table_rows, config.hidden_size)
        self.wpe = layers.embedding("wpe", config.max_positions, config.hidden_size)
        self.h = ModuleList([layers.block(i) for i in range(config.num_layers)])
        self.ln_f = layer_norm(config)
        # A tied head multiplies `wte` in place (`[vocab, hidden]`, no copy);
        # otherwise the head has its own weight.
        self.lm_head = (
            None
            if config.head_reads_wte
            else layers.linear("lm_head", config.hidden_size, config.head_rows, bias=False)
        )

    @property
    def drafts(self) -> bool:
        """Whether a step may ask for several rows a sequence (`last_rows`): drafts are
        checked on the CPU only."""
        return self.config.devices[0].is_cpu()

    def logits(self, h: Tensor) -> Tensor:
        """Final LayerNorm and LM head for the rows of `h`, in float32 (what MAX's
        sampler and log-probabilities read, whatever the graph's dtype); ids the
        tokenizer lacks get -inf."""
        h = self.ln_f(h)
        if self.lm_head is None:
            logits = self.layers.tied_head(h, self.wte.weight)
        else:
            logits = self.lm_head(h)
        if self.config.head_rows > self.config.vocab_size:
            logits = logits[:, : self.config.vocab_size]  # the padded rows' logits
        if logits.dtype != DType.float32:
            logits = F.cast(logits, DType.float32)
        if self.config.usable_vocab_size < self.config.vocab_size:
            ids = F.arange(0, self.config.vocab_size, dtype=DType.int64, device=logits.device)
            logits = F.where(ids < self.config.usable_vocab_size, logits, float("-inf"))
        return logits

    def forward(
        self,
        tokens: Tensor,
        position_ids: Tensor,
        return_n_logits: Tensor,
        input_row_offsets: Tensor,
        *kv_inputs: Tensor,
    ) -> ModuleV3Outputs:
        per_device = self.config.kv_params.unflatten_kv_inputs(
            iter(graph_value(x) for x in kv_inputs)
        )
        (kv_collection,) = tree.leaves(per_device, leaf=KVCacheInputsPerDevice)

        h = self.wte(tokens) + self.wpe(position_ids)
        for block in self.h:
            h = block(h, kv_collection, input_row_offsets)

        next_token_logits = self.logits(
            F.gather(h, last_rows(input_row_offsets, return_n_logits, self.drafts), axis=0)
        )

        mode = self.config.return_logits
        if mode == ReturnLogits.ALL:
            return ModuleV3Outputs(
                next_token_logits=next_token_logits,
                logits=self.logits(h),
                logit_offsets=input_row_offsets,
            )
        return ModuleV3Outputs(next_token_logits=next_token_logits)
