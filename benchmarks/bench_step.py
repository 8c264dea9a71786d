"""Where one decode step's time goes at batch 1, in-process (`gpt2_max.Generator`).

    PYTHONPATH=. python benchmarks/bench_step.py       # f32, q4_k_m; nothing else running
    PYTHONPATH=. python benchmarks/bench_step.py --types f16 --new-tokens 64

Each type is the GGUF of the random-weight checkpoint `bench_serve.py` caches
(same files as its llama.cpp rows). One request, 16-token prompt, greedy, new
tokens to the end; every decode step after the prefill is booked by wrapping
what MAX's pipeline calls per step (a pass of its loop runs a burst of steps,
`gpt2_max.bursts`: each part is its time over the decode, per model graph call):

  step              the decode's wall time per step (everything)
  model graph       the compiled model graph (`PipelineModel.model.execute_raw`)
  sampler graph     MAX's fused sampler graph
  prepare_batch     input building: token/offset tensors, KV cache inputs
  kv_manager.step   KV bookkeeping after the step
  pipeline, other   the rest of `pipeline.execute` (Python around the above)
  outside execute   `GenerateIterator` and `Generator` (detokenize, stop scan)

With `--serve`, the same file is also served by `max serve` (as `bench_serve.py` runs it)
and one streamed request (same prompt, greedy) is timed token by token. Inside the
model worker `worker_probe.py` times MAX's own per-step functions over the decode
steps: the scheduler's iteration, and within it the pipeline's `execute` with the
model graph, `prepare_batch` and the sampler, the request queues, batch
construction, the response push and the batch metrics, each per token made (a pass
of MAX's loop makes a decode burst's tokens). The CPU time each process of the
server takes over the decode is read with psutil. So the table shows what serving
adds to the in-process step, where in MAX's loop it goes, and what the API process
takes from the cores the worker's threads use.

With `--alternate ROUNDS`, the tables give way to one comparison: the GB/s of
weights each type of `--types` streams a decode step (its projection chain alone, its
model graph, its whole step), the types taken in turns round after round and each
against the first type's in the same round, since this machine's speed drifts
between minutes (issue 48's bandwidth row: `--types f32,q4_k_m`).

With `--floor`, MAX's own Llama architecture (`bench_start.py`'s small Llama) and
gpt2_max on a GPT-2 of the same shape are served the same way: no code of this
package runs the Llama's steps, so its table is what MAX's serving loop costs a
step on its own, the smallest MAX-only reproduction of the fixed cost.

    PYTHONPATH=. python benchmarks/bench_step.py --types '' --floor

MAX's sampler graph is also timed alone (`sampler alone`: MAX's `token_sampler`
for one row of the vocabulary, nothing of this package in it), the smallest
reproduction of that part of the step.

The model graph is then split by microbenchmarks of partial graphs on the same
weights: every projection of the model chained at one row (the matmuls, with
the bytes they stream and the GB/s that makes), MAX's LayerNorm / GELU /
residual ops the model runs, and an execute of a one-op graph (the fixed cost
of a graph call). The chain's weights sit in huge-page memory as the model's do.
For a float32 file the same chain also runs through torch's `F.linear` on the
same arrays and thread count, in a process of its own: a well-kept library's
matrix-vector product as the peer for the bandwidth the kernels reach. What the
model graph takes beyond those is attention, the K/V stores, embeddings and the
rest. MAX's profiling (`MODULAR_ENABLE_PROFILING`, `--kernel-trace-level`) emits
NVTX ranges for Nsight/libkineto, GPU tools that record nothing for CPU kernels,
hence partial graphs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import bench_start
import llama_cpp_tools
import numpy as np
import psutil
import streams
import worker_probe
from bench_serve import CHECKPOINTS, SERVE_ARGS, THREADS, gguf_file, serve
from bench_start import cpu_model
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops
from max.graph.weights import GGUFWeights
from max.pipelines.lib import SamplingConfig
from max.pipelines.sampling.sampling import token_sampler

from gpt2_max import kernels
from gpt2_max.cpu_runtime import threads
from gpt2_max.generate import Generator
from gpt2_max.gguf.adapter import convert_gguf_state_dict, huggingface_config, metadata
from gpt2_max.layers import qmatmul
from gpt2_max.layers.fast import FastLayers
from gpt2_max.layers.kernel_choice import uses_max_kernel
from gpt2_max.layers.quantized import repack
from gpt2_max.model_config import ACTIVATIONS
from gpt2_max.shims.internals import gguf_reader
from gpt2_max.testing.server import child_env
from gpt2_max.tools.checkpoint import preset_config, write_checkpoint
from gpt2_max.weights.hugepages import hugepage_array
from gpt2_max.weights.plan import WeightPlan, block_type
from gpt2_max.weights.schema import HEAD_WEIGHT

PROMPT = list(range(2000, 2016))


class Book:
    """Durations per name, one entry per call; and per entry of `pipeline.execute`, its
    time and how many calls of each name came before it."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.entries: list[tuple[float, dict[str, int]]] = []

    def enter(self) -> None:
        self.entries.append(
            (time.perf_counter(), {name: len(c) for name, c in self.calls.items()})
        )

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[name].append(time.perf_counter() - start)

        return timed


