"""The packed-weight kernels at a few rows: the package's (`kernels/mojo/kquant.mojo`,
blocks laid out as `kernels.interleave` lays them at load; in each arithmetic `--dots`
names, `kernels.DOTS`) against MAX's `qmatmul` (its `vroom` kernels, blocks repacked at
load, 8-bit activations), per GGUF block type.

    PYTHONPATH=. python benchmarks/bench_packed.py     # nothing else running
    PYTHONPATH=. python benchmarks/bench_packed.py --types q4_k --layers 36
    PYTHONPATH=. python benchmarks/bench_packed.py --rows 64 --dots auto,int8x2

Each graph chains `--layers` pairs of GPT-2's MLP projections (768 -> 3072 -> 768)
on random weights quantized to the type, `--rows` input rows. At the default 12 layers the
weights (32-46 MB) sit mostly in the 32 MiB L3 of the CPUs at hand, so the figure is
each kernel's arithmetic; at 36 they stream from memory. The kernels run in
alternating rounds (median of each round, then the median and best round), so
drift on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_start import cpu_model
from gguf import GGMLQuantizationType
from max.driver import CPU, Buffer
from max.engine import InferenceSession

from gpt2_max.encodings import BLOCK_FLAGS
from gpt2_max.gguf.quants import quantize
from gpt2_max.layers import kernel_choice

D, FF = kernel_choice.D, kernel_choice.FF


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="q4_k,q5_k,q6_k")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--dots", default="auto",
                        help="the package's arithmetics to run (kernels.DOTS; auto is "
                        "what the model runs)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    session = InferenceSession(devices=[CPU()])
    runs = {}
    for encoding in args.types.split(","):
        qtype = GGMLQuantizationType[encoding.upper()]
        blocks = [
            quantize(rng.standard_normal(shape, dtype=np.float32), qtype)
            for _ in range(args.layers) for shape in ((FF, D), (D, FF))
        ]
        nbytes = sum(b.nbytes for b in blocks)
        package = kernel_choice.held(encoding, "package", blocks)
        variants = {dot: package for dot in args.dots.split(",")}
        if encoding in BLOCK_FLAGS:
            variants["max"] = kernel_choice.held(encoding, "max", blocks)
        for name, weights in variants.items():
            kernel = "max" if name == "max" else "package"
            model = session.load(kernel_choice.chain(encoding, kernel, weights, dot=name))
            buffers = [Buffer.from_numpy(np.ones((args.rows, D), np.float32))]
            buffers += [Buffer.from_numpy(np.ascontiguousarray(w)) for w in weights]
            runs[encoding, name] = (model, buffers, nbytes)
    rounds: dict = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, (model, buffers, _) in runs.items():
            for _ in range(3):
                model.execute(*buffers)
            times = []
            for _ in range(40):
                start = time.perf_counter()
                model.execute(*buffers)
                times.append(time.perf_counter() - start)
            rounds[key].append(statistics.median(times))
    print(f"CPU: {cpu_model()}; {args.rows} row(s) through {args.layers} x "
          f"({D} -> {FF} -> {D}); ms per chain, GB/s of weights")
    print(f"{'type':6} {'kernel':9} {'MB':>6} {'median ms':>10} {'GB/s':>6} "
          f"{'best ms':>8} {'GB/s':>6}")
    for (encoding, name), times in rounds.items():
        nbytes = runs[encoding, name][2]
        med, best = statistics.median(times), min(times)
        print(f"{encoding:6} {name:9} {nbytes / 1e6:6.1f} {med * 1e3:10.3f} "
              f"{nbytes / med / 1e9:6.1f} {best * 1e3:8.3f} {nbytes / best / 1e9:6.1f}")
    print("The model's kernel for each type on this CPU (layers/kernel_choice.py), for a")
    print("served request's weights and for those multiplying a few rows a step (a")
    print("last-token LM head, a draft), and whether a block of the type is one op:")
    for encoding in args.types.split(","):
        if encoding not in BLOCK_FLAGS:
            print(f"  {encoding} weights: package's kernel (MAX has none for {encoding}); "
                  "a block one op")
            continue
        choice = kernel_choice.choice(encoding)
        for work in ("request", "decode"):
            print(f"  {choice.describe(encoding, work)}")
        how = {True: "one op", False: "composed on MAX's kernel"}
        boundaries = (f" (an op of the package's kernel costs a one-row step "
                      f"{choice.op_ms * 1e3:.0f} us beyond its bytes, which the decision "
                      "takes off its projections inside the op)" if choice.ms else "")
        print(f"  {encoding} blocks: {how[choice.one_op('request')]} in a served model, "
              f"{how[choice.one_op('decode')]} in a draft{boundaries}")


if __name__ == "__main__":
    main()
