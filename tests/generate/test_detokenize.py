"""Streaming text never splits a UTF-8 character and adds up to the full decode."""

import pytest
from transformers import AutoTokenizer

from gpt2_max.generate.detokenize import REPLACEMENT, IncrementalText
from gpt2_max.tokenizer import TOKENIZER_DIR

pytestmark = pytest.mark.tier("unit")


def test_pieces_are_whole_characters_and_join_to_the_text():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    text = "naïve café 👋🏽 日本語 — ok"
    tokens = tokenizer.encode(text)
    assert len(tokens) > len(text.split())  # characters really span tokens
    stream, pieces = IncrementalText(tokenizer.decode), []
    for end in range(1, len(tokens) + 1):
        pieces.append(stream.feed(tokens[:end]))
    pieces.append(stream.flush(tokens))
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "".join(pieces) == text
    assert sum(1 for piece in pieces if piece) > 5
