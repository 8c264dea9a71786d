"""In-process: the `Generator` decodes with a draft, and its greedy tokens are the model's.

Settings are read once a process, so the generator that drafts runs in a process of its
own (`GPT2_MAX_DRAFT=q8_0`, a round every pass); its tokens are checked against
transformers' greedy ones, a stop string ends a row at the token that completes it, and
its log says drafted tokens were kept.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpt2_max.settings import setting
from gpt2_max.testing.reference import hf_greedy, random_prompt
from gpt2_max.testing.server import child_env

pytestmark = pytest.mark.tier("model")

NEW_TOKENS = 40

SCRIPT = """
import json, logging, sys
from gpt2_max import Generator
logging.basicConfig(level=logging.INFO)
prompts, stop = json.loads(sys.argv[2])
with Generator(sys.argv[1], device="cpu", max_batch_size=4) as generator:
    alone = [generator.generate(p, {n}, ignore_eos=True).token_ids for p in prompts]
    together = [r.token_ids for r in generator.generate_batch(prompts, {n}, ignore_eos=True)]
    stopped = generator.generate(prompts[0], {n}, ignore_eos=True, stop=[stop])
print(json.dumps([alone, together, stopped.token_ids, stopped.finish_reason]))
"""


def test_the_generator_drafts_and_keeps_the_models_tokens(checkpoints, hf_models, generator):
    prompts = [random_prompt(n, seed=60 + n) for n in (4, 23, 70)]
    expected = [hf_greedy(hf_models("default"), p, NEW_TOKENS)[0] for p in prompts]
    text = generator.decode(expected[0])
    stop = text[len(text) // 2:][:3]
    env = child_env(**{setting("draft").variable: "q8_0", setting("draft_pace").variable: "0"})
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(n=NEW_TOKENS),
         str(checkpoints("default", "hub")), json.dumps([prompts, stop])],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    alone, together, stopped, reason = json.loads(done.stdout.splitlines()[-1])
    assert alone == expected
    assert together == expected
    ends = next(n for n in range(NEW_TOKENS) if stop in generator.decode(expected[0][:n]))
    assert (stopped, reason) == (expected[0][:ends], "stop")
    assert "the model keeps what it would have chosen" in done.stderr
    assert "drafted tokens kept" in done.stderr