class TimedSampler:
    """MAX's sampler `Model`, its calls booked."""

    def __init__(self, model: Any, book: Book) -> None:
        self._model = model
        self._call = book.wrap("sampler graph", model)

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def step_accounting(path: Path, new_tokens: int) -> dict[str, float]:
    """Mean milliseconds per decode step of each part (see the module docstring)."""
    with Generator(path.parent, device="cpu", max_batch_size=1, weight_path=[str(path)]) as gen:
        recorder = gen._pipeline
        pipeline = recorder._pipeline
        model = pipeline._pipeline_model
        gen.generate(PROMPT, 8, ignore_eos=True)  # warm-up

        book = Book()
        model.model.execute_raw = book.wrap("model graph", model.model.execute_raw)
        pipeline._sampler_without_bitmask = TimedSampler(pipeline._sampler_without_bitmask, book)
        pipeline.prepare_batch = book.wrap("prepare_batch", pipeline.prepare_batch)
        kv = pipeline._kv_manager
        kv.step = book.wrap("kv_manager.step", kv.step)
        execute = book.wrap("pipeline.execute", pipeline.execute)

        def entered(inputs: Any) -> Any:
            book.enter()
            return execute(inputs)

        pipeline.execute = entered
        start = time.perf_counter()
        gen.generate(PROMPT, new_tokens, ignore_eos=True)
        wall = time.perf_counter() - start
        book.enter()
    # From the second `execute` (the first is the prefill's) to `generate`'s return. A
    # pass of MAX's loop runs a burst of decode steps (`gpt2_max.bursts`), one model graph
    # call each, so every part is its time over those calls, per step.
    (first, before), (last, after) = book.entries[1], book.entries[-1]
    steps = after["model graph"] - before["model graph"]
    table = {"step": (last - first) / steps * 1e3}
    for name, calls in book.calls.items():
        table[name] = sum(calls[before.get(name, 0) : after[name]]) / steps * 1e3
    table["pipeline, other"] = table["pipeline.execute"] - sum(
        table[n] for n in ("model graph", "sampler graph", "prepare_batch", "kv_manager.step")
    )
    table["outside execute"] = table["step"] - table["pipeline.execute"]
    table["tok/s (wall, prefill included)"] = new_tokens / wall
    return table


FLOOR_SUBJECTS = ("MAX's Llama", "gpt2_max")
"""`--floor`'s servers: MAX's own Llama architecture on `bench_start.py`'s small Llama
(no code of this package runs its steps), then gpt2_max on a GPT-2 of the same shape."""


def floor_checkpoint(subject: str) -> Path:
    """`subject`'s checkpoint folder, written on first use: the GPT-2 takes its shape
    from the Llama's config, so the two differ only by architecture."""
    llama, _ = bench_start.checkpoint("llama")
    if subject == FLOOR_SUBJECTS[0]:
        return llama
    folder = CHECKPOINTS / "floor-gpt2"
    if not (folder / "model.safetensors").exists():
        shape = json.loads((llama / "config.json").read_text())
        config = preset_config(
            "gpt2", n_layer=shape["num_hidden_layers"], n_embd=shape["hidden_size"],
            n_head=shape["num_attention_heads"], n_inner=shape["intermediate_size"],
            vocab_size=shape["vocab_size"],
        )
        write_checkpoint(folder, config, std=0.2)
    return folder


