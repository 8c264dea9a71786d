"""The GPT-2 network in MAX's ModuleV3 API, over a paged KV cache.

The module tree mirrors the Hugging Face checkpoint (`wte`, `wpe`, `h.{i}.attn.c_attn`,
`h.{i}.mlp.c_fc`, `ln_f`, ...), so weights load under their own names; the one
layout difference, Conv1D's `[in, out]` weights, is undone in `weights/`.

A batch is ragged: the active tokens of every sequence are concatenated into one
`[total_tokens]` stream and `input_row_offsets[b] : input_row_offsets[b + 1]` is
sequence `b`'s slice. Each step embeds only those tokens, writes their keys and
values into the cache and attends over everything cached for the sequence.
"""

from __future__ import annotations

from collections.abc import Callable

from max import tree
from max.driver import CPU
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.norm import LayerNorm
from max.experimental.nn.sequential import ModuleList
from max.experimental.tensor import Tensor
from max.nn import kernels
from max.nn.kv_cache import KVCacheInputsPerDevice, PagedCacheValues
from max.nn.transformer import ReturnLogits
from max.pipelines.lib import ModuleV3Outputs

from .layers import Layers
from .model_config import GPT2ArchConfig
from .shims.internals import graph_value

# Write one layer's new keys / values (`[tokens, heads, head_dim]`) into the paged cache.
store_k_cache_ragged = F.functional(kernels.store_k_cache_ragged)
store_v_cache_ragged = F.functional(kernels.store_v_cache_ragged)

ACTIVATION_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * F.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "tanh": F.tanh,
    "sigmoid": F.sigmoid,
    "linear": lambda x: x,
}
"""The MLP nonlinearity by the canonical name `model_config.ACTIVATIONS` maps to."""


def activation(name: str, x: Tensor) -> Tensor:
    """The MLP nonlinearity `name` applied to `x`, as transformers computes it."""
    return ACTIVATION_FUNCTIONS[name](x)


def layer_norm(config: GPT2ArchConfig) -> LayerNorm:
    """A LayerNorm over the hidden size whose mean and variance are reduced in
    float32 whatever the graph's dtype, as MAX's own architectures normalize in
    bfloat16 (in a float32 graph that is the plain LayerNorm)."""
    return LayerNorm(
        config.hidden_size,
        eps=config.layer_norm_epsilon,
        keep_dtype=config.dtype == DType.float32,
    )


class GPT2Attention(Module[..., Tensor]):
    """Causal multi-head self-attention over the paged KV cache."""

    def __init__(self, config: GPT2ArchConfig, layers: Layers, layer_idx: int) -> None:
        self.layers = layers
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale(layer_idx)
        prefix = f"h.{layer_idx}.attn"
        self.c_attn = layers.linear(f"{prefix}.c_attn", config.hidden_size, 3 * config.hidden_size)
        self.c_proj = layers.linear(f"{prefix}.c_proj", config.hidden_size, config.hidden_size)

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> Tensor:
        layer_idx = F.constant(self.layer_idx, DType.uint32, device=CPU())
        heads = [-1, self.num_heads, self.head_dim]
        q, k, v = F.split(self.c_attn(x), [self.num_heads * self.head_dim] * 3, axis=1)
        store_k_cache_ragged(kv_collection, k.reshape(heads), input_row_offsets, layer_idx)
        store_v_cache_ragged(kv_collection, v.reshape(heads), input_row_offsets, layer_idx)
        attn = self.layers.attention(
            q.reshape(heads), input_row_offsets, kv_collection, layer_idx, self.scale
        )
        return self.c_proj(attn.reshape([-1, self.num_heads * self.head_dim]))


class GPT2MLP(Module[[Tensor], Tensor]):
    """Position-wise feed-forward: `c_proj(act(c_fc(x)))`."""

    def __init__(self, config: GPT2ArchConfig, layers: Layers, layer_idx: int) -> None:
        self.activation = config.activation
        prefix = f"h.{layer_idx}.mlp"
        self.c_fc = layers.linear(f"{prefix}.c_fc", config.hidden_size, config.feed_forward_size)
        inner, hidden = config.feed_forward_size, config.hidden_size
        self.c_proj = layers.linear(f"{prefix}.c_proj", inner, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(activation(self.activation, self.c_fc(x)))


class GPT2Block(Module[..., Tensor]):
    """Pre-LayerNorm transformer block with residual connections."""

    def __init__(self, config: GPT2ArchConfig, layers: Layers, layer_idx: int) -> None:
        self.layers = layers
        self.ln_1 = layer_norm(config)
        self.attn = GPT2Attention(config, layers, layer_idx)
        self.ln_2 = layer_norm(config)
        self.mlp = GPT2MLP(config, layers, layer_idx)

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> Tensor:
        # The layers may run the whole block as one op (`Layers.block`).
        return self.layers.block(self, x, kv_collection, input_row_offsets)

    def composed(
        self, x: Tensor, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> Tensor:
        """The block from its modules: the definition `Layers.block` must compute."""
        x = x + self.attn(self.ln_1(x), kv_collection, input_row_offsets)
        return x + self.mlp(self.ln_2(x))


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
        self.h = ModuleList([GPT2Block(config, layers, i) for i in range(config.num_layers)])
        self.ln_f = layer_norm(config)
        # A tied head multiplies `wte` in place (`[vocab, hidden]`, no copy);
        # otherwise the head has its own weight.
        self.lm_head = (
            None
            if config.head_reads_wte
            else layers.linear("lm_head", config.hidden_size, config.head_rows, bias=False)
        )

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

        last_rows = input_row_offsets[1:] - 1
        next_token_logits = self.logits(F.gather(h, last_rows, axis=0))

        mode = self.config.return_logits
        if mode == ReturnLogits.ALL:
            return ModuleV3Outputs(
                next_token_logits=next_token_logits,
                logits=self.logits(h),
                logit_offsets=input_row_offsets,
            )
        return ModuleV3Outputs(next_token_logits=next_token_logits)
