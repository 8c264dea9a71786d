"""The README's example test of the `gpt2_max` pytest plugin, verbatim."""

import pytest

from gpt2_max.testing.load import GREEDY

pytestmark = pytest.mark.tier("serve")


def test_my_client_gets_the_exact_greedy_tokens(gpt2_max_server):
    prompt = [15496, 995, 11, 616, 1438, 318]
    response = gpt2_max_server.client.completions.create(
        model=gpt2_max_server.model, prompt=prompt, max_tokens=8, logprobs=1, **GREEDY
    )
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == gpt2_max_server.reference.greedy(prompt, 8)
    expected = gpt2_max_server.reference.greedy_logprobs(prompt, 8)
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