def serve_accounting(path: Path, new_tokens: int, env: dict[str, str]) -> dict[str, float]:
    """Milliseconds per decode token of one streamed request through `max serve` (with
    `env` added to its environment), MAX's per-step parts inside the model worker over
    its decode steps per token made (`worker_probe.PARTS`), and the CPU milliseconds
    per token each server process spent meanwhile."""
    if missing := worker_probe.missing_parts():
        raise RuntimeError(f"this MAX lacks what worker_probe times: {', '.join(missing)}")
    with tempfile.TemporaryDirectory() as scratch:
        probe = Path(scratch) / "probe"
        probe.mkdir()
        env = worker_probe.server_env(probe, env)
        with serve(path, *SERVE_ARGS, devices="cpu", log=Path(scratch) / "server.log",
                   env=env) as server:
            root = psutil.Process(server.pid)
            processes = [root, *root.children(recursive=True)]
            asyncio.run(stream_probed(server.url, new_tokens, None))  # warm-up
            before = {p.pid: sum(p.cpu_times()[:2]) for p in processes}
            arrivals, totals = asyncio.run(stream_probed(server.url, new_tokens, probe))
            spent = {p.pid: sum(p.cpu_times()[:2]) - before[p.pid] for p in processes}
    decode_s = arrivals[-1] - arrivals[0]
    steps = len(arrivals) - 1
    # The worker is the process that ran the graphs: by far the most CPU.
    worker = max(spent, key=spent.get)
    first, last = totals
    table = {
        "token": decode_s / steps * 1e3,
        **worker_probe.per_token(first, last),
        "worker CPU": spent[worker] / steps * 1e3,
        "API process CPU": spent[root.pid] / steps * 1e3,
        "other processes CPU": sum(v for k, v in spent.items() if k not in (worker, root.pid))
        / steps * 1e3,
    }
    # Seconds of CPU over the decode's wall time: what the server keeps busy of THREADS cores.
    table["cores busy"] = sum(spent.values()) / decode_s
    return table


async def stream_probed(
    url: str, new_tokens: int, probe: Path | None
) -> tuple[list[float], tuple[dict, dict] | None]:
    """One streamed greedy request of `PROMPT` (`streams.max_completion`): each token's arrival
    time, and the model worker's probe totals read as the first token arrives and
    after the last (so they cover the decode steps only), when `probe` is given. The
    first read holds the client's event loop for a step or two; the tokens wait in
    the socket meanwhile, and the decode's time runs from the first token's arrival."""
    totals: list[dict] = []

    def read_totals() -> None:
        totals.append(worker_probe.request_totals(probe))

    async with streams.client() as client:
        result = await streams.max_completion(
            client, url, PROMPT, new_tokens, on_first_token=read_totals if probe else None
        )
    if probe is None:
        return result["arrivals"], None
    read_totals()
    return result["arrivals"], (totals[0], totals[1])


def sampler_alone(vocab_size: int, repeat: int, previous: int = 100) -> float:
    """Median milliseconds of one execute of MAX's own sampler graph at one row, with
    `previous` tokens generated before (greedy: top-k 1, every other setting neutral)."""
    sampler = token_sampler(SamplingConfig(), DeviceRef.CPU())
    model = InferenceSession(devices=[CPU()]).load(sampler)
    logits, prev_tokens, *settings = (v.type for v in sampler.inputs)
    inputs = [
        np.random.default_rng(0).standard_normal((1, vocab_size), np.float32),
        np.zeros((1, previous), np.int64),
        *(np.ones([1 if str(d) == "batch" else d for d in t.shape], t.dtype.to_numpy())
          for t in settings),
    ]
    return time_execute(model, [Buffer.from_numpy(a) for a in inputs], repeat)


# ---- partial graphs -------------------------------------------------------------


def model_weights(path: Path) -> tuple[dict[str, Any], Any, Callable[[str], str]]:
    """The weights as the model holds them (converted, packed ones repacked), the
    config, and what the model chooses each packed weight's kernel for (`model_work`)."""
    weights = GGUFWeights(path)
    state = dict(weights.items())
    reader = gguf_reader(next(iter(state.values())))
    config = huggingface_config(metadata(reader), {t.name for t in reader.tensors})
    converted = convert_gguf_state_dict(state, config)
    work_of = model_work(converted, config)
    return repack(converted, work_of), config, work_of


