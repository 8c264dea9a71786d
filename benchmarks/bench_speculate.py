"""Speculative decoding through `max serve`: one request of 16 + 128 tokens with a draft
and without, beside `llama-server` with its own draft and without, on the same pair of
weights, and the share of drafted tokens each kept.

    PYTHONPATH=.:benchmarks python benchmarks/bench_speculate.py              # gpt2 shape
    PYTHONPATH=.:benchmarks python benchmarks/bench_speculate.py --presets gpt2-large,gpt2-xl
    PYTHONPATH=.:benchmarks python benchmarks/bench_speculate.py --selfness 0.5,1,2 --tokens 2,4
    PYTHONPATH=.:benchmarks python benchmarks/bench_speculate.py --presets gpt2-xl --draft layers:4

The checkpoints are random (GPT-2's own initialization, std 0.02) with two knobs, since
random weights at a small spread give nearly flat next-token distributions where any
rounding flips the top token, and GPT-2 on text is peaked:

- `selfness`: the token table scaled by it against the position table. The last
  hidden state is then mostly the newest token's embedding (or mostly its position's),
  and the tied head's logits favour the tokens closest to it: how far ahead the top
  token is, against the rounding a packed draft adds, is what sets the share of
  drafted tokens a greedy row keeps. The sweep gives speed against that share.
- the final LayerNorm's gain, with its bias zero, so the logits are the gain times
  those at gain 1: it leaves every greedy choice (the model's and the draft's) as it
  is and sets how peaked the distributions are. It is chosen so the model's mean
  next-token entropy, teacher-forced by transformers on its own greedy continuation,
  is `--entropy` nats (3.1 by default: a calibrated model's mean entropy is its mean
  loss, and GPT-2 small's loss on OpenWebText is 3.1 nats a token, nanoGPT's
  evaluation); the report gives the entropy reached.

The draft (`--draft`) is the checkpoint's own weights in a block type (`q4_0`), or
`layers:N`, its first N blocks with its tables and final norm as a GPT-2 of their own
(a smaller GPT-2 of the same vocabulary, named to the package by path; llama-server
drafts with its F32 GGUF): a draft that costs N layers of the model's and agrees with
it as far as those layers decide the next token.

For each checkpoint and each draft length: `max serve` without a draft (README's CPU
settings), `max serve` with `GPT2_MAX_DRAFT` naming the draft and `GPT2_MAX_DRAFT_TOKENS=<k>`
(its greedy tokens checked equal to the first's; the share of drafted tokens kept, and
how many the pace drafted a round, read from its log, which says each request's as it
ends), `llama-server` on the
F32 GGUF of the same weights without a draft, and with the draft's GGUF as
`--model-draft`, `--spec-draft-n-max k --spec-draft-n-min 0` and its default
`--spec-draft-p-min` (its log gives the share kept, over every request). Each server
answers a warm-up, then `--repeat` greedy requests of the same 16-token prompt and 128
new tokens (`ignore_eos`); the figure is 128 over the request's wall time, median.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import httpx
import llama_cpp_tools
import numpy as np
import torch
from bench_serve import CHECKPOINTS, THREADS, gguf_file, serve
from bench_start import cpu_model
from safetensors.numpy import load_file
from transformers import GPT2Config, GPT2LMHeadModel

from gpt2_max.settings import setting
from gpt2_max.speculate.draft import ENV as DRAFT_ENV
from gpt2_max.testing.reference import random_prompt
from gpt2_max.testing.server import MODEL_NAME
from gpt2_max.tools.checkpoint import preset_config, random_hub_state_dict, save_hub_checkpoint

TOKENS_ENV = setting("draft_tokens").variable
PROMPT = random_prompt(16, seed=2026)
NEW_TOKENS = 128
RECOMMENDED = {"MAX_SERVE_METRIC_RECORDING_METHOD": "NOOP", "GPT2_MAX_BURST_MS": "100"}
"""README's recommended CPU command's environment."""


def peaked_checkpoint(preset: str, selfness: float, entropy: float) -> tuple[Path, dict]:
    """The preset's random checkpoint with the token table scaled by `selfness` and the
    final LayerNorm's gain set for `entropy` nats (see the module doc), written once;
    and what transformers measured of it."""
    folder = CHECKPOINTS / f"speculate-{preset}-self{selfness:g}-H{entropy:g}"
    facts = folder / "peaked.json"
    if facts.exists():
        return folder, json.loads(facts.read_text())
    config = preset_config(preset)
    state = random_hub_state_dict(config, seed=0, std=0.02)
    state["wte.weight"] *= np.float32(selfness)
    state["ln_f.weight"][:] = 1.0
    state["ln_f.bias"][:] = 0.0
    save_hub_checkpoint(folder, config, state)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
            min_new_tokens=NEW_TOKENS, pad_token_id=0,
        )[0]
        logits = model(greedy[None]).logits[0, len(PROMPT) - 1 : -1].double()
    gain = gain_for(logits, entropy)
    state["ln_f.weight"][:] = np.float32(gain)
    save_hub_checkpoint(folder, config, state)
    reached = mean_entropy(logits * gain)
    facts.write_text(json.dumps({"gain": gain, "entropy": reached}))
    return folder, {"gain": gain, "entropy": reached}


def first_layers(folder: Path, n: int) -> Path:
    """The checkpoint's first `n` blocks with its tables and final norm: a smaller GPT-2
    of the same vocabulary, for `GPT2_MAX_DRAFT=<path>` (written once)."""
    out = folder.with_name(f"{folder.name}-first{n}")
    if not (out / "model.safetensors").exists():
        config = GPT2Config.from_pretrained(folder)
        config.n_layer = n
        state = {k: v for k, v in load_file(folder / "model.safetensors").items()
                 if not k.startswith("h.") or int(k.split(".")[1]) < n}
        save_hub_checkpoint(out, config, state)
    return out


def draft_for(folder: Path, kind: str) -> tuple[str, Path]:
    """`GPT2_MAX_DRAFT` for `--draft kind` (a block type, or `layers:N`), and the GGUF
    llama-server drafts with: the same weights in that type, or the smaller GPT-2's F32."""
    if kind.startswith("layers:"):
        smaller = first_layers(folder, int(kind.removeprefix("layers:")))
        return str(smaller), gguf_file(smaller, "f32")
    return kind, gguf_file(folder, kind)


