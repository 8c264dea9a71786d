"""In-process generation (`Generator`): no server, MAX's own pipeline and sampler.

`max serve` never imports this package (nor llguidance, which its grammar
constraints use).
"""

from .generator import Completion, Generator, Options

__all__ = ["Completion", "Generator", "Options"]