def model_work(state: dict[str, Any], config: Any) -> Callable[[str], str]:
    """What the served model (last-token logits, on the fast layers) chooses each packed
    weight's kernel for: `FastLayers.work_of` over the model's weights plan, so a block
    it runs as one op takes the package's kernel here too."""
    plan = dataclasses.replace(WeightPlan.of(state), few_rows=frozenset({HEAD_WEIGHT}))
    arch = SimpleNamespace(
        weights=plan, activation=ACTIVATIONS[config.activation_function], dtype=DType.float32
    )
    return FastLayers(arch).work_of


def _array(weight: Any) -> np.ndarray:
    """The weight where the model keeps it: in huge-page memory, which streams faster
    than ordinary pages (`weights/hugepages.py`)."""
    return hugepage_array(np.asarray(weight.data))


def chain_names(state: dict[str, Any], config: Any) -> list[str]:
    """Every projection the model runs, in its order, then the LM head."""
    names = []
    for i in range(config.n_layer):
        for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            names.append(f"h.{i}.{part}")
    return [*names, "lm_head" if "lm_head.weight" in state else "wte"]


def chain_input(name: str, y: Any, config: Any) -> Any:
    """The next projection's input from this one's output `y`: c_fc's and the head's
    whole, the others' first `n_embd` columns (a slice of c_attn's feeds c_proj)."""
    return y if name.endswith(("mlp.c_fc", "lm_head", "wte")) else y[:, : config.n_embd]


def projection_chain(
    state: dict[str, Any], config: Any, work_of: Callable[[str], str]
) -> tuple[Graph, list[np.ndarray], int]:
    """A graph multiplying one row through every projection the model runs, in the
    model's order and on its kernels (`model_weights`' `work_of`), then the LM head; the
    weights are graph inputs. Returns it, its inputs and the bytes of weights it streams."""
    *names, head = chain_names(state, config)
    arrays: list[np.ndarray] = [np.zeros((1, config.n_embd), np.float32)]
    types = [TensorType(DType.float32, [1, config.n_embd], DeviceRef.CPU())]
    plan = []
    for name in [*names, head]:
        w = state[f"{name}.weight"]
        a = _array(w)
        arrays.append(a)
        types.append(TensorType(DType.from_numpy(a.dtype), list(a.shape), DeviceRef.CPU()))
        bias = state.get(f"{name}.bias") if name != head else None
        if bias is not None:
            b = _array(bias)
            arrays.append(b)
            types.append(TensorType(DType.float32, list(b.shape), DeviceRef.CPU()))
        plan.append((name, block_type(w), bias is not None))
    nbytes = sum(a.nbytes for a in arrays[1:] if a.ndim == 2)
    with Graph("projections", input_types=types) as graph:
        inputs = iter(v.tensor for v in graph.inputs)
        x = next(inputs)
        for name, encoding, has_bias in plan:
            w = next(inputs)
            b = next(inputs) if has_bias else None
            work = work_of(f"{name}.weight")
            if encoding is not None and not uses_max_kernel(encoding, work):
                y = (kernels.packed_linear(encoding, x, w, b) if b is not None
                     else kernels.packed_matmul(encoding, x, w))
            elif encoding is not None:
                y = qmatmul.matmul(encoding, x, w)
                if b is not None:
                    y = y[:, : b.shape[0]] + b
            elif b is not None:
                y = kernels.skinny_linear(x, w, b)
            else:
                y = kernels.skinny_matmul(x, w)
            x = chain_input(name, y, config)
        graph.output(x)
    return graph, arrays, nbytes


def small_ops(config: Any) -> Graph:
    """MAX's LayerNorms, tanh GELUs and residual adds, as many as one step runs."""
    d, ff = config.n_embd, 4 * config.n_embd
    cpu = DeviceRef.CPU()
    types = [TensorType(DType.float32, [1, d], cpu), TensorType(DType.float32, [1, ff], cpu),
             TensorType(DType.float32, [d], cpu)]
    with Graph("small_ops", input_types=types) as graph:
        x, f, g = (v.tensor for v in graph.inputs)
        for _ in range(config.n_layer):
            h = ops.layer_norm(x, g, g, 1e-5)
            x = x + h
            h = ops.layer_norm(x, g, g, 1e-5)
            f = ops.gelu(f + h[:, :1], approximate="tanh")
            x = x + h
        graph.output(ops.layer_norm(x, g, g, 1e-5), f)
    return graph


def one_op() -> Graph:
    with Graph("one_op", input_types=[TensorType(DType.float32, [1], DeviceRef.CPU())]) as graph:
        graph.output(graph.inputs[0].tensor + 1)
    return graph


