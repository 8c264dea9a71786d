"""The in-process generator against Hugging Face transformers, and its request handling.

One generator (session fixture) serves every test; prompts are random token ids
or short texts, and greedy tokens are compared token for token with
transformers' own cached decode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpt2_max.settings import CPU_DECODE_STEPS
from gpt2_max.stop import cut_at_stop
from gpt2_max.testing.reference import hf_greedy, random_prompt

pytestmark = pytest.mark.tier("model")

NEW_TOKENS = 12


def hf_tokens(hf_models, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return hf_greedy(hf_models("default"), prompt, n)[0]


def test_generate_matches_transformers(generator, hf_models):
    for seed, length in enumerate((1, 7, 60)):
        prompt = random_prompt(length, seed=100 + seed)
        result = generator.generate(prompt, NEW_TOKENS, ignore_eos=True)
        assert result.token_ids == hf_tokens(hf_models, prompt)
        assert result.finish_reason == "length"
        assert result.text == generator.decode(result.token_ids)


def test_decode_runs_in_bursts_in_process(generator, hf_models):
    # The contexts are the ones `max serve`'s worker holds (`requests.as_served`), so a
    # decode pass runs up to `decode_steps` steps in-process too, with the same tokens.
    prompt = random_prompt(5, seed=7)
    before = generator.model_steps
    result = generator.generate(prompt, 40, ignore_eos=True)
    assert result.token_ids == hf_tokens(hf_models, prompt, 40)
    assert generator.model_steps - before < 20


def test_generate_batch_mixed_lengths_matches_transformers(generator, hf_models):
    # Ten prompts: more than max_batch_size, so two ragged groups.
    lengths = (1, 3, 17, 130, 9, 64, 2, 40, 5, 90)
    prompts = [random_prompt(n, seed=200 + i) for i, n in enumerate(lengths)]
    results = generator.generate_batch(prompts, NEW_TOKENS, ignore_eos=True)
    assert [r.prompt_tokens for r in results] == list(lengths)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_tokens(hf_models, prompt)


def test_stream_joins_to_generate_text(generator):
    prompt = "The tokenizer splits naïve café 👋 into bytes and"
    full = generator.generate(prompt, 40, ignore_eos=True)
    pieces = list(generator.stream(prompt, 40, ignore_eos=True))
    assert "".join(pieces) == full.text == generator.decode(full.token_ids)
    # A piece a step: a decode burst's tokens (up to `CPU_DECODE_STEPS` a step) come as one.
    assert len(pieces) >= 40 // CPU_DECODE_STEPS and all(pieces)


def test_stream_cancel_frees_the_row(generator, hf_models):
    prompt = random_prompt(20, seed=3)
    pieces = generator.stream(prompt, 200, ignore_eos=True)
    next(pieces)
    pieces.close()
    assert generator.generate(prompt, NEW_TOKENS, ignore_eos=True).token_ids == hf_tokens(
        hf_models, prompt
    )


def test_stop_strings_and_stop_tokens(generator):
    prompt = random_prompt(10, seed=4)
    full = generator.generate(prompt, 30, ignore_eos=True)
    stop = full.text[len(full.text) // 2 :][:3]
    stopped = generator.generate(prompt, 30, stop=[stop, "never-generated"])
    assert stopped.finish_reason == "stop"
    assert stopped.text == cut_at_stop(full.text, [stop])[0]
    # Its tokens end at the one that completes the stop, inside a decode burst too.
    tokens = full.token_ids
    ends = next(n for n in range(len(tokens)) if stop in generator.decode(tokens[:n]))
    assert stopped.token_ids == tokens[:ends]
    pieces = list(generator.stream(prompt, 30, stop=stop))
    assert "".join(pieces) == stopped.text
    stop_token = full.token_ids[5]
    by_token = generator.generate(prompt, 30, stop_token_ids=[stop_token])
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    assert by_token.finish_reason == "stop"


@pytest.mark.parametrize("options", [
    dict(temperature=1.0, top_k=50, top_p=0.95),  # MAX's sampler
    dict(temperature=0.9),  # plain rows: gpt2_max.sampler's
], ids=["top-k-top-p", "temperature"])
def test_sampling_is_seeded(generator, options):
    prompt = "Seeded sampling"
    first = generator.generate(prompt, 24, seed=7, ignore_eos=True, **options)
    again = generator.generate(prompt, 24, seed=7, ignore_eos=True, **options)
    other = generator.generate(prompt, 24, seed=8, ignore_eos=True, **options)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


def test_min_p_1_leaves_the_largest_logit(generator):
    """MAX 26.7's CPU kernel drew as if min_p were 0 (`shims.min_p`), in-process too."""
    prompt = "Seeded sampling"
    greedy = generator.generate(prompt, 12, ignore_eos=True).token_ids
    drawn = lambda **o: generator.generate(  # noqa: E731
        prompt, 12, seed=7, temperature=1.0, ignore_eos=True, **o).token_ids
    assert drawn() != greedy
    assert drawn(min_p=1.0) == drawn(min_p=1.0, top_k=20) == greedy


