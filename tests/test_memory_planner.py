"""How much of the memory left the KV cache takes when a room takes some beside it, and
what the plain layers' weights take beyond their files."""

from __future__ import annotations

import gguf
import pytest
from max.dtype import DType
from max.graph import DeviceRef
from transformers import GPT2Config

from gpt2_max.extensions import Beside
from gpt2_max.layers import LAYERS_ENV
from gpt2_max.memory_planner import cache_share, held_excess
from gpt2_max.settings import settings as package_settings
from gpt2_max.tokenizer import TOKENIZER_DIR
from gpt2_max.tools.checkpoint import random_hub_state_dict
from gpt2_max.tools.gguf_writer import write_gguf
from tests.test_model_config import max_config

pytestmark = pytest.mark.tier("unit")


def test_with_nothing_beside_it_the_cache_may_take_all_that_is_left():
    assert cache_share(10_000, 100, Beside()) == 10_000


@pytest.mark.parametrize("beside", [Beside(1_050, 50), Beside(0, 100), Beside(9_000, 1)])
def test_the_cache_takes_the_most_whole_pages_that_leave_the_room_its_share(beside):
    share = cache_share(10_000, 100, beside)
    pages, rest = divmod(share, 100)
    assert rest == 0
    used = beside.fixed + pages * (100 + beside.per_page)
    assert used <= 10_000 < used + 100 + beside.per_page


def test_a_room_larger_than_what_is_left_leaves_the_cache_nothing():
    assert cache_share(10_000, 100, Beside(20_000, 10)) == 0


def gpt2_values(hf: GPT2Config) -> int:
    """GPT-2's parameter count, tied: the tables, the final norm, 12h² + 13h a block."""
    h = hf.n_embd
    return (hf.vocab_size + hf.n_positions) * h + 2 * h + hf.n_layer * (12 * h * h + 13 * h)


def unasked() -> int:
    raise AssertionError("the files' size was asked for where nothing is reserved")


def test_plain_layers_reserve_what_their_weights_take_beyond_the_files(monkeypatch):
    hf = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=300)
    shape = dict(vocab_size=300, usable_vocab_size=300, hidden_size=64)
    gpu = max_config(devices=[DeviceRef.GPU()], dtype=DType.bfloat16, **shape)
    held = (gpt2_values(hf) + (gpu.head_rows - 300) * 64) * 2  # the padded head's rows
    assert gpu.head_rows == 512
    gguf = ["m-q4_k_m.gguf"]
    assert held_excess(gpu, hf, gguf, lambda: 1000) == held - 1000  # blocks, dequantized
    assert held_excess(gpu, hf, ST, lambda: 10**9) == 0  # a float32 file cast down
    cpu = max_config(**shape)
    monkeypatch.setenv(LAYERS_ENV, "plain")
    package_settings.cache_clear()
    assert held_excess(cpu, hf, gguf, lambda: 1000) == gpt2_values(hf) * 4 - 1000


ST = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_the_fast_layers_reserve_a_half_precision_safetensors_widened():
    """The safetensors adapter widens every tensor to float32: a checkpoint saved in
    float16 or bfloat16 takes twice its files' bytes on the CPU."""
    hf = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=300)
    cpu = max_config(vocab_size=300, usable_vocab_size=300, hidden_size=64)
    half = gpt2_values(hf) * 2
    assert held_excess(cpu, hf, ST, lambda: half) == half
    assert held_excess(cpu, hf, ST, lambda: gpt2_values(hf) * 4) == 0  # saved in float32
    assert held_excess(cpu, hf, [*ST, "m.gguf"], unasked) == 0


@pytest.mark.parametrize("tied", [True, False])
def test_the_fast_layers_reserve_a_packed_gguf_s_token_table_in_float32(tmp_path, tied):
    """The fast layers multiply a Q8_0 GGUF's blocks as the file holds them, and gather
    the token table's rows from a float32 copy (beside the blocks a tied head reads)."""
    hf = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=300,
        tie_word_embeddings=tied,
    )
    cpu = max_config(vocab_size=300, usable_vocab_size=300, hidden_size=64)
    path = write_gguf(
        tmp_path / "m.gguf", hf, random_hub_state_dict(hf, seed=1), "q8_0", TOKENIZER_DIR
    )
    tensors = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    table, blocks = 300 * 64 * 4, 300 * 64 // 32 * 34  # Q8_0: 34 bytes a 32 values
    expected = table if tied else table - blocks  # untied: the table's blocks are not kept
    assert held_excess(cpu, hf, [path], lambda: tensors) == expected