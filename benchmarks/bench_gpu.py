"""GPT-2 decode on one GPU beside its peers in the same run: tokens per second, the step,
time to first token, start time and the share of the card's bandwidth a step reaches.

    PYTHONPATH=. python benchmarks/bench_gpu.py                       # gpt2 shape, b1 and b64
    PYTHONPATH=. python benchmarks/bench_gpu.py --dtypes bfloat16 --batch-sizes 1 --no-serve
    PYTHONPATH=. python benchmarks/bench_gpu.py --device cpu --preset tiny --dtypes float32 \\
        --batch-sizes 1,4 --new-tokens 8 --peers eager        # a smoke run of the script itself

Engines, each on the same random-weight checkpoint and prompts (16 tokens, greedy,
end of text ignored, `--new-tokens` new):

- gpt2-max in-process (`AutoModel` through the plugin, MAX's own decode loop) at each
  batch size and dtype; and, unless `--no-serve`, one stream and `--batch-sizes`'
  largest concurrent streams through `max serve` (bfloat16 on a GPU), read with the
  benchmarks' lean client (`streams.py`);
- transformers eager (`generate`, dynamic cache);
- transformers with a static KV cache (`cache_implementation="static"`), whose
  decode step `generate` compiles with torch on a GPU (`torch.compile`, CUDA graphs;
  transformers' own `compile_config`), the strongest single-GPU peer that runs
  without network (`--peers` picks them).

A row's step is (time for all new tokens - time to first token) / (new tokens - 1);
bytes per step are the weights (in the row's dtype) plus the KV cache a step reads
at the mean context; the bandwidth row beside it is a device-to-device copy timed by
torch in the same run (the peer that says what "at the card's bandwidth" means
here). Start times are `max serve`'s to its first answer, cold (an empty MAX cache)
and warm. Output: a table on stdout and `--out` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import streams
import torch
from max.pipelines import AutoModel
from transformers import GPT2LMHeadModel

from gpt2_max.bursts.model import ENV as BURST_ENV
from gpt2_max.names import PACKAGE
from gpt2_max.testing.reference import TINY_HEAD64, random_prompt, random_state_dict
from gpt2_max.testing.server import max_serve
from gpt2_max.tools.checkpoint import preset_config, save_hub_checkpoint

PROMPT_TOKENS = 16
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(run: Callable[[], object], repeat: int) -> float:
    """The median wall time of `run` over `repeat` calls, after one untimed call (a
    compiled peer compiles in it)."""
    run()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(first: float, whole: float, batch: int, new_tokens: int) -> dict[str, float]:
    step = (whole - first) / (new_tokens - 1)
    return {"ttft_s": first, "step_ms": 1e3 * step, "tok_s": batch / step}


def gpt2_max_rows(
    checkpoint: Path, device: str, dtype: str, batches: list[int], new: int, repeat: int,
    capture: bool = False,
) -> dict[int, dict]:
    """`capture`: MAX's device graph capture (`device_graph_capture=True`, the flag
    `--device-graph-capture` sets), which the architecture does not declare yet."""
    model = AutoModel(
        str(checkpoint), devices=device, quantization_encoding=dtype,
        max_batch_size=max(batches), custom_architectures=[PACKAGE],
        device_graph_capture=capture,
        device_memory_utilization=0.3,  # the peers and the served rows share the card
    )
    rows = {}
    try:
        for batch in batches:
            prompts = [random_prompt(PROMPT_TOKENS, seed=i) for i in range(batch)]

            def run(n: int, prompts: list[list[int]] = prompts) -> Callable[[], object]:
                return lambda: model.generate(
                    prompts, max_new_tokens=n, top_k=1, ignore_eos=True
                )

            rows[batch] = row(timed(run(1), repeat), timed(run(new), repeat), batch, new)
            rows[batch]["tokens"] = [
                list(s[PROMPT_TOKENS:]) for s in model.generate(
                    prompts, max_new_tokens=new, top_k=1, ignore_eos=True
                ).sequences
            ]
    finally:
        model.close()
    return rows


def transformers_rows(
    checkpoint: Path, device: str, dtype: str, batches: list[int], new: int, repeat: int,
    compiled: bool,
) -> dict[int, dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = GPT2LMHeadModel.from_pretrained(checkpoint, dtype=TORCH_DTYPES[dtype])
    model = model.to(device).eval()
    # With a static cache `generate` compiles its decode step itself (on a GPU).
    options = {"cache_implementation": "static"} if compiled else {}
    rows = {}
    for batch in batches:
        ids = torch.tensor(
            [random_prompt(PROMPT_TOKENS, seed=i) for i in range(batch)], device=device
        )

        def run(n: int, ids: torch.Tensor = ids) -> Callable[[], object]:
            def generate() -> torch.Tensor:
                with torch.no_grad():
                    return model.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **options,
                    )
            return generate

        rows[batch] = row(timed(run(1), repeat), timed(run(new), repeat), batch, new)
        rows[batch]["tokens"] = run(new)()[:, PROMPT_TOKENS:].tolist()
    return rows


def copy_bandwidth_gbps(device: str, gigabytes: float = 1.0) -> float:
    """Bytes read plus written per second by a device-to-device copy of `gigabytes`."""
    src = torch.empty(int(gigabytes * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / seconds / 1e9


def bytes_per_step(config, dtype: str, batch: int, new: int) -> float:
    """Weights plus the KV cache a decode step reads at the mean context."""
    width = TORCH_DTYPES[dtype].itemsize
    d, layers = config.n_embd, config.n_layer
    params = (config.vocab_size + config.n_positions) * d + layers * 12 * d * d
    context = PROMPT_TOKENS + new / 2
    return width * (params + batch * context * 2 * layers * d)


Variant = tuple[str, dict[str, str], list[str]]
"""A server to measure: its name, its environment and its further `max serve` flags."""


def parse_variants(spec: str) -> list[Variant]:
    """`NAME:WORD WORD ...,NAME:...`, each word `KEY=VALUE` (environment) or `--flag`."""
    variants = []
    for item in filter(None, spec.split(",")):
        name, _, words = item.partition(":")
        env = dict(w.split("=", 1) for w in words.split() if not w.startswith("--"))
        variants.append((name, env, [w for w in words.split() if w.startswith("--")]))
    return variants


def served_rows(
    checkpoint: Path, device: str, batches: list[int], new: int, scratch: Path,
    starts: list[str], variants: list[Variant], logs: Path | None = None,
) -> dict:
    """`max serve` with no device or encoding flag (the GPU's default, bfloat16 there):
    start times (cold: an empty MAX cache of its own; warm: the cache a cold start
    filled, else the user's), then per variant a warm server's one stream and largest
    batch of concurrent streams, their tokens compared with the first variant's that
    answered. A variant that fails is recorded with its error and the rest still run.
    Each server's log is `serve-{start}.log` or `serve-{variant}.log` in `logs`."""
    base_env = {"MODULAR_CACHE_DIR": str(scratch / "max-cache")} if "cold" in starts else {}
    logs = logs or scratch
    result: dict = {}
    for start in (start for start in ("cold", "warm") if start in starts):  # cold fills
        began = time.perf_counter()
        with served(checkpoint, device, batches, logs / f"serve-{start}.log", base_env):
            result[f"start_{start}_s"] = time.perf_counter() - began
    first = None
    for name, env, flags in variants:
        try:
            with served(checkpoint, device, batches, logs / f"serve-{name}.log",
                        {**base_env, **env}, flags) as url:
                rows = result[name] = stream_rows(url, batches, new, name)
        except Exception as error:  # noqa: BLE001 - reported, the other variants still run
            result[name] = {"error": repr(error)}
            continue
        if first is None:
            first = name
            continue
        for batch, r in rows.items():
            r[f"same_tokens_as_{first}"] = same_tokens(r["tokens"], result[first][batch]["tokens"])
    for name, _, _ in variants:  # tokens were for the comparison only
        for r in result[name].values():
            if isinstance(r, dict):
                r.pop("tokens", None)
    return result


@contextmanager
def served(checkpoint: Path, device: str, batches: list[int], log: Path,
           env: dict[str, str], flags: Sequence[str] = ()) -> Iterator[str]:
    with max_serve(
        checkpoint, "--max-batch-size", str(max(batches)), *flags, log=log,
        devices=None if device == "gpu" else device,  # "gpu": MAX's own pick
        env=env,
    ) as server:
        warm = asyncio.run(streams.gather(
            streams.max_completion, server.url, [random_prompt(16, 999)], 8
        ))
        assert warm
        yield server.url


def stream_rows(url: str, batches: list[int], new: int, label: str) -> dict[int, dict]:
    """One stream, then the largest batch as concurrent streams: tok/s, TTFT, step, tokens."""
    rows = {}
    for batch in sorted({1, max(batches)}):
        prompts = [random_prompt(PROMPT_TOKENS, seed=100 + i) for i in range(batch)]
        began = time.perf_counter()
        out = asyncio.run(streams.gather(streams.max_completion, url, prompts, new))
        wall = time.perf_counter() - began
        rows[batch] = {
            "tok_s": batch * new / wall,
            "ttft_s": statistics.median(r["arrivals"][0] for r in out),
            "step_ms": 1e3 * statistics.median(
                (r["arrivals"][-1] - r["arrivals"][0]) / (new - 1) for r in out
            ),
            "tokens": [r["tokens"] for r in out],
        }
        print(f"max serve {label} b{batch}: {rows[batch]['tok_s']:.0f} tok/s, step "
              f"{rows[batch]['step_ms']:.3f} ms", flush=True)
    return rows


def progress(dtype: str, engine: str, rows: dict[int, dict]) -> None:
    """One line per batch size as soon as an engine is measured (a run cut short keeps it)."""
    for batch, r in rows.items():
        print(f"{dtype} {engine} b{batch}: {r['tok_s']:.0f} tok/s, step {r['step_ms']:.3f} ms, "
              f"TTFT {1e3 * r['ttft_s']:.1f} ms", flush=True)


def same_tokens(a: list[list[int]], b: list[list[int]]) -> str:
    """Rows identical throughout, and the mean length of the prefix two rows share: in
    bfloat16 two correct engines part at the first near-tie, so the whole-row count
    alone says little."""
    shared = [
        next((i for i, (x, y) in enumerate(zip(r, q, strict=True)) if x != y), len(r))
        for r, q in zip(a, b, strict=True)
    ]
    same = sum(n == len(r) for n, r in zip(shared, a, strict=True))
    return f"{same}/{len(a)}, prefix {statistics.mean(shared):.0f}"


def device_name(device: str) -> str:
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    from bench_start import cpu_model

    return cpu_model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2", help="a GPT-2 shape, or 'tiny'")
    parser.add_argument("--device", default="gpu", help="MAX's device: gpu, gpu:N or cpu")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--peers", default="eager,compiled", help="transformers peers")
    parser.add_argument("--capture", action="store_true",
                        help="also gpt2-max with MAX's device graph capture")
    parser.add_argument("--no-serve", action="store_true", help="skip the max serve rows")
    parser.add_argument("--starts", default="cold,warm", help="max serve starts to time")
    parser.add_argument(
        "--serve-variants", default=f"k1:{BURST_ENV}=1",
        help="servers to measure, 'NAME:KEY=VALUE --flag ...' separated by commas, e.g. "
             f"'k1:{BURST_ENV}=1,k8:{BURST_ENV}=8,no-prefix-cache:--no-enable-prefix-caching'",
    )
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    torch_device = "cpu" if args.device == "cpu" else f"cuda:{args.device.partition(':')[2] or 0}"
    config = (  # `tiny`: a smoke-run shape with GPT-2's head size
        preset_config("gpt2", **TINY_HEAD64) if args.preset == "tiny"
        else preset_config(args.preset)
    )
    peers = [p for p in args.peers.split(",") if p]
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        checkpoint = save_hub_checkpoint(scratch / "checkpoint", config, random_state_dict(config))
        result: dict = {
            "device": device_name(args.device), "preset": args.preset, "batches": batches,
            "new_tokens": args.new_tokens, "rows": {},
            "copy_gbps": copy_bandwidth_gbps(torch_device) if torch_device != "cpu" else None,
        }
        if not args.no_serve:  # first: the card is the server's alone, nothing held by torch
            result["serve"] = served_rows(
                checkpoint, args.device, batches, args.new_tokens, scratch,
                args.starts.split(","), parse_variants(args.serve_variants),
                logs=args.out.parent if args.out else None,
            )
            save(result, args.out)
        for dtype in args.dtypes.split(","):
            engines = {"gpt2-max": gpt2_max_rows(
                checkpoint, args.device, dtype, batches, args.new_tokens, args.repeat
            )}
            progress(dtype, "gpt2-max", engines["gpt2-max"])
            if args.capture:
                engines["gpt2-max captured"] = gpt2_max_rows(
                    checkpoint, args.device, dtype, batches, args.new_tokens, args.repeat,
                    capture=True,
                )
                progress(dtype, "gpt2-max captured", engines["gpt2-max captured"])
            for peer in peers:
                engines[f"transformers {peer}"] = transformers_rows(
                    checkpoint, torch_device, dtype, batches, args.new_tokens, args.repeat,
                    compiled=peer == "compiled",
                )
                progress(dtype, f"transformers {peer}", engines[f"transformers {peer}"])
            for batch in batches:
                ours = engines["gpt2-max"][batch]
                step_bytes = bytes_per_step(config, dtype, batch, args.new_tokens)
                for name, rows in engines.items():
                    r = rows[batch]
                    r["bytes_per_step"] = step_bytes
                    r["gbps"] = step_bytes / (r["step_ms"] / 1e3) / 1e9
                    if name != "gpt2-max":
                        r["same_tokens_as_gpt2_max"] = same_tokens(r["tokens"], ours["tokens"])
            result["rows"][dtype] = {
                name: {b: {k: v for k, v in r.items() if k != "tokens"} for b, r in rows.items()}
                for name, rows in engines.items()
            }
            save(result, args.out)  # a run cut short keeps what it measured
    print_report(result)


def save(result: dict, out: Path | None) -> None:
    if out:
        out.write_text(json.dumps(result, indent=1, default=str))


def print_report(result: dict) -> None:
    print(f"device: {result['device']}; preset {result['preset']}; {PROMPT_TOKENS}-token "
          f"prompts, {result['new_tokens']} new tokens, greedy")
    if result["copy_gbps"]:
        print(f"device-to-device copy, same run: {result['copy_gbps']:.0f} GB/s")
    print(f"| dtype | engine | batch | tok/s | step ms | TTFT ms | gpt2-max / this | "
          f"GB/s (share of copy) | same tokens |\n|{' --- |' * 9}")
    for dtype, engines in result["rows"].items():
        for batch in result["batches"]:
            ours = engines["gpt2-max"][batch]
            for name, rows in engines.items():
                r = rows[batch]
                share = (f"{r['gbps']:.0f} ({r['gbps'] / result['copy_gbps']:.0%})"
                         if "gbps" in r and result["copy_gbps"] else "")
                print(f"| {dtype} | {name} | {batch} | {r['tok_s']:.0f} | {r['step_ms']:.3f} | "
                      f"{1e3 * r['ttft_s']:.1f} | {ours['tok_s'] / r['tok_s']:.2f}x | {share} | "
                      f"{r.get('same_tokens_as_gpt2_max', '')} |")
    for name, value in result.get("serve", {}).items():
        if name.startswith("start_"):
            print(f"max serve, {name[6:-2]} start: {value:.1f} s to the first answer")
            continue
        for batch, r in value.items():
            if batch == "error":
                print(f"max serve, {name}: {r}")
                continue
            same = " ".join(f"{k}: {v}" for k, v in r.items() if k.startswith("same_tokens"))
            print(f"max serve, {name}, {batch} concurrent streams: {r['tok_s']:.0f} tok/s, "
                  f"TTFT {1e3 * r['ttft_s']:.1f} ms, step {r['step_ms']:.3f} ms {same}")


if __name__ == "__main__":
    main()
