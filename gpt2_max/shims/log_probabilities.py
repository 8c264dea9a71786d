"""MAX's log-probabilities for this architecture, compiled when first asked for.

`LogProbabilitiesMixin.__init__` (MAX 26.7) compiles its log-probabilities
graph at every start, in the model worker, whether or not any request will
ask for log-probabilities: the longest step of a cold start after the model's
and the sampler's compiles, and the one step MAX's own Llama does not take
(`benchmarks/bench_start.py`, phase "after"). `LazyLogProbabilities` is that
mixin with the compile moved to its first use: it skips the mixin's
`__init__` and builds the same graph (MAX's `log_probabilities_ragged_graph`,
MAX's heap depth) on the first `compute_log_probabilities`, which reads
`_logprobs_model`. The mixin's `compute_log_probabilities` is used as it is.
"""

from __future__ import annotations

import functools
from typing import Any

from max.engine import InferenceSession, Model
from max.graph import DeviceRef
from max.pipelines.lib.log_probabilities import (
    LogProbabilitiesMixin,
    log_probabilities_ragged_graph,
)


class LazyLogProbabilities(LogProbabilitiesMixin):
    """`LogProbabilitiesMixin`, its graph compiled by the first request that asks."""

    def __init__(self, pipeline_config: Any, session: InferenceSession, *args: Any, **kwargs: Any):
        # The classes after the mixin (the pipeline model) initialise as usual;
        # the mixin's own `__init__`, which would compile now, is skipped.
        super(LogProbabilitiesMixin, self).__init__(pipeline_config, session, *args, **kwargs)
        self._logprobs_session = session
        self._logprobs_device = self.devices[0]

    @functools.cached_property
    def _logprobs_model(self) -> Model:
        from max.pipelines.lib.log_probabilities import _LOGPROBS_HEAP_LEVELS

        graph = log_probabilities_ragged_graph(
            DeviceRef.from_device(self._logprobs_device), levels=_LOGPROBS_HEAP_LEVELS
        )
        return self._logprobs_session.load(graph)
