"""Which change makes bfloat16 wrong on the GPU: the same greedy requests through MAX's
`AutoModel`, one process per variant (a tree of the package, an encoding, echo on or
off, environment), all at once, each against transformers float32 on the same card.

    PYTHONPATH=$PWD python3 benchmarks/gpu_bisect.py OUT_DIR VARIANT...

A VARIANT is `NAME:TREE[:SETTING,...]`: TREE is a folder holding a `gpt2_max` package
(`.` for this checkout; another revision's with
`mkdir -p .dev/trees/R && git archive R gpt2_max | tar x -C .dev/trees/R`), and each
SETTING is `encoding=float32`, `echo=0`, or `NAME=VALUE` for the worker's environment
(`MODULAR_DEBUG=device-sync-mode`). Each worker runs a batch of the prompts
(`BISECT_LENGTHS`), the same batch again, and each prompt alone, 48 greedy tokens each,
and reports, per prompt, the steps where transformers float32's top-2 margin is above
0.1, which of them chose another token, which of them transformers' own bfloat16 run
would have chosen otherwise, and whether the three runs agree. `OUT_DIR/bisect.json`
and one log per variant are written as each worker ends.
Records: `benchmarks/results/2026-11-29-gpu-h200-third-run.md`,
`benchmarks/results/2026-11-30-gpu-h200-fourth-run.md`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LENGTHS = tuple(int(n) for n in os.environ.get("BISECT_LENGTHS", "5,17,64,130").split(","))
"""Tokens in each prompt (`BISECT_LENGTHS`): a prompt past 128 tokens crosses a KV page."""
NEW_TOKENS = 48
MARGIN = 0.1
VOCAB = 50257


def prompts() -> list[list[int]]:
    import numpy as np

    return [
        np.random.default_rng(8100 + i).integers(0, VOCAB, n).tolist()
        for i, n in enumerate(PROMPT_LENGTHS)
    ]


def clear_and_differing(reference, peer, device: str, prompt: list[int], tokens: list[int]):
    """transformers float32's clear steps after `prompt` along `tokens`, where `tokens`
    holds another token at one of them (step indices), and where transformers'
    own bfloat16 run (`peer`, on the same tokens) picks another token at one of them:
    the peer's misses are what bfloat16 alone costs. Written out here, as `prompts` is,
    rather than taken from `gpt2_max.testing`: a worker's `gpt2_max` is the tree under
    test, an older copy of the package."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits, peer_logits = (
            model(ids).logits[0, len(prompt) - 1 : -1, :VOCAB].double()
            for model in (reference, peer)
        )
    rows = torch.log_softmax(logits, -1)
    top2 = rows.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > MARGIN
    differ = clear & (rows.argmax(-1).cpu() != torch.tensor(tokens)).to(clear.device)
    peer_differ = clear & (peer_logits.argmax(-1) != rows.argmax(-1))
    return (int(clear.sum()), [int(i) for i in torch.nonzero(differ).flatten()],
            [int(i) for i in torch.nonzero(peer_differ).flatten()])


def worker(checkpoint: str, out: str, encoding: str, echo: bool) -> None:
    """One variant: MAX's greedy tokens, checked against transformers float32."""
    import torch
    from max.pipelines import AutoModel
    from transformers import GPT2LMHeadModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    began = time.monotonic()
    model = AutoModel(
        checkpoint, devices="gpu" if device == "cuda" else "cpu",
        max_batch_size=len(PROMPT_LENGTHS),
        custom_architectures=["gpt2_max"], device_memory_utilization=0.1, enable_echo=echo,
        **({} if encoding == "default" else {"quantization_encoding": encoding}),
    )
    loaded = time.monotonic() - began

    def greedy(batch):
        result = model.generate(batch, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True)
        return [list(s[len(p):]) for p, s in zip(batch, result.sequences, strict=True)]

    ps = prompts()
    reference = GPT2LMHeadModel.from_pretrained(checkpoint).to(device).eval()
    peer = GPT2LMHeadModel.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device).eval()
    report = {"encoding": str(model.pipeline_config.model.quantization_encoding),
              "load_s": round(loaded, 1), "runs": {}}
    runs = {}
    for name, run in (("batch", lambda: greedy(ps)), ("again", lambda: greedy(ps)),
                      ("alone", lambda: [greedy([p])[0] for p in ps])):
        runs[name] = run()
        report["runs"][name] = [
            dict(zip(("clear", "differing_steps", "transformers_bfloat16_differing"),
                     clear_and_differing(reference, peer, device, p, t), strict=True))
            for p, t in zip(ps, runs[name], strict=True)
        ]
        Path(out).write_text(json.dumps(report))  # each run as it ends: a cut call keeps it
    report["batch_equals_again"] = runs["batch"] == runs["again"]
    report["batch_equals_alone"] = [
        a == b for a, b in zip(runs["batch"], runs["alone"], strict=True)
    ]
    model.close()
    Path(out).write_text(json.dumps(report))


def parse(variant: str) -> tuple[str, Path, dict[str, str], str, bool]:
    name, tree, *rest = variant.split(":", 2)
    env, encoding, echo = {}, "default", True
    for setting in (rest[0].split(",") if rest and rest[0] else []):
        key, value = setting.split("=", 1)
        if key == "encoding":
            encoding = value
        elif key == "echo":
            echo = value not in ("0", "false")
        else:
            env[key] = value
    return name, Path(tree).resolve(), env, encoding, echo


def main() -> None:
    out, variants = Path(sys.argv[1]), sys.argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "checkpoint"
    if not (checkpoint / "config.json").exists():
        from gpt2_max.testing.reference import random_state_dict
        from gpt2_max.tools.checkpoint import preset_config, save_hub_checkpoint

        config = preset_config(os.environ.get("BISECT_PRESET", "gpt2"))
        save_hub_checkpoint(checkpoint, config, random_state_dict(config, seed=3, std=0.05))
    # Each worker finds `gpt2_max` in its tree first, and MAX where this process does;
    # never this checkout's package (unless the tree is this checkout).
    checkout = Path(__file__).resolve().parents[1]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(":")
            if p and Path(p).resolve() != checkout]
    running = {}
    for variant in variants:
        name, tree, env, encoding, echo = parse(variant)
        result = out / f"{name}.json"
        command = [sys.executable, __file__, "--worker", str(checkpoint), str(result),
                   encoding, "1" if echo else "0"]
        child_env = {**os.environ, **env, "PYTHONPATH": ":".join([str(tree), *rest])}
        log = open(out / f"{name}.log", "w")  # noqa: SIM115 (closed below)
        running[name] = (subprocess.Popen(command, env=child_env, stdout=log,
                                          stderr=subprocess.STDOUT), log, result)
    summary = {}
    for name, (process, log, result) in running.items():
        process.wait()
        log.close()
        summary[name] = (json.loads(result.read_text()) if result.exists()
                         else {"error": f"exit {process.returncode}"})
        (out / "bisect.json").write_text(json.dumps(summary, indent=1))
        print(name, json.dumps(summary[name])[:400], flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1")
    else:
        main()
