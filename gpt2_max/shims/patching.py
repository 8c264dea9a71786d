"""How a shim hands a MAX object's parts to the model: a hook run after the
class's own `__init__`, installed once per process however often it is asked, that
hands a part only to a model that asks for it (`asks`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def asks(model: Any, part: str) -> bool:
    """Whether `model` asks for `part` of MAX (`GPT2PipelineModel.takes`); a model of
    any other architecture does not."""
    takes = getattr(model, "takes", None)
    return callable(takes) and bool(takes(part)) and callable(getattr(model, "hand_over", None))


def after_init(cls: type, marker: str, hook: Callable[[Any], None]) -> None:
    """Runs `hook(obj)` after `cls.__init__` builds each `obj`. `marker` names the
    patch on the patched `__init__`, so a second install is a no-op."""
    original = cls.__init__
    if getattr(original, marker, False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        hook(self)

    setattr(__init__, marker, True)
    cls.__init__ = __init__  # type: ignore[misc]
