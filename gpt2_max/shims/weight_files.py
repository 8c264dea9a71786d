"""A damaged local weight file named before MAX 26.7 reads its header and says nothing.

MAX picks the encoding of a checkpoint by reading each safetensors header
(`HuggingFaceRepo.supported_encodings`), skips a header it cannot read with a
debug line only, and then refuses the checkpoint with "compatible weights cannot
be found for 'float32'", which names neither the file nor what is wrong with it
(a length field that claims more than the file holds, a header that is not
JSON). The package's own check of weight files (`weights.formats.check_complete`,
also run when the architecture's config is built) names both, so this module
runs it first: it wraps `PipelineConfig._model_with_resolved_weights`, the step
that resolves a model's weights and encoding for its architecture, and hands
the local weight files of a model whose architecture's tokenizer installed a
check to that check, before MAX's own resolution reads them. Other models, and
checkpoints on the hub (which MAX reads through the hub's metadata), are left to
MAX.

The same step finds no weights in a local folder saved in float16 or bfloat16 for
the CPU's float32 graph: given no `--weight-path` and no `--quantization-encoding`,
MAX looks for files of the graph's encoding, falls back only from float32 files to a
half-precision graph, and refuses the folder with the same unnamed "compatible
weights cannot be found"; on a GPU it reads a float16 folder's files as the
`float16` encoding, which the architecture does not declare. The safetensors adapter
widens each tensor to float32 whatever it was saved in, so such a folder needs only
its files named (`half_float_files`), by their full paths: MAX reads no encoding in
such a name, so the graph is the device's default or the one asked for. Whether a
folder was saved in half precision is the architecture's answer, not MAX's encodings:
those count the causal-mask buffers older GPT-2 checkpoints carry, which a folder
saved in float16 often holds as uint8, read by MAX as a 4-bit float encoding.

Installed by `shims.install`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from max.graph.weights import WeightsFormat
from max.pipelines.lib.config.config import PipelineConfig

_CHECKS: dict[type, tuple[Callable[[list[Path]], None], Callable[[list[Path]], bool]]] = {}
"""Per tokenizer type of an architecture, the check its weight files get here and the
question whether they hold a model saved in half precision."""


def local_weight_files(model: Any) -> list[Path]:
    """The weight files of `model` (a `MAXModelConfig`) on this machine: those it names
    (`--weight-path`), else every weight file of its local checkpoint folder."""
    repo = model.huggingface_weight_repo
    if repo.repo_type != "local":
        return []
    folder = Path(repo.local_path)
    if model.weight_path:
        return [folder / path for path in model.weight_path]
    return [folder / name for names in repo.weight_files.values() for name in names]


def half_float_files(model: Any, half_precision: Callable[[list[Path]], bool]) -> list[Path]:
    """The safetensors files of `model`'s local checkpoint folder, by full path, when it
    names none (`--weight-path`) and `half_precision` says its files hold the model
    saved in float16 or bfloat16; else none."""
    repo = model.huggingface_weight_repo
    if model.weight_path or repo.repo_type != "local":
        return []
    files = repo.weight_files
    if set(files) != {WeightsFormat.safetensors}:
        return []
    paths = [Path(repo.local_path) / name for name in files[WeightsFormat.safetensors]]
    return paths if half_precision(paths) else []


def install(
    tokenizer_type: type,
    check: Callable[[list[Path]], None],
    half_precision: Callable[[list[Path]], bool],
) -> None:
    """Runs `check` (which raises naming what is wrong) on the local weight files of
    `tokenizer_type`'s models before MAX resolves them, and names a half-precision
    folder's files (`half_float_files`, asking `half_precision`) for it (patched once)."""
    _CHECKS[tokenizer_type] = (check, half_precision)
    original = PipelineConfig._model_with_resolved_weights
    if getattr(original, "checks_weight_files", False):
        return

    def resolved(model: Any, arch: Any) -> Any:
        if (checks := _CHECKS.get(arch.tokenizer)) is not None:
            check, half_precision = checks
            check(local_weight_files(model))
            if named := half_float_files(model, half_precision):
                model = model.model_copy(update={"weight_path": named})
        return original(model, arch)

    resolved.checks_weight_files = True  # type: ignore[attr-defined]
    PipelineConfig._model_with_resolved_weights = staticmethod(resolved)  # type: ignore[method-assign]
