"""The kernel each packed type gets on this CPU: named by the setting, or measured once
and read back; and both kernels exact on every type MAX's covers, whichever wins here."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import namedtuple
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from gguf import GGMLQuantizationType, quants
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession

from gpt2_max.encodings import BLOCK_FLAGS
from gpt2_max.gguf.quants import quantize
from gpt2_max.layers import kernel_choice
from gpt2_max.layers.fast import FastLayers
from gpt2_max.layers.kernel_choice import KERNEL_ENV, Choice, choice, uses_max_kernel
from gpt2_max.settings import setting, settings
from gpt2_max.testing.server import child_env
from gpt2_max.weights.plan import WeightPlan
from gpt2_max.weights.schema import HEAD_WEIGHT, PROJECTIONS
from tests.kernels.test_kquant import float_atol, int8_atol

pytestmark = pytest.mark.tier("unit")


@pytest.fixture
def fresh(measured_afresh):
    return measured_afresh(KERNEL_ENV, choice)


def test_a_named_kernel_is_taken_without_measuring(fresh, monkeypatch):
    monkeypatch.setattr(kernel_choice, "measure", lambda e: pytest.fail("measured"))
    for named, on_max in (("max", True), ("package", False)):
        monkeypatch.setenv(KERNEL_ENV, named)
        choice.cache_clear()
        settings.cache_clear()
        assert uses_max_kernel("q6_k") is on_max
        assert KERNEL_ENV in choice("q6_k").why


def test_types_max_has_no_kernel_for_go_to_the_package_unmeasured(fresh, monkeypatch):
    monkeypatch.setattr(kernel_choice, "measure", lambda e: pytest.fail("measured"))
    assert not any(uses_max_kernel(t) for t in ("q5_k", "q5_0", "q5_1", "q8_0"))


def test_a_measurement_is_kept_per_type_and_read_back_by_later_starts(fresh, monkeypatch):
    measured = []

    def measure(encoding):
        measured.append(encoding)
        return Choice("package" if encoding == "q6_k" else "max", {}, "timed")

    monkeypatch.setattr(kernel_choice, "measure", measure)
    assert not uses_max_kernel("q6_k")
    assert uses_max_kernel("q4_k")
    assert measured == ["q6_k", "q4_k"]
    assert json.loads(fresh.read_text())["q6_k"]["kernel"] == "package"
    choice.cache_clear()  # a later start: the file answers
    assert not uses_max_kernel("q6_k") and uses_max_kernel("q4_k")
    assert measured == ["q6_k", "q4_k"]


def test_a_measurement_under_load_serves_its_start_and_is_timed_again(
    fresh, monkeypatch, caplog
):
    """A choice timed while other processes took the cores is not kept: the next start
    measures again, and keeps what it measures on a quiet CPU."""
    busy = iter((0.4, 0.02))
    monkeypatch.setattr(kernel_choice, "measure", lambda e: Choice(
        "max", {}, "timed", busy=next(busy)))
    with caplog.at_level("WARNING", logger="max.pipelines"):
        assert uses_max_kernel("q4_k")
    assert "took 40% of the CPU" in caplog.text
    assert not fresh.exists()
    choice.cache_clear()  # a later start
    assert uses_max_kernel("q4_k")
    assert json.loads(fresh.read_text())["q4_k"]["busy"] == 0.02
    choice.cache_clear()
    assert uses_max_kernel("q4_k")  # read back: `busy` is spent


def test_a_draft_takes_the_faster_decode_step_and_a_named_kernel_for_both(fresh, monkeypatch):
    """A draft's one-row steps weigh the decode figures alone: MAX's kernel serves the
    request sooner here, the package's steps one row faster by more than the margin."""
    ms = chains((5.4, 35.0), (4.8, 100.0))
    monkeypatch.setattr(kernel_choice, "measure", lambda e: Choice("max", ms, "timed"))
    assert uses_max_kernel("q4_0") and not uses_max_kernel("q4_0", "decode")
    assert "few rows a step: package's kernel" in choice("q4_0").describe("q4_0", "decode")
    near = chains((5.0, 35.0), (4.8, 99.0))
    assert Choice("max", near, "timed").kernel_for("decode") == "max"  # within the margin
    monkeypatch.setenv(KERNEL_ENV, "max")
    choice.cache_clear()
    settings.cache_clear()
    assert uses_max_kernel("q4_0", "decode")


