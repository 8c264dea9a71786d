"""Times MAX's per-step functions inside a running `max serve`, for `bench_step.py --serve`.

A served decode step runs in MAX's model worker, a process the benchmark does not
own, so the benchmark starts the server with `PYTHONPATH` holding a folder
(`server_env`) whose `sitecustomize.py` calls `arm()` in every
process of the server. `arm` wraps each function in `PARTS` with a timer as
soon as its module is imported, in whichever process imports it; the model
worker, the one process running scheduler iterations, writes its running totals
into the folder when the benchmark asks (`request_totals`), so the benchmark
takes the difference over the one request it measures.

The functions are MAX's, not this package's, so the same table is taken for any
architecture, MAX's own Llama included (`bench_step.py --floor`).
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PARTS: dict[str, tuple[str, str]] = {
    "scheduler iteration": (
        "max.serve.scheduler.text_generation_scheduler",
        "TokenGenerationScheduler.run_iteration",
    ),
    "pipeline.execute": (
        "max.pipelines.lib.pipeline_variants.text_generation", "TextGenerationPipeline.execute"
    ),
    "model graph": (
        "max.pipelines.lib.pipeline_variants.text_generation",
        "TextGenerationPipeline._launch_forward_pass",
    ),
    "prepare_batch": (
        "max.pipelines.lib.pipeline_variants.text_generation",
        "TextGenerationPipeline.prepare_batch",
    ),
    "sampler setup": (
        "max.pipelines.sampling.sampling_logits_processor", "FusedSamplingProcessor.__init__"
    ),
    "sampler": (
        "max.pipelines.sampling.sampling_logits_processor", "FusedSamplingProcessor.__call__"
    ),
    "batch metrics": ("max.serve.scheduler.utils", "SchedulerLogger.log_metrics"),
    "requests drained": (
        "max.serve.scheduler.text_generation_scheduler",
        "TokenGenerationScheduler._retrieve_pending_requests",
    ),
    "batch construction": (
        "max.serve.scheduler.batch_constructor.text_batch_constructor",
        "TextBatchConstructor.construct_batch",
    ),
    "requests advanced": (
        "max.serve.scheduler.batch_constructor.text_batch_constructor",
        "TextBatchConstructor.advance_requests",
    ),
    "response pushed": ("max.serve.worker_interface._zmq_queue", "ZmqPushSocket.put_nowait"),
}
"""Each timed part: the module MAX defines it in and its qualified name there."""

PIPELINE_PARTS = ("model graph", "prepare_batch", "sampler setup", "sampler")
"""The parts MAX's `pipeline.execute` calls."""
SCHEDULER_PARTS = (
    "requests drained", "batch construction", "requests advanced", "response pushed",
    "batch metrics",
)
"""The parts MAX's scheduler iteration calls beside `pipeline.execute`."""

FOLDER_ENV = "GPT2_MAX_WORKER_PROBE"
"""Where the totals go; `arm` does nothing in a process without it."""

BATCHES = ("decode batches", "prefill batches")
"""Each `pipeline.execute` is also booked by its batch's kind, decode (every row one
new token) or prefill (a prompt or its chunk in it, decoding rows beside it or not):
`[seconds, calls, rows, tokens in, tokens out]`, where tokens out counts every token
the step's outputs carry (a decode burst's included)."""

WINDOW = "active window"
"""The wall-clock times (`time.time`) the first `pipeline.execute` since the last read
of the totals began and the latest ended: the span a read's totals were taken in."""

REQUEST, TOTALS = "request", "totals.json"
"""The benchmark's request for the totals, and the worker's answer, in that folder."""
ANSWERED_AFTER = "scheduler iteration"
BATCHED = "pipeline.execute"
"""The part whose calls are also booked by batch kind (`BATCHES`)."""
"""The part after which a pending request is answered: only the model worker runs it."""

SITECUSTOMIZE = "import worker_probe\nworker_probe.arm()\n"


def missing_parts() -> list[str]:
    """The parts of `PARTS` this MAX release lacks (a renamed function would leave the
    worker's probe unarmed): checked in the benchmark's process before a server starts."""
    missing = []
    for name, (module, qualname) in PARTS.items():
        owner, attribute = qualname.split(".")
        if not hasattr(getattr(importlib.import_module(module), owner, None), attribute):
            missing.append(f"{name} ({module}.{qualname})")
    return missing