def time_execute(model: Any, buffers: list[Buffer], repeat: int) -> float:
    """Median milliseconds of one execute."""
    for _ in range(5):
        model.execute(*buffers)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        model.execute(*buffers)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def loaded_chain(session: InferenceSession, path: Path) -> tuple[Any, list[Buffer], int, Any]:
    """`path`'s `projection_chain` compiled in `session` and run once: the model, its
    input buffers, the bytes of weights it streams, the config."""
    state, config, work_of = model_weights(path)
    chain, arrays, nbytes = projection_chain(state, config, work_of)
    buffers = [Buffer.from_numpy(a) for a in arrays]
    compiled = session.load(chain)
    compiled.execute(*buffers)
    return compiled, buffers, nbytes, config


def graph_split(path: Path, repeat: int) -> dict[str, float]:
    before = threads.thread_ids()
    session = InferenceSession(devices=[CPU()])
    compiled, buffers, nbytes, config = loaded_chain(session, path)
    # MAX's threads as the model's runtime policy sets them (`cpu_runtime`), which the
    # model graph's figure above ran under.
    threads.yield_to_main_thread()
    threads.idle_engine_poller(before)
    matmuls = time_execute(compiled, buffers, repeat)
    d = config.n_embd
    small = time_execute(session.load(small_ops(config)), [
        Buffer.from_numpy(np.ones((1, d), np.float32)),
        Buffer.from_numpy(np.ones((1, 4 * d), np.float32)),
        Buffer.from_numpy(np.ones(d, np.float32)),
    ], repeat)
    empty = time_execute(session.load(one_op()), [Buffer.from_numpy(np.ones(1, np.float32))],
                         repeat)
    return {
        "projections (graph)": matmuls, "weight MB": nbytes / 1e6,
        "GB/s": nbytes / matmuls / 1e6, "small ops (graph)": small, "one-op graph": empty,
        "sampler alone": sampler_alone(config.vocab_size, repeat),
    }


def torch_chain(path: Path, repeat: int) -> dict[str, float]:
    """`projection_chain` through torch's `F.linear` on the same huge-page arrays and
    `THREADS` threads; empty unless every projection weight is float32."""
    import torch

    state, config, _ = model_weights(path)
    names = chain_names(state, config)
    weights = [state[f"{name}.weight"] for name in names]
    if any(block_type(w) is not None or np.asarray(w.data).dtype != np.float32
           for w in weights):
        return {}
    torch.set_num_threads(THREADS)
    plan = [(name, torch.from_numpy(_array(w)),
             torch.from_numpy(_array(state[f"{name}.bias"]))
             if f"{name}.bias" in state else None)
            for name, w in zip(names, weights, strict=True)]
    first = torch.zeros((1, config.n_embd))

    def run() -> None:
        x = first
        for name, w, b in plan:
            x = chain_input(name, torch.nn.functional.linear(x, w, b), config)

    with torch.inference_mode():
        for _ in range(5):
            run()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return {"torch chain": statistics.median(times) * 1e3}


def alternated_chains(paths: list[Path], rounds: int, repeat: int) -> dict[str, list[float]]:
    """Each file's `projection_chain` compiled in one session, then executed in turns:
    every round times each chain once (`repeat` executes, median ms), in `paths`' order,
    so the figures of one round are of the same minute. Per file: its MB, then the
    milliseconds of each round."""
    before = threads.thread_ids()
    session = InferenceSession(devices=[CPU()])
    loaded = [(str(path), *loaded_chain(session, path)[:3]) for path in paths]
    threads.yield_to_main_thread()
    threads.idle_engine_poller(before)
    table: dict[str, list[float]] = {name: [nbytes / 1e6] for name, _, _, nbytes in loaded}
    for _ in range(rounds):
        for name, compiled, buffers, _ in loaded:
            table[name].append(time_execute(compiled, buffers, repeat))
    return table