def chains(max_ms: tuple[float, float], package_ms: tuple[float, float]) -> dict:
    """Both kernels' chain times, (decode, prefill) milliseconds each."""
    return {k: dict(zip(("decode", "prefill"), v, strict=True))
            for k, v in (("max", max_ms), ("package", package_ms))}


@pytest.mark.parametrize(("max_ms", "package_ms", "kernel", "reason"), [
    # A request of 900 + 128 tokens: 128 decode steps, 900 / 64 prefill chunks.
    ((4.0, 30.0), (3.0, 45.0), "package", "the request level, the decode step faster"),
    ((4.0, 30.0), (3.8, 31.0), "max", "the request and the decode step level, MAX's kept"),
    ((4.0, 30.0), (3.0, 60.0), "max", "the request sooner"),
    ((6.0, 40.0), (4.0, 40.0), "package", "the request sooner"),
])
def test_the_request_decides_and_where_it_is_level_the_decode_step(
    max_ms, package_ms, kernel, reason
):
    picked = kernel_choice.pick(chains(max_ms, package_ms))
    assert picked.kernel == kernel
    assert picked.why.endswith(reason)


def test_a_last_token_head_takes_the_few_rows_kernel_and_the_rest_the_requests(
    fresh, monkeypatch
):
    """MAX's kernel serves the request sooner here, the package's steps a few rows
    faster: the blocks' projections take MAX's, a last-token head the package's."""
    ms = chains((5.4, 35.0), (4.8, 100.0))
    monkeypatch.setattr(kernel_choice, "measure", lambda e: Choice("max", ms, "timed"))
    plan = WeightPlan(packed={"h.0.mlp.c_fc.weight": "q6_k", HEAD_WEIGHT: "q6_k"})
    config = SimpleNamespace(weights=dataclasses.replace(plan, few_rows={HEAD_WEIGHT}))
    layers = FastLayers(config)
    assert layers.linear("h.0.mlp.c_fc", 768, 3072).max_kernel
    assert not layers.linear("lm_head", 768, 50257, bias=False).max_kernel
    config.weights = plan  # every row's logits (echo): the head multiplies a prefill too
    assert layers.linear("lm_head", 768, 50257, bias=False).max_kernel


@pytest.mark.parametrize(("max_ms", "package_ms", "fused"), [
    ((4.0, 30.0), (3.8, 31.0), True),  # level: MAX's keeps the type, the block one op
    ((5.4, 35.0), (4.8, 100.0), False),  # MAX's serves the request sooner
])
def test_a_block_is_one_op_unless_maxs_kernel_serves_the_request_sooner(
    fresh, monkeypatch, max_ms, package_ms, fused
):
    """A block whose projections are all packed is one op (`FusedBlock`), running the
    package's kernel, where that kernel is level with MAX's on the request or ahead;
    composed of its modules (`GPT2_MAX_FUSE_BLOCKS=0`, or MAX's decisively faster), its
    weights take the request's choice."""
    ms = chains(max_ms, package_ms)
    monkeypatch.setattr(kernel_choice, "measure", lambda e: kernel_choice.pick(ms))
    names = [f"h.0.{p}" for p in PROJECTIONS]
    plan = WeightPlan(packed={f"{n}.weight": "q4_k" for n in names})
    config = SimpleNamespace(weights=plan, activation="gelu_tanh", dtype=DType.float32)
    layers = FastLayers(config)
    assert choice("q4_k").kernel == "max"
    assert layers.fuses(0) is fused
    assert {layers.work_of(f"{n}.weight") for n in names} == {"block" if fused else "request"}
    assert all(layers.linear(n, 768, 768).max_kernel is not fused for n in names)
    assert choice("q4_k").one_op("request") is fused
    monkeypatch.setenv(setting("fuse_blocks").variable, "0")
    settings.cache_clear()
    assert not layers.fuses(0)
    assert all(layers.linear(n, 768, 768).max_kernel for n in names)


