"""GPT-2's GEMMs alone, and its last step's ops, as the graph has them, against torch:
MAX 26.7's bfloat16 GEMMs on NVIDIA sm90 (`docs/max-26.7.md`).

    python3 benchmarks/gpu_head_gemm.py [SECONDS]

First the model's last step alone (`last_step_graph`: the final LayerNorm, the gather
of each sequence's last row and the padded head, fused as the model's graph has them),
its rows taken both ways, with and without every row's logits beside (`LAST_STEPS`),
over ragged batches (`SEQUENCES`); then a block's three GEMMs (`BLOCKS`) at row
counts on both sides of 8; then the head's GEMM. Each head case is a graph
`[M, K] @ [N, K]^T` (N = 50,257, GPT-2's vocabulary, or 50,432, the head padded to
whole 256-column tiles, then cut back to 50,257 as the model does), its output cast to
float32 or not, compiled once and run at several row counts M,
three times each, against torch's float32 product of the same inputs. A line per row
count: the largest error, the rows and first columns that are off, whether the three
runs agree. No case starts after SECONDS; lines go to stdout and `$OUT/head_gemm.txt`.
Off a GPU it runs in float32 on the CPU (a check of the script).
Records: `benchmarks/results/2026-11-29-gpu-h200-third-run.md`,
`benchmarks/results/2026-11-30-gpu-h200-fourth-run.md`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from max.driver import CPU, Accelerator, Buffer, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops

VOCAB, PADDED, WIDTH = 50257, 50432, 768
CASES = [  # (rows N, cut to, cast to float32): the model's graph first, unpadded last
    (PADDED, VOCAB, True),
    (PADDED, None, False),
    (VOCAB, None, True),  # may write out of bounds and end the process's CUDA context
]
ROW_COUNTS = (1, 2, 3, 4, 8, 16, 64, 200)

BLOCKS = {"c_attn": (3 * WIDTH, WIDTH), "c_fc": (4 * WIDTH, WIDTH), "c_proj": (WIDTH, 4 * WIDTH)}
"""A block's GEMMs as `nn.Linear` multiplies them, `[M, K] @ [N, K]^T`, bfloat16 out: (N,
K). modular/modular#6883 reports MAX's plain bfloat16 matmul wrong past 8 rows on an
H100 (26.6 nightlies); a block multiplies every prompt token's row."""
BLOCK_ROW_COUNTS = (1, 2, 8, 9, 16, 64, 130, 216)

SEQUENCES = {"one token": [1], "one prompt": [17], "four prompts": [5, 17, 64, 130],
             "sixteen decodes": [1] * 16}
"""Ragged batches (tokens a sequence) for the model's last step: the final LayerNorm,
the gather of each sequence's last row and the padded head, fused as the graph has
them, with the rows taken either way (`LAST_STEPS`)."""
LAST_STEPS = (("range", True), ("minus-one", True), ("range", False), ("minus-one", False))
"""(rows, every row's logits beside). `range`: `offsets[1:] - range(n, 0, -1)` in int64
(`gpt2.last_rows` on the CPU, 8caa0b1); `minus-one`: `offsets[1:] - 1` in uint32 (MAX's
transformer; the GPU's graph). On the H200 the model's bfloat16 graph chose wrong tokens
with the range form where it also returned every row's logits (echo), and not without
(`benchmarks/results/2026-11-30-gpu-h200-fourth-run.md`)."""


def block_graph(n: int, k: int, dtype: DType, device: DeviceRef) -> Graph:
    inputs = [TensorType(dtype, ["m", k], device=device), TensorType(dtype, [n, k], device=device)]
    with Graph(f"block_{n}_{k}", input_types=inputs) as graph:
        x, w = (value.tensor for value in graph.inputs)
        graph.output(ops.matmul(x, ops.transpose(w, 0, 1)))
    return graph


def last_step_graph(rows: str, all_rows: bool, dtype: DType, device: DeviceRef) -> Graph:
    """`GPT2.logits(gather(h, last rows))` as the model's graph builds it in bfloat16;
    with `all_rows`, also every row's logits as a second output (echo's)."""
    inputs = [
        TensorType(dtype, ["total", WIDTH], device=device),
        TensorType(DType.uint32, ["offsets"], device=device),
        TensorType(DType.int64, [1], device=DeviceRef.CPU()),
        TensorType(DType.float32, [WIDTH], device=device),
        TensorType(DType.float32, [WIDTH], device=device),
        TensorType(dtype, [PADDED, WIDTH], device=device),
    ]
    with Graph(f"last_step_{rows}_{all_rows}", input_types=inputs) as graph:
        h, offsets, n, gamma, beta, w = (value.tensor for value in graph.inputs)
        if rows == "range":
            back = ops.range(n[0], 0, -1, out_dim="n_range", device=device, dtype=DType.int64)
            ends = ops.unsqueeze(ops.cast(offsets[1:], DType.int64), -1)
            index = ops.reshape(ends - back, [-1])
        else:
            index = offsets[1:] - 1

        def logits(x):
            x = ops.cast(ops.layer_norm(ops.cast(x, DType.float32), gamma, beta, 1e-5), dtype)
            return ops.cast(ops.matmul(x, ops.transpose(w, 0, 1))[:, :VOCAB], DType.float32)

        last = logits(ops.gather(h, index, axis=0))
        graph.output(*([last, logits(h)] if all_rows else [last]))
    return graph


