"""llama.cpp as a peer in the benchmark: greedy decoding of the same prompts, same threads.

Uses `llama-cpp-python` (an optional extra: `pip install llama-cpp-python` builds llama.cpp
from source) through its C API, so several sequences decode in one batch the way
llama.cpp's own server runs parallel slots: one `llama_decode` per step with one token
per sequence. Greedy means the argmax of the logits, as HF and MAX are asked for.

llama.cpp runs in its most accurate CPU setting by default (float32 K/V, no flash
attention; `flash_attn=True` gives back its default, faster at long prefills), and
still is not float32-exact: its GELU reads a float16 lookup table (`GGML_GELU_FP16`,
defined in ggml's CPU source, not a runtime option), so its logits differ from HF's by
far more than summation order does and its greedy tokens part from HF's where MAX's do
not. `logit_gap` measures that difference teacher-forced, for the benchmark's report to
show beside its MISMATCH tallies.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _ignore_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp logs every tensor it loads; the benchmark reports its own figures."""


def _argmax(logits: np.ndarray) -> int:
    return int(logits.argmax())


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCpp:
    """One model and context for up to `max_seqs` sequences of `n_ctx` tokens in all."""

    def __init__(
        self, gguf: Path, *, threads: int, n_ctx: int, max_seqs: int, flash_attn: bool = False
    ) -> None:
        import llama_cpp as lc

        self.lc = lc
        self._quiet = lc.llama_log_callback(_ignore_log)  # kept alive as long as the model
        lc.llama_log_set(self._quiet, ctypes.c_void_p(0))
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = min(n_ctx, 1024)
        params.n_seq_max = max_seqs
        params.kv_unified = True  # sequences share the whole context, as MAX's paged cache does
        # float32 keys and values (llama.cpp defaults to float16), as MAX and HF keep them.
        params.type_k = params.type_v = lc.GGML_TYPE_F32
        # Its CPU flash attention (on by default) adds error of its own; the plain path
        # is llama.cpp's closest to exact arithmetic, and slower at long prefills.
        params.flash_attn_type = (
            lc.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = params.n_batch
        self.batch = lc.llama_batch_init(self.n_batch, 0, max_seqs)

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _decode(
        self, entries: list[tuple[int, int, int, bool]], read: Callable[[np.ndarray], Any]
    ) -> list[Any]:
        """Decodes (token, position, sequence, wants_logits) rows; `read` of each wanted
        row of logits (a view into llama.cpp's buffer, valid until the next decode)."""
        batch, picks = self.batch, []
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i] = token, pos
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
                batch.logits[i] = logits
            batch.n_tokens = len(chunk)
            if self.lc.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (*_, logits) in enumerate(chunk):
                if logits:
                    row = self.lc.llama_get_logits_ith(self.ctx, i)
                    values = np.ctypeslib.as_array(
                        ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
                    )
                    picks.append(read(values))
        return picks

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def logits(self, tokens: list[int]) -> np.ndarray:
        """The next-token logits after every prefix of `tokens`, one sequence, `[len, vocab]`."""
        self._clear()
        entries = [(token, pos, 0, True) for pos, token in enumerate(tokens)]
        return np.stack(self._decode(entries, np.copy))

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """All prompts prefilled together, then one batched step per new token.

        Returns each sequence's new tokens, the wall time, and the time of the first token.
        """
        self._clear()
        start = time.perf_counter()
        entries = [
            (token, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        last = self._decode(entries, _argmax)
        first_token = time.perf_counter() - start
        out = [[token] for token in last]
        for step in range(1, max_tokens):
            last = self._decode([
                (token, len(prompt) + step - 1, seq, True)
                for seq, (prompt, token) in enumerate(zip(prompts, last, strict=True))
            ], _argmax)
            for seq, token in enumerate(last):
                out[seq].append(token)
        return {"tokens": out, "wall": time.perf_counter() - start, "ttft": first_token}


def logit_gap(
    peer: LlamaCpp, tokens: list[int], reference: np.ndarray, positions: list[int]
) -> dict:
    """llama.cpp's next-token logits after every prefix of `tokens` against `reference`
    (HF's, `[len(tokens), vocab]`), teacher-forced so both engines see the same prefixes:
    the max |difference| at `positions` and its median over all, beside the spread of
    HF's logits (what a difference is large against) and how often the argmaxes agree."""
    ours = peer.logits(tokens)[:, : reference.shape[1]]
    gap = np.abs(ours - reference).max(axis=1)
    return {
        "tokens": len(tokens),
        "max_abs_diff_at": {p: float(gap[p]) for p in positions},
        "median_max_abs_diff": float(np.median(gap)),
        "reference_logit_std": float(reference.std()),
        "argmax_agreement": float(np.mean(ours.argmax(1) == reference.argmax(1))),
    }