@pytest.mark.parametrize(("op_ms", "fused"), [(0.02, True), (0.005, False), (0.0, False)])
def test_a_block_is_one_op_where_the_ops_boundaries_outweigh_maxs_lead(op_ms, fused):
    """MAX's kernel serves the request 18% sooner and steps one row 25% faster than
    the package's chain of ops; inside one op, without 48 boundaries of `op_ms` each, the
    package's is within the margin at 0.02 ms an op and still behind at 0.005."""
    picked = dataclasses.replace(kernel_choice.pick(chains((4.0, 30.0), (5.0, 33.0))), op_ms=op_ms)
    assert picked.kernel == "max"
    inside = picked.in_block()
    assert inside == {"decode": pytest.approx(5.0 - kernel_choice.CHAIN_OPS * op_ms),
                      "prefill": 33.0}
    assert picked.one_op("request") is fused
    assert picked.one_op("decode") is fused
    assert picked.kernel_for("request") == "max"  # composed, a weight takes MAX's


def test_a_former_measurements_cache_is_not_read(monkeypatch):
    """Choices kept by a measurement without `op_ms` would decide blocks as before it:
    the measurement's version is in the cache's name."""
    path = kernel_choice.cache_file()
    monkeypatch.setattr(kernel_choice, "FORMAT", kernel_choice.FORMAT - 1)
    assert kernel_choice.cache_file() != path


@pytest.mark.parametrize(("max_ms", "package_ms", "request_op", "draft_op"), [
    # MAX's serves the request sooner, the package's steps one row faster.
    ((5.4, 35.0), (4.8, 100.0), False, True),
    # MAX's steps one row faster by the margin, the package's prefills much faster.
    ((4.0, 60.0), (4.8, 30.0), True, False),
])
def test_a_drafts_block_weighs_its_decode_steps_and_a_served_models_the_request(
    fresh, monkeypatch, max_ms, package_ms, request_op, draft_op
):
    """A draft multiplies one row a step, so its block is one op unless MAX's kernel
    steps one row faster; a served model's block weighs the whole request."""
    ms = chains(max_ms, package_ms)
    monkeypatch.setattr(kernel_choice, "measure", lambda e: kernel_choice.pick(ms))
    names = [f"h.0.{p}.weight" for p in PROJECTIONS]
    for work, fused in (("request", request_op), ("decode", draft_op)):
        plan = WeightPlan(packed=dict.fromkeys(names, "q4_k"), work=work)
        layers = FastLayers(
            SimpleNamespace(weights=plan, activation="gelu_tanh", dtype=DType.float32)
        )
        assert layers.fuses(0) is fused, work
        assert all(layers.work_of(n) == ("block" if fused else work) for n in names)


def test_a_q5_k_block_is_one_op_and_a_mixed_one_follows_its_types_max_has_a_kernel_for(
    fresh, monkeypatch
):
    """Q5_K (no MAX kernel) in a block of Q4_K weights that MAX's kernel serves sooner:
    the block is composed, its Q5_K on the package's kernel; alone, Q5_K is one op."""
    ms = chains((5.4, 35.0), (4.8, 100.0))
    monkeypatch.setattr(kernel_choice, "measure", lambda e: kernel_choice.pick(ms))
    mixed = dict(zip([f"h.0.{p}.weight" for p in PROJECTIONS],
                     ("q5_k", "q4_k", "q4_k", "q6_k"), strict=True))
    config = SimpleNamespace(weights=WeightPlan(packed=mixed), activation="gelu_tanh",
                             dtype=DType.float32)
    assert not FastLayers(config).fuses(0)
    assert not FastLayers(config).linear("h.0.attn.c_attn", 768, 2304).max_kernel
    config.weights = WeightPlan(packed=dict.fromkeys(mixed, "q5_k"))
    assert FastLayers(config).fuses(0)


