"""Constrained against unconstrained decoding under one `max serve --enable-structured-output`.

    PYTHONPATH=. python benchmarks/bench_structured.py               # gpt2-small shape, 3 runs
    PYTHONPATH=. python benchmarks/bench_structured.py --preset tiny --repeat 1
    PYTHONPATH=. python benchmarks/bench_structured.py --fast-forward  # both servers

Each of the serving tests' nine schemas (`gpt2_max.testing.schemas.SCHEMAS`) is
asked greedily through `/v1/chat/completions` with its `response_format`; then
the same chat without one, with `ignore_eos` and `max_tokens` set to the
constrained answer's length. Both sides produce the same number of tokens from
the same prompt on the same server, so their ratio is what the grammar costs
(xgrammar's bitmask filled on the host every step, MAX's bitmask sampler).
MAX's loop takes a step a token; `--fast-forward` runs the same passes again
on a second server with `GPT2_MAX_FAST_FORWARD=1` (`shims.fast_forward`), and
each constrained request's steps are counted from MAX's own batch metric on
both. Beside them, the
in-process `Generator` on the same checkpoint and chat prompt, default engine
(llguidance with fast-forward): its tokens and steps for the same schema, which
is what fast-forwarding saves where it can run.

Two passes a run: one request at a time (every step carries the grammar's host
work), and all nine at once (one batch; the free pass likewise). Medians over
`--repeat`; the CPU model is printed with the table and the JSON result goes
to `benchmarks/results/`. Shared, noisy machines: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_serve import CHECKPOINTS, RESULTS, THREADS, save_result
from bench_start import cpu_model
from openai import AsyncOpenAI

from gpt2_max.generate import Generator
from gpt2_max.shims.fast_forward import ENV as FAST_FORWARD
from gpt2_max.testing.schemas import SCHEMAS
from gpt2_max.testing.server import MODEL_NAME, max_serve, steps_run
from gpt2_max.tools.checkpoint import preset_config, write_checkpoint

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 256
SERVE_ARGS = ("--max-batch-size", "16", "--enable-structured-output")
TINY = dict(n_layer=2, n_embd=64, n_head=4)


async def chat(api: AsyncOpenAI, name: str, max_tokens: int, constrained: bool) -> dict:
    """One greedy chat, under schema `name` or free to `max_tokens`: tokens, wall, prompt."""
    if constrained:
        schema = {"name": name.replace("-", "_"), "schema": SCHEMAS[name]}
        options = {"response_format": {"type": "json_schema", "json_schema": schema}}
    else:
        options = {"extra_body": {"ignore_eos": True, "return_token_ids": True}}
    options.setdefault("extra_body", {"return_token_ids": True})
    start = time.perf_counter()
    reply = await api.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=0.0, **options
    )
    wall = time.perf_counter() - start
    choice = reply.choices[0]
    if constrained:
        assert choice.finish_reason == "stop", (name, choice)
    return {"tokens": reply.usage.completion_tokens, "wall": wall,
            "prompt": choice.model_extra["prompt_token_ids"]}


async def one_run(url: str, metrics_url: str) -> dict:
    """Both passes once: per schema (one at a time) and the batch of all nine."""
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api:
        alone: dict[str, dict] = {}
        for name in SCHEMAS:
            before = steps_run(metrics_url)
            constrained = await chat(api, name, MAX_TOKENS, True)
            steps = steps_run(metrics_url) - before
            free = await chat(api, name, constrained["tokens"], False)
            assert free["tokens"] == constrained["tokens"], (name, free, constrained)
            alone[name] = {"tokens": constrained["tokens"], "constrained_s": constrained["wall"],
                           "free_s": free["wall"], "prompt": constrained["prompt"],
                           "steps": steps}
        start = time.perf_counter()
        await asyncio.gather(*(chat(api, name, MAX_TOKENS, True) for name in SCHEMAS))
        batch_constrained = time.perf_counter() - start
        start = time.perf_counter()
        await asyncio.gather(
            *(chat(api, name, alone[name]["tokens"], False) for name in SCHEMAS)
        )
        batch_free = time.perf_counter() - start
    return {"alone": alone, "batch": {"constrained_s": batch_constrained, "free_s": batch_free}}


def median_run(runs: list[dict]) -> dict:
    """Each schema's tokens (greedy: the same every run) and median walls."""
    def median(get):
        return statistics.median(get(run) for run in runs)

    alone = {
        name: {"tokens": runs[0]["alone"][name]["tokens"],
               "steps": runs[0]["alone"][name]["steps"],
               **{key: median(lambda r, k=key, n=name: r["alone"][n][k])
                  for key in ("constrained_s", "free_s")}}
        for name in SCHEMAS
    }
    batch = {key: median(lambda r, k=key: r["batch"][k]) for key in ("constrained_s", "free_s")}
    return {"alone": alone, "batch": batch}