def test_logprobs_match_transformers(generator, hf_models):
    prompt = random_prompt(15, seed=5)
    result = generator.generate(prompt, NEW_TOKENS, ignore_eos=True, logprobs=2)
    tokens, logits = hf_greedy(hf_models("default"), prompt, NEW_TOKENS)
    expected = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    assert result.token_ids == tokens
    np.testing.assert_allclose(
        result.logprobs, expected[np.arange(NEW_TOKENS), tokens].numpy(), atol=1e-4, rtol=0
    )
    assert all(len(top) >= 2 for top in result.top_logprobs)


def test_branches_share_one_prefill(generator, hf_models):
    prompt = random_prompt(300, seed=6)
    page = generator.page_size
    shared = (len(prompt) - 1) // page * page
    before = generator.model_steps
    greedy = generator.branches(prompt, 3, NEW_TOKENS, ignore_eos=True)
    # One prefill step, then batched steps advancing all branches (decode bursts carry
    # several tokens out of one).
    assert 1 < generator.model_steps - before <= 1 + NEW_TOKENS
    # Every branch found the prompt's full pages cached by the single prefill ...
    assert [b.cached_tokens for b in greedy] == [shared] * 3 and shared >= 256
    # ... and the shared pages hold exactly what a prefill of its own computes.
    assert all(b.token_ids == hf_tokens(hf_models, prompt) for b in greedy)
    sampled = generator.branches(prompt, 4, 16, temperature=1.0, seed=11, ignore_eos=True)
    assert [b.cached_tokens for b in sampled] == [shared] * 4
    assert len({tuple(b.token_ids) for b in sampled}) == 4
    again = generator.branches(prompt, 4, 16, temperature=1.0, seed=11, ignore_eos=True)
    assert [b.token_ids for b in again] == [b.token_ids for b in sampled]


def test_best_of_ranks_by_cumulative_logprob(generator):
    best = generator.branches("Rank me", 2, 8, best_of=5, temperature=1.0, ignore_eos=True)
    everyone = generator.branches("Rank me", 5, 8, temperature=1.0, ignore_eos=True, logprobs=1)
    ranked = sorted((b.cumulative_logprob for b in everyone), reverse=True)
    assert [b.cumulative_logprob for b in best] == pytest.approx(ranked[:2])