def prepared(preset: str, selfness: float, entropy: float, kind: str) -> tuple[Path, dict]:
    """`peaked_checkpoint`, with the GGUF files both servers read written beside it."""
    folder, facts = peaked_checkpoint(preset, selfness, entropy)
    gguf_file(folder, "f32")
    draft_for(folder, kind)
    return folder, facts


def mean_entropy(logits: torch.Tensor) -> float:
    """Mean entropy in nats of the rows of `logits`."""
    log_p = torch.log_softmax(logits, dim=-1)
    return float(-(log_p.exp() * log_p).sum(-1).mean())


def gain_for(logits: torch.Tensor, entropy: float) -> float:
    """The factor on `logits` whose mean entropy is `entropy` (bisection: entropy falls
    as the factor grows)."""
    low, high = 1e-3, 1e3
    for _ in range(60):
        middle = (low * high) ** 0.5
        if mean_entropy(logits * middle) > entropy:
            low = middle
        else:
            high = middle
    return (low * high) ** 0.5


def max_one(url: str) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
    return list(answer["choices"][0]["token_ids"])


def llama_one(url: str) -> list[int]:
    body = {"prompt": PROMPT, "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
    return list(httpx.post(f"{url}/completion", json=body, timeout=600).json()["tokens"])


def timed(ask, repeat: int) -> tuple[float, object]:
    """Median tokens per second of `repeat` requests after a warm-up, and the last answer."""
    ask()
    rates, answer = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        answer = ask()
        rates.append(NEW_TOKENS / (time.perf_counter() - start))
    return statistics.median(rates), answer


def kept_share(log: str) -> tuple[float | None, float | None]:
    """The share of drafted tokens kept and the tokens drafted a round, over every
    request of the server's log (each says its own as it ends)."""
    found = re.findall(
        r"request \S+: (\d+) of (\d+) drafted tokens kept \(\d+%\) in (\d+) rounds", log
    )
    if not found:
        return None, None
    kept, drafted, rounds = (sum(int(row[i]) for row in found) for i in range(3))
    return kept / max(1, drafted), drafted / rounds


def measure(folder: Path, kind: str, tokens: list[int], repeat: int, scratch: Path) -> dict:
    rows: dict = {}
    with serve(folder, "--max-batch-size", "4", devices="cpu", log=scratch / "plain.log",
               env=RECOMMENDED) as server:
        rows["max"], reference = timed(lambda: max_one(server.url), repeat)
    f32 = gguf_file(folder, "f32")
    ours, draft = draft_for(folder, kind)
    with llama_cpp_tools.server(f32, THREADS, parallel=1, ctx_per_slot=512) as url:
        rows["llama"], _ = timed(lambda: llama_one(url), repeat)
    for k in tokens:
        log = scratch / f"draft{k}.log"
        env = {**RECOMMENDED, DRAFT_ENV: ours, TOKENS_ENV: str(k)}
        with serve(folder, "--max-batch-size", "4", devices="cpu", log=log, env=env) as server:
            rate, answer = timed(lambda: max_one(server.url), repeat)
        rows[f"max draft {k}"] = rate
        rows[f"max draft {k} kept"], rows[f"max draft {k} a round"] = kept_share(log.read_text())
        rows[f"max draft {k} exact"] = answer == reference
        extra = ("--model-draft", str(draft), "--spec-type", "draft-simple",
                 "--spec-draft-n-max", str(k),
                 "--spec-draft-n-min", "0", "-td", str(THREADS))
        llama_log = scratch / f"llama-draft{k}.log"
        with llama_cpp_tools.server(f32, THREADS, parallel=1, ctx_per_slot=512,
                                    extra=extra, log_path=llama_log) as url:
            rows[f"llama draft {k}"], _ = timed(lambda: llama_one(url), repeat)
        found = re.findall(r"draft acceptance = [\d.]+ \(\s*(\d+) accepted / \s*(\d+) generated",
                           llama_log.read_text(errors="replace"))
        rows[f"llama draft {k} kept"] = (
            sum(int(a) for a, _ in found) / max(1, sum(int(n) for _, n in found))
            if found else None
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="gpt2")
    parser.add_argument("--selfness", default="1")
    parser.add_argument("--entropy", type=float, default=3.1)
    parser.add_argument("--draft", default="q4_0")
    parser.add_argument("--tokens", default="4")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tokens = [int(k) for k in args.tokens.split(",")]
    print(f"CPU: {cpu_model()}; one request, 16-token prompt, {NEW_TOKENS} greedy tokens; "
          f"draft {args.draft}; tokens/s = {NEW_TOKENS} / the request's wall time\n")
    header = ["preset", "selfness", "entropy", "max", "llama"]
    for k in tokens:
        header += [f"max d{k}", "kept", "drafted a round", "exact", f"llama d{k}", "kept"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    results = []
    for preset in args.presets.split(","):
        for selfness in (float(s) for s in args.selfness.split(",")):
            # Written in a process of its own: transformers' copy of a large model and
            # the GGUF writer's would otherwise stay in this one's memory, and MAX
            # refuses to start beside them.
            with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
                folder, facts = pool.submit(
                    prepared, preset, selfness, args.entropy, args.draft
                ).result()
            with tempfile.TemporaryDirectory(prefix="gpt2-max-speculate-") as scratch:
                rows = measure(folder, args.draft, tokens, args.repeat, Path(scratch))
            results.append({"preset": preset, "selfness": selfness, **facts, **rows})
            cells = [preset, f"{selfness:g}", f"{facts['entropy']:.2f}",
                     f"{rows['max']:.1f}", f"{rows['llama']:.1f}"]
            for k in tokens:
                share = rows[f"max draft {k} kept"]
                theirs = rows[f"llama draft {k} kept"]
                ours = rows[f"max draft {k}"]
                cells += [f"{ours:.1f} ({ours / rows['max']:.2f}x)",
                          "-" if share is None else f"{share:.0%}",
                          "-" if share is None else f"{rows[f'max draft {k} a round']:.1f}",
                          "yes" if rows[f"max draft {k} exact"] else "NO",
                          f"{rows[f'llama draft {k}']:.1f}",
                          "-" if theirs is None else f"{theirs:.0%}"]
            print("| " + " | ".join(cells) + " |", flush=True)
    out = Path(__file__).parent / "results" / f"speculate-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"(wrote {out})")


if __name__ == "__main__":
    main()
