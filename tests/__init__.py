"""The package's tests. Imported before any test module or conftest, so this is where
the test process's own `PATH` gets its interpreter's folder first, before anything
imports MAX (`gpt2_max.testing.server.path_with_this_interpreter`): the tests then pass
from a venv that is not activated whatever `python3` the shell has."""

import os

from gpt2_max.testing.server import path_with_this_interpreter

os.environ["PATH"] = path_with_this_interpreter()