def alternate(checkpoint: Path, types: list[str], args: argparse.Namespace) -> None:
    """`--alternate`: the bytes each type's decode step streams a second, of its
    projections alone and of its model graph and whole step, with the types taken in
    turns round after round, and each against the first type's in the same round."""
    paths = [gguf_file(checkpoint, t) for t in types]
    chains = measure("chains", paths, args)
    megabytes = {t: chains[str(p)][0] for t, p in zip(types, paths, strict=True)}
    rates: dict[str, dict[str, list[float]]] = {t: defaultdict(list) for t in types}
    for r in range(args.alternate):
        for t, p in zip(types, paths, strict=True):
            rates[t]["projections"].append(megabytes[t] / chains[str(p)][1 + r])
    for _ in range(args.alternate):  # one process a step, the types in turns
        for t, p in zip(types, paths, strict=True):
            steps = measure("step", p, args)
            for part in ("model graph", "step"):
                rates[t][part].append(megabytes[t] / steps[part])
    first = types[0]
    print(f"\nGB/s of weights a decode step streams, {args.alternate} rounds, the types in "
          f"turns ({', '.join(types)}); median, and the median of each round's ratio to "
          f"{first}'s:")
    parts = ("projections", "model graph", "step")
    print(f"  {'type':<8} {'MB':>6}" + "".join(f" {p:>13} {'of ' + first:>9}" for p in parts))
    for t in types:
        cells = []
        for part in parts:
            mine, theirs = rates[t][part], rates[first][part]
            ratio = statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
            cells.append(f" {statistics.median(mine):13.1f} {ratio:9.2f}")
        print(f"  {t:<8} {megabytes[t]:6.0f}" + "".join(cells))
    print("  (projections: every projection and the head chained at one row on the model's "
          "kernels, one session, rounds of `--repeat` executes; model graph and step: "
          "`step_accounting`, a fresh process each)")


def write_files(checkpoint: Path, preset: str, types: list[str]) -> dict[str, Any]:
    """The preset's checkpoint and its GGUF of each type, written where missing."""
    if not (checkpoint / "model.safetensors").exists():
        write_checkpoint(checkpoint, preset_config(preset), std=0.2)
    return {t: str(gguf_file(checkpoint, t)) for t in types}


PARTS: dict[str, Callable[[list[Path], argparse.Namespace], dict[str, Any]]] = {
    "files": lambda paths, args: write_files(
        paths[0], args.preset, [t for t in args.types.split(",") if t]
    ),
    "step": lambda paths, args: step_accounting(paths[0], args.new_tokens),
    "split": lambda paths, args: graph_split(paths[0], args.repeat),
    "peer": lambda paths, args: torch_chain(paths[0], args.repeat),
    "serve": lambda paths, args: serve_accounting(
        paths[0], args.new_tokens, dict(item.split("=", 1) for item in args.serve_env)
    ),
    "chains": lambda paths, args: alternated_chains(paths, args.alternate, args.repeat),
}
"""Each measurement runs in a process of its own: a MAX session left from one (its
thread pool) would share the two cores with the next. So does writing the files:
Python keeps the memory an xl checkpoint's arrays took (5 GB), and a server started
beside it sizes MAX's KV cache from what is left free, a cache the kernel's
out-of-memory killer then took the worker for."""


