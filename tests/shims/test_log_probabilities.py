"""`LazyLogProbabilities` leans on how MAX's `LogProbabilitiesMixin` is built.

These fail, by name, on a MAX release whose mixin compiles or reads its graph
otherwise: the place to look is `gpt2_max/shims/log_probabilities.py`. That the
log-probabilities themselves still match transformers is tested through the
generator and the server (`tests/generate`, `tests/test_serve.py`).
"""

from __future__ import annotations

import inspect

import pytest
from max.pipelines.lib.log_probabilities import LogProbabilitiesMixin

from gpt2_max.model import GPT2PipelineModel
from gpt2_max.shims.log_probabilities import LazyLogProbabilities

pytestmark = pytest.mark.tier("unit")


def test_the_mixin_compiles_in_its_init_and_sets_only_the_device_and_the_model() -> None:
    source = inspect.getsource(LogProbabilitiesMixin.__init__)
    assert "session.load(" in source
    assigned = {line.split("=")[0].strip() for line in source.splitlines() if " = " in line}
    assert {a for a in assigned if a.startswith("self.")} == {
        "self._logprobs_device",
        "self._logprobs_model",
    }


def test_the_mixin_reads_the_graph_and_device_it_would_have_built() -> None:
    source = inspect.getsource(LogProbabilitiesMixin.compute_log_probabilities)
    assert "self._logprobs_model" in source and "self._logprobs_device" in source


def test_the_pipeline_model_skips_only_the_mixins_init() -> None:
    mro = GPT2PipelineModel.__mro__
    mixin = mro.index(LogProbabilitiesMixin)
    assert mro[mixin - 1] is LazyLogProbabilities
    # What `super(LogProbabilitiesMixin, self).__init__` reaches: MAX's pipeline model.
    following = next(c for c in mro[mixin + 1 :] if "__init__" in vars(c))
    assert following.__module__ == "max.pipelines.lib.interfaces.pipeline_model", following
