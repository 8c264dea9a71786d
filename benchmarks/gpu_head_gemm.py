"""GPT-2's LM head GEMM alone, as the graph multiplies it, against torch: MAX 26.7's
bfloat16 GEMM on NVIDIA sm90 at the head's widths (`docs/max-26.7.md`).

    python3 benchmarks/gpu_head_gemm.py [SECONDS]

Each case is a graph `[M, K] @ [N, K]^T` (N = 50,257, GPT-2's vocabulary, or 50,432,
the head padded to whole 256-column tiles, then cut back to 50,257 as the model does),
its output cast to float32 or not, compiled once and run at several row counts M,
three times each, against torch's float32 product of the same inputs. A line per row
count: the largest error, the rows and first columns that are off, whether the three
runs agree. No case starts after SECONDS; lines go to stdout and `$OUT/head_gemm.txt`.
Off a GPU it runs in float32 on the CPU (a check of the script).
Record: `benchmarks/results/2026-11-29-gpu-h200-third-run.md`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

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

    generator = torch.Generator().manual_seed(0)
    for rows, cut, cast in CASES:
        if time.monotonic() - began > budget:
            say("out of time")
            break
        name = f"N={rows} cut={cut} cast={cast}"
        inputs = [TensorType(dtype, ["m", WIDTH], device=graph_device),
                  TensorType(dtype, [rows, WIDTH], device=graph_device)]
        with Graph(f"head_{rows}_{cut}_{cast}", input_types=inputs) as graph:
            h, w = (value.tensor for value in graph.inputs)
            y = ops.matmul(h, ops.transpose(w, 0, 1))
            y = y[:, :cut] if cut else y
            graph.output(ops.cast(y, DType.float32) if cast else y)
        compiled_at = time.monotonic()
        model = session.load(graph)
        say(f"{name}: compiled in {time.monotonic() - compiled_at:.1f}s")
        weight = (torch.randn(rows, WIDTH, generator=generator) * 0.05).to(torch_dtype)
        weight[VOCAB:] = 0  # the padding rows are zero, as the model's
        weight = weight.to(torch_device)
        for m in ROW_COUNTS:
            h = torch.randn(m, WIDTH, generator=generator).to(torch_dtype).to(torch_device)
            expected = (h.float() @ weight.float().T)[:, : cut or rows].cpu()
            runs = []
            for _ in range(3):
                if gpu:
                    torch.cuda.synchronize()  # torch's writes done before MAX reads
                (out,) = model.execute(Buffer.from_dlpack(h), Buffer.from_dlpack(weight))
                if gpu:
                    device.synchronize()
                runs.append(torch.from_dlpack(out).float().cpu())
            error = (runs[0] - expected).abs()
            off = error > 0.05 * expected.abs().max()
            bad_rows = torch.nonzero(off.any(1)).flatten()[:8].tolist()
            columns = torch.nonzero(off[bad_rows[0]]).flatten()[:6].tolist() if bad_rows else []
            say(f"{name} M={m}: max error {error.max():.4g} (largest product "
                f"{expected.abs().max():.3g}), rows off {bad_rows} first columns {columns}, "
                f"runs identical {all(torch.equal(runs[0], r) for r in runs[1:])}")


if __name__ == "__main__":
    main()
