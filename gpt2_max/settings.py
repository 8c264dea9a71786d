"""Every setting of the package, in one table, read from the environment once a process.

A setting is an environment variable, `GPT2_MAX_<NAME>` (a copy's own prefix:
`names.env_var`), because `max serve` starts its model worker itself and hands it
nothing of ours but the environment. `settings()` reads them all the first time
any part of the package asks, and refuses a value it cannot use with an error that
names the variable and what it takes, so a typo stops the start instead of being
read as the default. README's table of settings is `SETTINGS`
(`tests/test_settings.py` holds the two equal).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .encodings import PACKED_TYPES
from .names import env_var

MAX_NICE = 19
"""The lowest priority Linux has."""

CPU_DECODE_STEPS = 32
"""Decode steps a pass on the CPU unless `decode_steps` is set (chosen by
`benchmarks/bench_bursts.py`). A burst ends when a request arrives and at the burst
budget (`burst_ms`), so a larger `K` costs neither a new request's first token nor
a stream's wait between chunks more than the budget: it lets short steps pay MAX's
loop more rarely."""


def _one_of(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in options:
            raise ValueError(f"give one of {', '.join(options)}")
        return raw.lower()

    return parse


def _draft(raw: str) -> str:
    if raw.lower() in PACKED_TYPES:
        return raw.lower()
    if Path(raw).expanduser().exists():
        return str(Path(raw).expanduser())
    raise ValueError(
        f"give a block type ({', '.join(sorted(PACKED_TYPES))}) or the path of a GPT-2 "
        "checkpoint folder or GGUF file (none is there)"
    )


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        if not raw.isdigit() or int(raw) < low or (high is not None and int(raw) > high):
            span = f"from {low} to {high}" if high is not None else f"{low} or more"
            raise ValueError(f"give a whole number {span}")
        return int(raw)

    return parse


def _switch(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("give 1 (on) or 0 (off)")
    return raw == "1"


@dataclass(frozen=True)
class Setting:
    """One environment variable: its field in `Settings`, its value when unset, how a
    set value is read, and what README says of it."""

    field: str
    default: Any
    shown: str
    """The default as README's table shows it."""
    parse: Callable[[str], Any]
    what: str

    @property
    def variable(self) -> str:
        return env_var(self.field.upper())

    def read(self, environ: Mapping[str, str]) -> Any:
        raw = environ.get(self.variable, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as error:
            raise ValueError(f"{self.variable}={raw!r}: {error}.") from None


SETTINGS: tuple[Setting, ...] = (
    Setting("layers", "fast", "`fast` on the CPU", _one_of("fast", "plain"),
            "`plain` serves MAX's plain layers on the CPU too, as a GPU always does"),
    Setting("fuse_blocks", True, "`1`", _switch,
            "`0` runs each block as its modules' ops, not one op"),
    Setting("packed_kernel", None, "timed once a CPU", _one_of("max", "package"),
            "`max` or `package`: the kernel for GGUF types both multiply"),
    Setting("float16_lines", None, "timed once a CPU", _switch,
            "`1` holds a one-op block's float16 weights in lines, `0` row-major as loaded"),
    Setting("worker_nice", 10, "`10`", _whole(0, MAX_NICE),
            "nice levels MAX's CPU worker threads run below the thread driving them"),
    Setting("decode_steps", None, f"`{CPU_DECODE_STEPS}` on the CPU, `1` on a GPU", _whole(1),
            "decode steps a pass of MAX's loop (decode bursts); `1` turns bursts off"),
    Setting("burst_ms", 250, "`250`", _whole(1),
            "milliseconds a burst may run before it hands back to MAX's loop"),
    Setting("fast_forward", False, "`0`", _switch,
            "`1` runs tokens a grammar forces without steps of their own"),
    Setting("sampler", "package", "`package` on the CPU", _one_of("package", "max"),
            "`max` samples every row with MAX's sampler graph, as a GPU always does; "
            "`package` greedy rows and rows with no top-k, top-p or min-p with the package's"),
    Setting("draft", None, "unset", _draft,
            "what drafts tokens that the model checks, on the CPU (speculative decoding): "
            "a block type (`q4_0`, `q8_0`, ...), a copy of the model's weights packed in "
            "it at load; or a smaller GPT-2 with the same vocabulary, a checkpoint folder "
            "or GGUF file; unset, no draft"),
    Setting("draft_tokens", 8, "`8`", _whole(1, 16),
            "the most tokens a draft proposes a round before the model checks them "
            "(fewer, or none, where the measured pace says so)"),
    Setting("draft_pace", True, "`1`", _switch,
            "`0` drafts the most tokens every round, whether or not it pays"),
)
"""Every setting, in README's order."""


@dataclass(frozen=True)
class Settings:
    """The settings of this process, as read (`settings()`)."""

    layers: str
    fuse_blocks: bool
    packed_kernel: str | None
    float16_lines: bool | None
    worker_nice: int
    decode_steps: int | None
    burst_ms: int
    fast_forward: bool
    sampler: str
    draft: str | None
    draft_tokens: int
    draft_pace: bool

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> Settings:
        """The settings `environ` gives; raises `ValueError` naming a variable set to
        what it does not take."""
        return cls(**{setting.field: setting.read(environ) for setting in SETTINGS})


def setting(field: str) -> Setting:
    """The `Setting` behind `Settings.<field>`."""
    return next(s for s in SETTINGS if s.field == field)


@functools.cache
def settings() -> Settings:
    """This process's settings, read from its environment the first time it is asked."""
    return Settings.read(os.environ)