def server_env(folder: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` for a server whose processes arm the probe: writes the `sitecustomize.py`
    that does it into `folder`, and puts `folder` and this module's own ahead of any
    `PYTHONPATH` in `env` or in this process's environment."""
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    rest = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    path = [str(folder), str(Path(__file__).parent), rest]
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in path if p), FOLDER_ENV: str(folder)}


def arm() -> None:
    """Wraps every part of `PARTS` once its module is imported in this process."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder:
        return
    request, totals_file = Path(folder) / REQUEST, Path(folder) / TOTALS
    totals: dict[str, list[float]] = {name: [0.0, 0] for name in PARTS}
    totals.update({name: [0.0, 0, 0, 0, 0] for name in BATCHES})
    totals[WINDOW] = [0.0, 0.0]
    pending = dict(PARTS)
    original_import = builtins.__import__

    def answer() -> None:
        """Writes the totals if the benchmark asked for them since the last iteration.
        Runs inside MAX's scheduler loop, so a file error is dropped, never raised
        into the server (the benchmark then times out, naming the folder)."""
        try:
            if request.exists():
                staged = totals_file.with_suffix(".tmp")
                staged.write_text(json.dumps(totals))
                staged.replace(totals_file)
                request.unlink(missing_ok=True)
                totals[WINDOW] = [0.0, 0.0]
        except OSError:
            pass

    def wrap(name: str, module: str, qualname: str) -> None:
        owner_name, attribute = qualname.split(".")
        owner = getattr(sys.modules[module], owner_name)
        function = getattr(owner, attribute)
        total = totals[name]

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start
                total[1] += 1
                if name == ANSWERED_AFTER:
                    answer()

        def booked(self: Any, inputs: Any) -> Any:
            """`pipeline.execute`, timed as a part and booked by its batch's kind."""
            rows, tokens_in = len(inputs.flat_batch), inputs.input_tokens
            start = time.perf_counter()
            window = totals[WINDOW]
            window[0] = window[0] or time.time()
            outputs = timed(self, inputs)
            window[1] = time.time()
            batch = totals[BATCHES[0] if tokens_in == rows else BATCHES[1]]
            for i, value in enumerate((time.perf_counter() - start, 1, rows, tokens_in,
                                       sum(len(o.tokens) for o in outputs.values()))):
                batch[i] += value
            return outputs

        if name == BATCHED:
            setattr(owner, attribute, booked)
            return

        setattr(owner, attribute, timed)

    def importing(*args: Any, **kwargs: Any) -> Any:
        module = original_import(*args, **kwargs)
        for name, (owner_module, qualname) in list(pending.items()):
            if hasattr(sys.modules.get(owner_module), qualname.split(".")[0]):
                wrap(name, owner_module, qualname)
                del pending[name]
        if not pending:
            builtins.__import__ = original_import
        return module

    builtins.__import__ = importing


def request_totals(folder: Path, timeout_s: float = 10.0) -> dict[str, list[float]]:
    """The model worker's running totals as of its next scheduler iteration (MAX's
    worker loop runs one every few milliseconds even when idle): `[seconds, calls]`
    per part."""
    request, totals_file = folder / REQUEST, folder / TOTALS
    totals_file.unlink(missing_ok=True)
    request.touch()
    deadline = time.monotonic() + timeout_s
    while request.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the model worker answered no request for its totals ({folder})")
        time.sleep(0.002)
    return json.loads(totals_file.read_text())


def per_token(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, float]:
    """Milliseconds of each part between two `request_totals`, per token the steps made:
    a pass of MAX's loop that runs a decode burst makes several, so a part per call
    (per pass) would not add up with the time a token takes."""
    tokens = sum(after[batch][4] - before[batch][4] for batch in BATCHES)
    if tokens == 0:
        raise RuntimeError(
            "the model worker ran no TextGenerationPipeline.execute between the two reads "
            "(another pipeline class, such as MAX's overlap pipeline?)"
        )
    return {name: (after[name][0] - before[name][0]) / tokens * 1e3 for name in PARTS}
