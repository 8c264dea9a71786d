"""Truncated or cut GGUF files are refused by name, before MAX's reader maps them."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import pytest
from transformers import GPT2Config

from gpt2_max.gguf.extent import tensor_extents
from gpt2_max.tokenizer import TOKENIZER_DIR
from gpt2_max.tools.checkpoint import random_hub_state_dict
from gpt2_max.tools.gguf_writer import write_gguf
from gpt2_max.weights.files import IncompleteCheckpointError
from gpt2_max.weights.formats import check_complete

pytestmark = pytest.mark.tier("unit")

SMALL = GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=8, vocab_size=512)


@pytest.fixture(scope="module", params=["f32", "q4_k_m"])
def whole(request, tmp_path_factory) -> Path:
    """A complete GGUF: float, or block-quantized with mixed block types."""
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    return write_gguf(path, SMALL, random_hub_state_dict(SMALL), request.param, TOKENIZER_DIR)


def cut(whole: Path, keep: int, tmp_path: Path) -> Path:
    path = tmp_path / whole.name
    path.write_bytes(whole.read_bytes()[:keep])
    return path


def test_extents_are_where_the_gguf_reader_puts_the_tensors(whole):
    reader = gguf.GGUFReader(whole)
    extents = {e.name: e for e in tensor_extents(whole.read_bytes())}
    assert sorted(extents) == sorted(t.name for t in reader.tensors)
    for tensor in reader.tensors:
        extent = extents[tensor.name]
        assert extent.start == tensor.data_offset, tensor.name  # from the file's start
        assert extent.end - extent.start == tensor.n_bytes, tensor.name
    check_complete([whole])


def test_truncated_file_names_the_tensor_past_the_end(whole, tmp_path):
    reader = gguf.GGUFReader(whole)
    # 60% of the tensor data kept (the tokenizer makes most of the header).
    size = reader.data_offset + (whole.stat().st_size - reader.data_offset) * 6 // 10
    path = cut(whole, size, tmp_path)
    first = min(
        (t for t in reader.tensors if t.data_offset + t.n_bytes > size),
        key=lambda t: t.data_offset,
    )
    with pytest.raises(IncompleteCheckpointError) as refused:
        check_complete([path])
    message = str(refused.value)
    assert message.startswith(f"m.gguf is truncated: tensor '{first.name}' occupies bytes ")
    assert f"the file has {size} bytes" in message
    assert f"its header describes {whole.stat().st_size} bytes" in message


def test_file_cut_inside_its_header_is_refused(whole, tmp_path):
    header_end = gguf.GGUFReader(whole).data_offset
    path = cut(whole, header_end // 2, tmp_path)
    message = f"m.gguf is truncated: the header is cut at byte {header_end // 2}"
    with pytest.raises(IncompleteCheckpointError, match=re.escape(message)):
        check_complete([path])


@pytest.mark.parametrize("keep", [0, 3])
def test_file_without_a_header_is_refused(whole, tmp_path, keep):
    with pytest.raises(IncompleteCheckpointError, match="m.gguf (is empty|has no readable GGUF)"):
        check_complete([cut(whole, keep, tmp_path)])


def test_a_string_that_is_not_utf8_is_refused_naming_the_file_and_byte(whole, tmp_path):
    """GGUF's strings are UTF-8; the first key starts at byte 32 (after magic, version,
    the two counts and its length). A reader that decodes it later would fail naming
    neither the file nor the byte."""
    content = bytearray(whole.read_bytes())
    content[32] = 0xFF
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(content))
    with pytest.raises(IncompleteCheckpointError, match="m.gguf has no readable GGUF header "
                       r"\(the string at byte 32 is not UTF-8"):
        check_complete([path])