def generator_steps(checkpoint: Path, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """The in-process default engine's tokens and steps for each schema's chat prompt."""
    with Generator(checkpoint, device="cpu", max_batch_size=8) as generator:
        out = {}
        for name, prompt in prompts.items():
            result = generator.generate(prompt, MAX_TOKENS, json_schema=SCHEMAS[name])
            out[name] = {"tokens": len(result.token_ids), "steps": result.steps,
                         "forced": result.forced_tokens}
        return out


def print_table(result: dict, side: str) -> None:
    median, gen = result[side], result["generator"]
    alone, batch = median["alone"], median["batch"]
    print(f"\nCPU: {result['cpu_model']}; preset {result['preset']}; "
          f"median of {result['repeat']}; max serve --max-batch-size 16; {side}")
    print(f"{'schema':<20}{'tokens':>7}{'serve steps':>12}{'constrained tok/s':>19}"
          f"{'free tok/s':>12}{'ratio':>7}{'Generator tokens/steps':>24}")
    for name, m in alone.items():
        tokens = m["tokens"]
        print(f"{name:<20}{tokens:>7}{m['steps']:>12}{tokens / m['constrained_s']:>19.1f}"
              f"{tokens / m['free_s']:>12.1f}{m['free_s'] / m['constrained_s']:>7.2f}"
              f"{str(gen[name]['tokens']) + ' / ' + str(gen[name]['steps']):>24}")
    total = sum(m["tokens"] for m in alone.values())
    constrained_s = sum(m["constrained_s"] for m in alone.values())
    free_s = sum(m["free_s"] for m in alone.values())
    gen_tokens = sum(g["tokens"] for g in gen.values())
    gen_steps = sum(g["steps"] for g in gen.values())
    steps = sum(m["steps"] for m in alone.values())
    print(f"{'all, one at a time':<20}{total:>7}{steps:>12}{total / constrained_s:>19.1f}"
          f"{total / free_s:>12.1f}{free_s / constrained_s:>7.2f}"
          f"{str(gen_tokens) + ' / ' + str(gen_steps):>24}")
    print(f"{'all 9 at once':<20}{total:>7}{'':>12}{total / batch['constrained_s']:>19.1f}"
          f"{total / batch['free_s']:>12.1f}{batch['free_s'] / batch['constrained_s']:>7.2f}")
    print("ratio: constrained tok/s over free tok/s; tokens include the end-of-text token; "
          "serve steps: MAX's batch count for the constrained request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2", help="a GPT-2 shape, or 'tiny'")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fast-forward", action="store_true",
                        help=f"also run a server with {FAST_FORWARD}=1 and compare")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    RESULTS.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpt2-max-bench-structured-"))
    checkpoint = CHECKPOINTS / f"checkpoint-{args.preset}"
    if not (checkpoint / "model.safetensors").exists():
        tiny = args.preset == "tiny"
        config = preset_config("gpt2", **TINY) if tiny else preset_config(args.preset)
        write_checkpoint(checkpoint, config, std=0.2)
    sides = {"max-loop": "0", "fast-forward": "1"} if args.fast_forward else {"max-loop": "0"}
    runs: dict[str, list[dict]] = {}
    for side, flag in sides.items():
        with max_serve(checkpoint, *SERVE_ARGS, log=scratch / f"server-{side}.log",
                       env={FAST_FORWARD: flag}) as server:
            asyncio.run(one_run(server.url, server.metrics_url))  # warm-up: compiles
            runs[side] = [asyncio.run(one_run(server.url, server.metrics_url))
                          for _ in range(args.repeat)]
    prompts = {name: runs["max-loop"][0]["alone"][name]["prompt"] for name in SCHEMAS}
    result = {
        "preset": args.preset, "repeat": args.repeat, "cpu_model": cpu_model(),
        "cpus": os.cpu_count(), **{side: median_run(r) for side, r in runs.items()},
        "runs": runs, "generator": generator_steps(checkpoint, prompts),
        "load_avg": os.getloadavg(),
    }
    for side in sides:
        print_table(result, side)
    save_result(f"bench-structured-{args.preset}", result, scratch)


if __name__ == "__main__":
    main()