def measure(part: str, path: Path | list[Path], args: argparse.Namespace) -> dict[str, Any]:
    """`PARTS[part]` on `path` (or on each of a list), in a fresh Python process."""
    paths = path if isinstance(path, list) else [path]
    command = [sys.executable, __file__, "--part", part, *(f"--path={p}" for p in paths),
               "--new-tokens", str(args.new_tokens), "--repeat", str(args.repeat),
               "--alternate", str(args.alternate), "--preset", args.preset,
               "--types", args.types,
               *(f"--serve-env={item}" for item in args.serve_env)]
    result = subprocess.run(command, capture_output=True, text=True, env=child_env())
    if result.returncode != 0:
        raise RuntimeError(f"{part} of {path} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--types", default="f32,q4_k_m")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--llama-bench", action="store_true",
                        help="also run llama.cpp's llama-bench (tg128) on each file")
    parser.add_argument("--serve", action="store_true",
                        help="also time one streamed request through `max serve`")
    parser.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                        help="add to the environment of that `max serve` (repeatable), e.g. "
                             "the settings docs/performance.md recommends")
    parser.add_argument("--floor", action="store_true",
                        help="also serve MAX's own Llama and gpt2_max at one small shape "
                             "(FLOOR_SUBJECTS) and take the same served table for each")
    parser.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                        help="instead of the tables: the GB/s each type's step streams, "
                             "the types taken in turns for ROUNDS rounds, each against "
                             "the first type's (e.g. --types f32,q4_k_m)")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, action="append", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        print(json.dumps(PARTS[args.part](args.path, args)))
        return
    checkpoint = CHECKPOINTS / f"checkpoint-{args.preset}"
    measure("files", checkpoint, args)
    print(f"CPU: {cpu_model()}; preset {args.preset}; batch 1, {len(PROMPT)}-token prompt, "
          f"{args.new_tokens} new tokens; ms per decode step (mean)")
    if args.serve and args.serve_env:
        print(f"max serve's added environment: {' '.join(args.serve_env)}")
    if args.alternate:
        alternate(checkpoint, [t for t in args.types.split(",") if t], args)
        return
    for file_type in filter(None, args.types.split(",")):
        path = gguf_file(checkpoint, file_type)
        steps = measure("step", path, args)
        split = measure("split", path, args)
        model = steps["model graph"]
        rest = model - split["projections (graph)"] - split["small ops (graph)"]
        print(f"\n{file_type} ({path.name}): {steps['step']:.2f} ms per step, "
              f"{1e3 / steps['step']:.1f} tok/s per step")
        for name in ("step", "model graph"):
            print(f"  {name:<34} {steps[name]:8.3f}")
        print(f"    {'projections, alone at 1 row':<32} {split['projections (graph)']:8.3f}"
              f"   ({split['weight MB']:.0f} MB, {split['GB/s']:.1f} GB/s)")
        peer = measure("peer", path, args)
        if peer:
            print(f"    {'the same through torch (peer)':<32} {peer['torch chain']:8.3f}"
                  f"   ({split['weight MB'] / peer['torch chain']:.1f} GB/s, torch "
                  f"{version('torch')}, F.linear)")
        print(f"    {'LayerNorm/GELU/residual ops':<32} {split['small ops (graph)']:8.3f}")
        print(f"    {'attention, K/V stores, rest':<32} {rest:8.3f}"
              f"   (a one-op graph executes in {split['one-op graph']:.3f})")
        for name in ("sampler graph", "prepare_batch", "kv_manager.step", "pipeline, other",
                     "outside execute"):
            print(f"  {name:<34} {steps[name]:8.3f}")
        print(f"    {'MAX sampler graph alone, 1 row':<32} {split['sampler alone']:8.3f}")
        print(f"  step streams {split['weight MB'] / steps['step']:.1f} GB/s of weights")
        if args.llama_bench:
            tg = llama_cpp_tools.llama_bench(path, THREADS, prompt=0)["tg128"]
            print(f"  llama-bench tg128: {tg:.1f} tok/s, {1e3 / tg:.2f} ms per token, "
                  f"{split['weight MB'] * tg / 1e3:.1f} GB/s; gpt2-max step / llama.cpp "
                  f"{steps['step'] * tg / 1e3:.2f}")
        if args.serve:
            print_served(measure("serve", path, args), steps["step"])
    if args.floor:
        print("\nThe floor: MAX's own Llama and gpt2_max at one small shape (bench_start.py's "
              "Llama), both through max serve")
        for subject in FLOOR_SUBJECTS:
            print(f"\n{subject}:")
            print_served(measure("serve", floor_checkpoint(subject), args))


def print_served(served: dict[str, float], step: float | None = None) -> None:
    """The `serve` part's table: the token's time through `max serve`, MAX's parts in
    the model worker per token made, the CPU each server process took."""
    over = (f" ({served['token'] - step:+.2f} over the in-process step)"
            if step is not None else "")
    print(f"  through max serve: {served['token']:.2f} ms per token{over}")
    iteration, execute = served["scheduler iteration"], served["pipeline.execute"]
    inside, beside = worker_probe.PIPELINE_PARTS, worker_probe.SCHEDULER_PARTS
    rows = [
        ("scheduler iteration", iteration, 4),
        ("pipeline.execute", execute, 6),
        *((name, served[name], 8) for name in inside),
        ("pipeline, other", execute - sum(served[n] for n in inside), 8),
        *((name, served[name], 6) for name in beside),
        ("scheduler, other", iteration - execute - sum(served[n] for n in beside), 6),
        ("between iterations", served["token"] - iteration, 4),
    ]
    for name, value, indent in rows:
        print(f"{' ' * indent}{name:<{36 - indent}} {value:8.3f}")
    print(f"  CPU ms per token: worker {served['worker CPU']:.2f}, API process "
          f"{served['API process CPU']:.2f}, other {served['other processes CPU']:.2f}; "
          f"{served['cores busy']:.2f} of {THREADS} cores busy")

if __name__ == "__main__":
    main()