@pytest.mark.tier("model")
def test_the_measurement_picks_by_the_request_then_the_decode_step():
    picked = kernel_choice.measure("q4_0", rounds=1)
    cost = {
        k: kernel_choice.REQUEST[1] * ms["decode"]
        + kernel_choice.REQUEST[0] / kernel_choice.PREFILL_ROWS * ms["prefill"]
        for k, ms in picked.ms.items()
    }
    step = {k: ms["decode"] for k, ms in picked.ms.items()}
    assert set(cost) == {"max", "package"} and all(c > 0 for c in cost.values())
    margin = kernel_choice.MARGIN
    if cost["package"] * margin < cost["max"]:
        expected = "package"
    elif cost["max"] * margin < cost["package"]:
        expected = "max"
    else:
        expected = "package" if step["package"] * margin < step["max"] else "max"
    assert picked.kernel == expected
    assert "measured" in picked.why
    assert 0 <= picked.busy < 1
    # An op's boundary: the cut chain's extra time per op, less than a whole op's time.
    assert 0 <= picked.op_ms < picked.ms["package"]["decode"] / kernel_choice.CHAIN_OPS


def test_others_busy_counts_the_cpus_this_process_may_use_less_its_own_time(monkeypatch):
    """Of two CPUs this process may run on (a third is not its), over 2 s: 3.2 s busy,
    1.0 s of it this process's, 0.5 s guest time already inside user: 2.2 of 4 CPU
    seconds went to other processes."""
    cpu = namedtuple("cpu", "user nice system idle iowait guest guest_nice")
    samples = iter([
        [cpu(10, 0, 5, 100, 1, 0, 0), cpu(20, 0, 5, 90, 0, 0, 0), cpu(0, 0, 0, 500, 0, 0, 0)],
        [cpu(11.5, 0, 5.3, 100.2, 1, 0.5, 0), cpu(21.4, 0, 5, 90.6, 0.1, 0, 0),
         cpu(9, 0, 0, 500, 0, 0, 0)],
    ])
    clock = iter([50.0, 52.0])
    own = iter([SimpleNamespace(user=3.0, system=1.0), SimpleNamespace(user=3.8, system=1.2)])
    process = SimpleNamespace(cpu_affinity=lambda: [0, 1], cpu_times=lambda: next(own))
    monkeypatch.setattr(kernel_choice.psutil, "Process", lambda: process)
    monkeypatch.setattr(kernel_choice.psutil, "cpu_times", lambda percpu: next(samples))
    monkeypatch.setattr(kernel_choice.time, "monotonic", lambda: next(clock))
    busy = kernel_choice.OthersBusy()
    # busy: CPU 0 +1.5 user +0.3 system (the 0.5 guest is inside user), CPU 1 +1.4 user.
    assert busy.share() == pytest.approx((3.2 - 1.0) / 4)


@pytest.mark.tier("model")
def test_the_measurement_sees_other_processes_take_the_cpu():
    """Two processes spinning on this CPU's cores while the kernels are timed: the
    measurement says they took a share past `BUSY_LIMIT`, so its choice is not kept."""
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin, env=child_env()) for _ in range(psutil.cpu_count() or 1)]
    try:
        picked = kernel_choice.measure("q4_0", rounds=1)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert picked.busy > kernel_choice.BUSY_LIMIT


@pytest.mark.tier("model")
@pytest.mark.parametrize("encoding", sorted(BLOCK_FLAGS))
@pytest.mark.parametrize("kernel", kernel_choice.KERNELS)
def test_either_kernel_matches_numpy_on_dequantized_weights(encoding, kernel):
    """Both kernels serve these types on some CPU, so both are checked on every CPU,
    against one int8 rounding of x per block (MAX's; the package's rounds finer)."""
    qtype = GGMLQuantizationType[encoding.upper()]
    rng = np.random.default_rng(11)
    blocks = quantize(rng.standard_normal((kernel_choice.FF, kernel_choice.D), np.float32), qtype)
    w = quants.dequantize(blocks, qtype).astype(np.float64)
    [held] = kernel_choice.held(encoding, kernel, [blocks])
    session = InferenceSession(devices=[CPU()])
    model = session.load(kernel_choice.chain(encoding, kernel, [held]))
    for m in (1, 5, 64):
        x = rng.standard_normal((m, kernel_choice.D), dtype=np.float32)
        got = model.execute(Buffer.from_numpy(x), Buffer.from_numpy(held))[0].to_numpy()
        exact = x.astype(np.float64) @ w.T
        block = 32 if encoding == "q4_0" else 256
        atol = float_atol(kernel_choice.D) + int8_atol(x, w, block)
        assert np.all(np.abs(got - exact) <= atol), f"rows {m}"