def main() -> None:
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else float("inf")
    gpu = accelerator_count() > 0
    device = Accelerator() if gpu else CPU()
    graph_device = DeviceRef.GPU() if gpu else DeviceRef.CPU()
    dtype, torch_dtype = (DType.bfloat16, torch.bfloat16) if gpu else (DType.float32, torch.float32)
    torch_device = "cuda" if gpu else "cpu"
    session = InferenceSession(devices=[device])
    log = (Path(os.environ.get("OUT", "/tmp")) / "head_gemm.txt").open("a")
    began = time.monotonic()

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    def out_of_time() -> bool:
        if time.monotonic() - began > budget:
            say("out of time")
            return True
        return False

    def load(graph: Graph, name: str):
        compiled_at = time.monotonic()
        model = session.load(graph)
        say(f"{name}: compiled in {time.monotonic() - compiled_at:.1f}s")
        return model

    def on_device(t: torch.Tensor) -> Buffer:
        return Buffer.from_dlpack(t.to(torch_device))

    def compare(name: str, model, inputs: list, expected: torch.Tensor) -> None:
        """Three runs of `model` against `expected`: the largest error, the rows and first
        columns more than 5% of the largest product off, whether the runs agree."""
        runs = []
        for _ in range(3):
            if gpu:
                torch.cuda.synchronize()  # torch's writes done before MAX reads
            out = model.execute(*inputs)[0]  # the last rows' logits
            if gpu:
                device.synchronize()
            runs.append(torch.from_dlpack(out).float().cpu())
        error = (runs[0] - expected).abs()
        off = error > 0.05 * expected.abs().max()
        bad_rows = torch.nonzero(off.any(1)).flatten()[:8].tolist()
        columns = torch.nonzero(off[bad_rows[0]]).flatten()[:6].tolist() if bad_rows else []
        say(f"{name}: max error {error.max():.4g} (largest product "
            f"{expected.abs().max():.3g}), rows off {bad_rows} first columns {columns}, "
            f"runs identical {all(torch.equal(runs[0], r) for r in runs[1:])}")

    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(torch_dtype)

    weight = randn(PADDED, WIDTH, scale=0.05)
    weight[VOCAB:] = 0  # the padding rows are zero, as the model's
    gamma = 1 + torch.randn(WIDTH, generator=generator) * 0.1
    beta = torch.randn(WIDTH, generator=generator) * 0.1
    for rows, all_rows in LAST_STEPS:
        if out_of_time():
            return
        name = f"last step, rows {rows}{', all rows beside' if all_rows else ''}"
        model = load(last_step_graph(rows, all_rows, dtype, graph_device), name)
        for label, lengths in SEQUENCES.items():
            h = randn(sum(lengths), WIDTH)
            ends = torch.tensor(lengths).cumsum(0) - 1
            picked = torch.nn.functional.layer_norm(h[ends].float(), (WIDTH,), gamma, beta, 1e-5)
            expected = picked.to(torch_dtype).float() @ weight.float().T[:, :VOCAB]
            offsets = np.array([0, *np.cumsum(lengths)], np.uint32)
            inputs = [on_device(h), Buffer.from_numpy(offsets).to(device),
                      Buffer.from_numpy(np.ones(1, np.int64)), on_device(gamma), on_device(beta),
                      on_device(weight)]
            compare(f"{name}, {label}", model, inputs, expected)

    for label, (n, k) in BLOCKS.items():
        if out_of_time():
            return
        model = load(block_graph(n, k, dtype, graph_device), label)
        weight = randn(n, k, scale=0.05)
        for m in BLOCK_ROW_COUNTS:
            x = randn(m, k)
            compare(f"{label} M={m}", model, [on_device(x), on_device(weight)],
                    x.float() @ weight.float().T)

    for rows, cut, cast in CASES:
        if out_of_time():
            return
        name = f"N={rows} cut={cut} cast={cast}"
        inputs = [TensorType(dtype, ["m", WIDTH], device=graph_device),
                  TensorType(dtype, [rows, WIDTH], device=graph_device)]
        with Graph(f"head_{rows}_{cut}_{cast}", input_types=inputs) as graph:
            h, w = (value.tensor for value in graph.inputs)
            y = ops.matmul(h, ops.transpose(w, 0, 1))
            y = y[:, :cut] if cut else y
            graph.output(ops.cast(y, DType.float32) if cast else y)
        model = load(graph, name)
        weight = randn(rows, WIDTH, scale=0.05)
        weight[VOCAB:] = 0
        for m in ROW_COUNTS:
            h = randn(m, WIDTH)
            compare(f"{name} M={m}", model, [on_device(h), on_device(weight)],
                    (h.float() @ weight.float().T)[:, : cut or rows])


if __name__ == "__main__":
    main()
