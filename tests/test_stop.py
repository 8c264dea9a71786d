"""The stop-string rule against a brute-force reading of the OpenAI semantics."""

import random

import pytest

from gpt2_max.stop import StopScanner, cut_at_stop
from gpt2_max.testing.reference import stopped_text

pytestmark = pytest.mark.tier("unit")


def test_cut_and_stream_agree_with_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 4))]
        want = stopped_text(text, stops)
        assert cut_at_stop(text, stops) == want
        scanner, out, i = StopScanner(stops), "", 0
        while i < len(text):
            step = rng.randint(1, 4)
            out += scanner.feed(text[i : i + step])
            i += step
            if not scanner.stopped:  # all released but the tail a stop could complete
                fed = text[:i]
                tail = max(
                    (n for s in stops for n in range(1, len(s)) if fed.endswith(s[:n])),
                    default=0,
                )
                assert len(out) == len(fed) - tail, (fed, stops)
        out += scanner.flush()
        assert (out, scanner.stopped) == want, (text, stops)