def test_numpy_numbers_are_taken_as_python_ones(generator):
    """MAX's message encoder, which a row's context passes through, recursed on numpy's
    numbers (a bare `RecursionError`)."""
    prompt = random_prompt(8, seed=4)
    python = generator.generate(prompt, 6, temperature=0.7, top_k=20, seed=3, logprobs=2,
                                stop_token_ids=[13])
    numpy = generator.generate(prompt, np.int64(6), temperature=np.float64(0.7),
                               top_k=np.int64(20), seed=np.int64(3), logprobs=np.int32(2),
                               stop_token_ids=np.array([13]))
    assert numpy.token_ids == python.token_ids
    assert numpy.logprobs == python.logprobs


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda g: g.generate(""), ValueError),
        (lambda g: g.generate([]), ValueError),
        (lambda g: g.stream(""), ValueError),
        (lambda g: g.generate(random_prompt(g.window + 10, seed=1)), ValueError),
        (lambda g: g.generate("hi", tempreature=0.5), TypeError),
        (lambda g: g.generate("hi", json_schema='{"type": "object", '), ValueError),
        (lambda g: g.generate("hi", json_schema={"type": "integer", "minimum": 5,
                                                 "maximum": 3}), ValueError),
        (lambda g: g.generate("hi", regex="(unclosed"), ValueError),
        (lambda g: g.generate("hi", grammar="start: undefined_rule"), ValueError),
        (lambda g: g.generate("hi", grammar='start: x\nx: "a" x'), ValueError),
        (lambda g: g.generate("hi", regex="a", grammar='start: "a"'), ValueError),
        (lambda g: g.generate("hi", json_object=True, json_schema={}), ValueError),
        (lambda g: g.generate("hi", regex="a", grammar_engine="xgrammar"), ValueError),
        (lambda g: g.generate("hi", json_schema={"type": "string", "pattern": "(("},
                              grammar_engine="xgrammar"), ValueError),
        (lambda g: g.generate("hi", json_object=True, grammar_engine="xgrammr"), ValueError),
        (lambda g: g.generate("hi", max_new_tokens=0), ValueError),
        (lambda g: g.generate("hi", temperature=1.0, top_p=float("nan")), ValueError),
        (lambda g: g.generate("hi", temperature=1.0, min_p=1.5), ValueError),
        (lambda g: g.generate("hi", temperature=1.0, seed=2**64), ValueError),
        (lambda g: g.generate("hi", temperature=1.0, top_k=2**63), ValueError),
        (lambda g: g.generate("hi", logprobs=100), ValueError),
        (lambda g: g.generate("hi", logprobs=-1), ValueError),
        (lambda g: g.branches("hi", 3, best_of=2), ValueError),
        (lambda g: g.branches("hi", 1, best_of=2**40), ValueError),
        (lambda g: g.branches("hi", 1, best_of=0), ValueError),
        (lambda g: g.generate("hi", 2**64), ValueError),
        # Types MAX's schema would refuse unnamed, or read as something else.
        (lambda g: g.generate("hi", 1.5), TypeError),
        (lambda g: g.generate("hi", "3"), TypeError),
        (lambda g: g.generate([1.5, 2]), TypeError),
        (lambda g: g.generate(b"hi"), TypeError),
        (lambda g: g.generate([[1, 2]]), TypeError),
        (lambda g: g.generate(None), TypeError),
        (lambda g: g.generate_batch("hi"), TypeError),
        (lambda g: g.generate("hi", stop=5), TypeError),
        (lambda g: g.generate("hi", stop=[b"x"]), TypeError),
        (lambda g: g.generate("hi", stop_token_ids=[1.0]), TypeError),
        (lambda g: g.generate("hi", logprobs=True), TypeError),
        (lambda g: g.generate("hi", ignore_eos="yes"), TypeError),
        (lambda g: g.generate("hi", temperature="0.5"), TypeError),
        (lambda g: g.branches("hi", "3"), TypeError),
        (lambda g: g.generate("hi", stop=iter([5])), TypeError),
    ],
)
def test_bad_input_raises_and_generator_stays_usable(generator, hf_models, call, error):
    with pytest.raises(error) as raised:
        call(generator)
    assert str(raised.value)
    prompt = random_prompt(8, seed=9)
    assert generator.generate(prompt, 4, ignore_eos=True).token_ids == hf_tokens(
        hf_models, prompt, 4
    )
