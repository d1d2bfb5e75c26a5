"""``unpack-trainer env``: what a bug report needs, as ``trl env`` / ``accelerate env`` print it.

The versions of python, torch and the Hugging Face libraries, of every optional kernel package, the devices, and
for a given ``--model`` (a local model folder or a ``model_type`` such as ``llama``, built tiny from its config by
:mod:`unpack_trainer.model_zoo.tiny`) whether :func:`unpack_trainer.models.patch_model` takes it or refuses it (and why),
which packed attention backend it would take with float32 weights, bfloat16 weights and float32 weights under
bfloat16 autocast, and the path of each token mixer. The model is built on the ``meta`` device: no weights, no memory.
The text is markdown, to paste into an issue; ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from unpack_trainer.cli.commands import CLIError, add_command_parser, one_line

__all__ = ["OPTIONAL_PACKAGES", "PACKAGES", "add_command", "environment", "format_environment", "model_report"]

# (name shown, distribution names tried in order)
PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("torch",)),
    ("transformers", ("transformers",)),
    ("TRL", ("trl",)),
    ("PEFT", ("peft",)),
    ("accelerate", ("accelerate",)),
    ("datasets", ("datasets",)),
    ("tokenizers", ("tokenizers",)),
    ("numpy", ("numpy",)),
)
# Besides the optional kernels of the attention backends, each declared by its backend's record
# (unpack_trainer.patches.attention.REGISTRY: its kernel's ``distributions``).
OPTIONAL_PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("flash-linear-attention", ("flash-linear-attention",)),
    ("fla-core", ("fla-core",)),
    ("causal-conv1d", ("causal-conv1d", "causal_conv1d")),
    ("mamba-ssm", ("mamba-ssm", "mamba_ssm")),
    ("triton", ("triton", "pytorch-triton")),
    ("bitsandbytes", ("bitsandbytes",)),
    ("liger-kernel", ("liger-kernel", "liger_kernel")),
    ("kernels", ("kernels",)),
    ("deepspeed", ("deepspeed",)),
)
NOT_INSTALLED = "not installed"

_HELP = "print versions, devices, kernels and what the patch does with a model (for bug reports)"
_DESCRIPTION = """\
Print the versions, devices and kernels that decide how unpack_trainer packs, to paste into a bug report. With
--model, also what the patch does with that model: patched or refused (and why), the packed attention backend it
would take in float32, bfloat16, and float32 under bfloat16 autocast (TRL's default on a GPU), and the path of each
token mixer (convolution, recurrent scan). The model is built on the meta device (no weights are loaded).
"""

_EPILOG = """\
examples:
  unpack-trainer env                              # versions and devices
  unpack-trainer env --model llama                # a model type, built tiny from its config
  unpack-trainer env --model ./my-checkpoint      # a local model folder (its config.json)
  unpack-trainer env --model qwen3_next --json
"""


def add_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``env`` to the ``unpack-trainer`` subcommands."""
    parser = add_command_parser(subparsers, "env", _HELP, _DESCRIPTION, _EPILOG)
    parser.add_argument(
        "--model",
        metavar="PATH_OR_TYPE",
        help="a local model folder (with config.json) or a transformers model_type (llama, qwen3, ...)",
    )
    parser.add_argument(
        "--device", help="the device to decide the attention backend for (default: cuda when available, else cpu)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of markdown")
    parser.set_defaults(handler=_run_env)


def _run_env(args: argparse.Namespace) -> int:
    report = environment()
    if args.model:
        report["model"] = model_report(args.model, device=args.device)
    print(json.dumps(report, indent=2) if args.json else format_environment(report))
    return 0


# --------------------------------------------------------------------------------------------------------------------
# Versions and devices
# --------------------------------------------------------------------------------------------------------------------


def _version(distributions: tuple[str, ...]) -> str:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return NOT_INSTALLED


def _devices() -> list[dict[str, Any]]:
    import torch

    devices: list[dict[str, Any]] = [{"device": "cpu", "threads": torch.get_num_threads(), "cores": os.cpu_count()}]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "device": f"cuda:{index}",
                    "name": properties.name,
                    "memory_gib": round(properties.total_memory / 2**30, 1),
                    "capability": f"{properties.major}.{properties.minor}",
                    "bf16": bool(torch.cuda.is_bf16_supported()),
                }
            )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append({"device": "mps"})
    return devices


def environment() -> dict[str, Any]:
    """Versions of unpack_trainer, python, the libraries it runs on (:data:`PACKAGES`) and the optional kernel
    packages (the attention backends' kernels, then :data:`OPTIONAL_PACKAGES`; ``"not installed"`` where absent), and
    the devices torch sees."""
    import torch

    from unpack_trainer import __version__

    return {
        "unpack_trainer": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(dists) for name, dists in PACKAGES},
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        "optional_packages": {name: _version(dists) for name, dists in (*_attention_kernels(), *OPTIONAL_PACKAGES)},
        "devices": _devices(),
        "attention_backends": _backends(),
        "attention_backend_features": _backend_features(),
    }


def _attention_kernels() -> list[tuple[str, tuple[str, ...]]]:
    """``(name, distributions)`` of every optional kernel an attention backend declares."""
    from unpack_trainer.patches.attention import REGISTRY

    kernels = [record.kernel for record in REGISTRY.values() if record.kernel is not None]
    return [(kernel.name, kernel.distributions) for kernel in kernels if kernel.distributions]


def _backends() -> dict[str, dict[str, str]]:
    """Per device torch sees (cpu, cuda) and half / full precision: each packed attention backend of the registry
    (registered ones included, in the order the automatic choice prefers them), ``"available"`` or why not (its
    record's ``unavailable_reason``)."""
    import torch

    from unpack_trainer.patches.attention import REGISTRY

    found = {}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        for dtype in (torch.bfloat16, torch.float32):
            key = f"{device}, {str(dtype).replace('torch.', '')}"
            found[key] = {
                name: record.unavailable_reason(torch.device(device), dtype) or "available"
                for name, record in REGISTRY.items()
            }
    return found


def _backend_features() -> dict[str, list[str]]:
    """What each packed attention backend of the registry serves beyond causal grouped-query attention (the values of
    its record's ``serves``, :class:`~unpack_trainer.patches.attention.AttentionFeature`'s order)."""
    from unpack_trainer.patches.attention import REGISTRY, AttentionFeature

    return {
        name: [feature.value for feature in AttentionFeature if feature in record.serves]
        for name, record in REGISTRY.items()
    }


# --------------------------------------------------------------------------------------------------------------------
# A model
# --------------------------------------------------------------------------------------------------------------------


def _config(model: str) -> tuple[Any, str]:
    """The config of ``model`` (a local folder or a model type) and how it was found."""
    from transformers import AutoConfig

    from unpack_trainer.model_zoo.tiny import config_class, tiny_config

    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise CLIError(f"--model {model}: a folder without config.json (a transformers model folder has one)")
        try:
            return AutoConfig.from_pretrained(str(path), local_files_only=True), f"the folder {path}"
        except Exception as error:  # noqa: BLE001 - one line for the user
            raise CLIError(f"--model {model}: its config cannot be read: {one_line(error)}") from None
    try:
        config_class(model)
    except KeyError:
        raise CLIError(
            f"--model {model}: neither a folder nor a transformers model_type (e.g. llama, qwen3, gemma2)"
        ) from None
    from unpack_trainer.model_zoo.tiny_vision import VISION_FAMILIES, tiny_vision_config

    if model in VISION_FAMILIES:
        return tiny_vision_config(model), (
            f"model_type {model!r}, built tiny from its config (unpack_trainer.model_zoo.tiny_vision)"
        )
    return tiny_config(model), f"model_type {model!r}, built tiny from its config (unpack_trainer.model_zoo.tiny)"


def _precisions(device: Any, implementation: str | None, needs: Any) -> dict[str, dict[str, str]]:
    """The packed attention backend per precision set-up, from
    :func:`unpack_trainer.patches.attention.choose_backend` for the compute dtype: under autocast the attention runs
    in the autocast dtype, so float32 weights under bfloat16 autocast compute it in bfloat16."""
    import torch

    from unpack_trainer.patches.attention import choose_backend

    runs = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float32 weights, bfloat16 autocast": torch.bfloat16,
    }
    found = {}
    for label, dtype in runs.items():
        compute = str(dtype).replace("torch.", "")
        try:
            choice = choose_backend(device, dtype, implementation, needs)
        except ValueError as error:  # an impossible UNPACK_ATTENTION_BACKEND
            found[label] = {"compute_dtype": compute, "backend": "error", "why": str(error)}
            continue
        found[label] = {"compute_dtype": compute, "backend": choice.name, "why": choice.reason}
    return found


def _mixer_paths(structure: Any, device: Any) -> list[dict[str, str]]:
    """The path of each token mixer of a patched model's ``structure`` on ``device`` (a handler owns every one: the
    patch refuses a model with a mixer none owns)."""
    import torch

    from unpack_trainer.patches.mixer_kernels import KERNEL_DEVICE_TYPES, varlen_plan

    paths = []
    for mixer in structure.mixers:
        entry = {"mixer": mixer.describe()}
        if isinstance(mixer.module, torch.nn.Conv1d):
            entry.update(path="masked convolution taps", why="a bare depthwise causal Conv1d: exact on any device")
        else:
            plan = varlen_plan(mixer.module)
            if plan.reason is None and torch.device(device).type in KERNEL_DEVICE_TYPES:
                keywords = ", ".join(key for key, _ in plan.keywords)
                entry.update(path="varlen kernels", why=f"{', '.join(plan.kernels)} take {keywords} on the packed row")
            else:
                why = plan.reason or (
                    f"the installed kernels ({', '.join(plan.kernels)}) run on {' / '.join(KERNEL_DEVICE_TYPES)}, "
                    f"not {torch.device(device).type}"
                )
                entry.update(path="per sample, padded buckets", why=why)
        paths.append(entry)
    return paths


def model_report(model: str, *, device: str | None = None) -> dict[str, Any]:
    """What the patch does with ``model`` (a local folder or a model type), built on the ``meta`` device: patched or
    refused (kind and reason), whether its type is verified by the coverage check, its attention implementation, the
    packed attention backend per precision on ``device`` (default: ``cuda`` when available, else ``cpu``) and the path
    of each token mixer.

    Raises:
        CLIError: ``model`` is neither a folder with a ``config.json`` nor a model type, or cannot be built.
    """
    import torch

    from unpack_trainer._compat import attention_implementation
    from unpack_trainer.anatomy.structure import auto_model_class, meta_model
    from unpack_trainer.models import supported_model_types
    from unpack_trainer.models.preview import preview_patch
    from unpack_trainer.models.verified import VERIFIED_VISION_WITH, VERIFIED_WITH

    config, source = _config(model)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        built = meta_model(config)
    except Exception as error:  # noqa: BLE001 - one line for the user
        what = (
            "no vision-language model"
            if auto_model_class(config).__name__ != "AutoModelForCausalLM"
            else "no causal LM"
        )
        raise CLIError(f"--model {model}: {what} can be built from its config: {one_line(error)}") from None
    verified_with = VERIFIED_VISION_WITH if getattr(config, "vision_config", None) is not None else VERIFIED_WITH
    report: dict[str, Any] = {
        "model": model,
        "source": source,
        "model_type": getattr(config, "model_type", None),
        "class": type(built).__name__,
        "verified": getattr(config, "model_type", None) in supported_model_types(),
        "verified_with": "transformers " + " and ".join(verified_with),
        "newer_than_verified": _newer_than_verified(verified_with),
        "attn_implementation": attention_implementation(built.config),
        "device": str(device),
    }
    preview = preview_patch(built)
    refused = preview.refusal
    if refused is not None:
        report.update(
            patched=False,
            refusal_kind=str(refused.kind),
            refusal=refused.reason,
            trainer="trains padded (refused before any forward)"
            if refused.kind.blocking
            else "the self-check decides whether transformers' own packed path (a dense mask) is exact",
        )
        return report
    report.update(patched=True, trainer="packs through the patch (after its self-check on the first batch)")
    report["fixes"] = list(preview.fixes)
    report["vision"] = _vision_path(built, preview.structure)
    report["sequence_parallel"] = _sequence_parallel(preview.sequence_parallel, vision=report["vision"] is not None)
    report["rope"] = _rope(preview.rope)
    report["attention"] = _precisions(device, attention_implementation(built.config), preview.features)
    report["mixers"] = _mixer_paths(preview.structure, device)
    if report["vision"] is not None and not report["verified"]:
        report["trainer"] = (
            "trains padded: its vision-language model type is not verified for packed image rows "
            "(python tools/model_coverage.py --vision)"
        )
    return report


def _sequence_parallel(reasons: dict[int, str | None], *, vision: bool = False) -> str:
    """One line of whether the packed rows of the trainers that pack under DeepSpeed Ulysses stay exact at each
    ``sp_size`` of ``reasons`` (:attr:`unpack_trainer.models.preview.PatchPreview.sequence_parallel`); of a
    vision-language model (``vision``), SFT's image rows (the only ones cut with the whole row's vision inputs)."""
    exact = [str(size) for size, reason in reasons.items() if reason is None]
    if not exact:
        return f"refused ({next(iter(reasons.values()))})"
    trainers = "SFT (image rows)" if vision else "SFT, DPO, reward, GRPO and RLOO"
    line = f"{trainers} pack{'s' if vision else ''} exactly at sp_size {', '.join(exact)}"
    refused = {size: reason for size, reason in reasons.items() if reason is not None}
    if refused:
        line += "; " + "; ".join(f"refused at {size}: {reason}" for size, reason in refused.items())
    return line


def _newer_than_verified(verified_with: tuple[str, ...]) -> str | None:
    """A warning where the installed transformers is newer than every release the coverage table was verified on
    (``verified_with``, :mod:`unpack_trainer.models.verified`); ``None`` otherwise."""
    from packaging.version import Version

    installed = metadata.version("transformers")
    newest = max(verified_with, key=Version)
    if Version(installed) <= Version(newest):
        return None
    return (
        f"transformers {installed} is newer than the releases this coverage table was verified on (newest "
        f"{newest}): the model types it lists were not checked on it; the trainer's self-check still guards every "
        "model on its first batch (python tools/model_coverage.py, in a clone of the repository, checks them all here)"
    )


def _rope(reasons: dict[str, str | None]) -> str | None:
    """Whose RoPE the patched model runs, from ``reasons``
    (:attr:`unpack_trainer.models.preview.PatchPreview.rope`): the fused one, or why not (the modeling module's
    ``apply_rotary_pos_emb`` is not Llama's, another library's, a hub kernel the model chose, or one this release cannot
    read); ``None`` for a model without a module-level ``apply_rotary_pos_emb``."""
    if not reasons:
        return None
    skipped = [reason for reason in reasons.values() if reason is not None]
    if not skipped:
        return "unpack_trainer's fused RoPE (packed positions; a Triton kernel where Triton runs)"
    return "not fused: " + "; ".join(skipped)


def _vision_path(built: Any, structure: Any) -> dict[str, str] | None:
    """How the packed rows of a vision-language model are made exact (``None`` for a text model): which module runs
    the vision tower apart from the packing, its positions per sample and its image tokens' attention."""
    from unpack_trainer.anatomy.vision import RopeIndex, find_vision_language, image_block_layer_types
    from unpack_trainer.models.verified import verified_vision_model_types

    vision = find_vision_language(built, structure)
    if vision is None:
        return None
    where = "the forward hook"
    if vision.position_rows > 1 and not RopeIndex(vision.module).needs_model:
        where = "the collator, on the CPU"
    positions = {
        1: "restarting 1-D positions per sample",
        3: f"multimodal RoPE [t; h; w] per sample, from the model's own get_rope_index (computed in {where})",
        4: f"multimodal RoPE [text; t; h; w] per sample, from the model's own get_rope_index (computed in {where})",
    }[vision.position_rows]
    model_type = built.config.model_type
    layer_types = None  # the layer types applying the image blocks, where not every one does (Gemma 4)
    if vision.image_blocks is not None:
        layer_types = image_block_layer_types(vision.module)
        every = set(getattr(vision.decoder.config, "layer_types", None) or ())
        layer_types = None if layer_types is None or set(layer_types) >= every else layer_types
    return {
        "module": type(vision.module).__name__,
        "text model": type(vision.decoder).__name__,
        "positions": positions,
        "image tokens": "bidirectional within each image (flex, SDPA and eager; the varlen kernels hand over)"
        + ("" if layer_types is None else f", on its {', '.join(sorted(layer_types))} layers")
        if vision.image_blocks is not None
        else "causal",
        "data": "images processed per batch by the processor (TRL's vision collator), every image whole in its row "
        "(packing=True: examples packed ahead into rows; otherwise each batch flattened into one row)",
        "verified": "yes" if model_type in verified_vision_model_types() else "no: the trainer trains it padded",
    }


# --------------------------------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------------------------------


def format_environment(report: dict[str, Any]) -> str:
    """``report`` (:func:`environment`, with ``"model"`` from :func:`model_report`) as markdown for a bug report."""
    lines = [
        "## unpack-trainer env",
        "",
        f"- unpack_trainer: {report['unpack_trainer']}",
        f"- Python: {report['python']} ({report['platform']})",
    ]
    lines += [f"- {name}: {version}" for name, version in report["packages"].items()]
    lines.append(f"- torch CUDA: {report['torch_cuda']}")
    lines += ["", "Optional kernel packages:", ""]
    lines += [f"- {name}: {version}" for name, version in report["optional_packages"].items()]
    lines += ["", "Devices:", ""]
    for device in report["devices"]:
        details = ", ".join(f"{key} {value}" for key, value in device.items() if key != "device")
        lines.append(f"- {device['device']}" + (f": {details}" if details else ""))
    lines += ["", "Packed attention backends:", ""]
    for where, backends in report["attention_backends"].items():
        lines.append(f"- {where}: " + "; ".join(f"{name}: {why}" for name, why in backends.items()))
    lines += ["", "What each serves beyond causal attention:", ""]
    for name, features in report["attention_backend_features"].items():
        lines.append(f"- {name}: {', '.join(features) or 'nothing more'}")
    model = report.get("model")
    if model:
        lines += ["", f"## Model: {model['model']}", "", f"- built from: {model['source']}"]
        lines.append(f"- class: {model['class']} (model_type {model['model_type']})")
        guard = "it trains padded" if model.get("vision") else "the trainer's self-check guards it"
        verified = "yes" if model["verified"] else f"no ({guard})"
        lines.append(f"- verified by the coverage check ({model['verified_with']}): {verified}")
        if model.get("newer_than_verified"):
            lines.append(f"- WARNING: {model['newer_than_verified']}")
        lines.append(f"- attention implementation: {model['attn_implementation']}")
        if model["patched"]:
            lines.append("- patch: patched")
        else:
            lines.append(f"- patch: REFUSED ({model['refusal_kind']}): {model['refusal']}")
        lines.append(f"- trainer: {model['trainer']}")
        if model.get("fixes") is not None:
            lines.append(f"- model-family fixes: {', '.join(model['fixes']) or 'none'}")
        if model.get("rope"):
            lines.append(f"- RoPE: {model['rope']}")
        if model.get("sequence_parallel"):
            lines.append(f"- sequence parallelism (DeepSpeed Ulysses): {model['sequence_parallel']}")
        if model.get("attention"):
            lines += ["", f"Packed attention backend on {model['device']}:", ""]
            for label, choice in model["attention"].items():
                lines.append(f"- {label}: {choice['backend']} ({choice['why']})")
        if model.get("mixers") is not None:
            lines += ["", "Token mixers:", ""]
            lines += [f"- {m['mixer']}: {m['path']} ({m['why']})" for m in model["mixers"]] or ["- none"]
        if model.get("vision"):
            lines += ["", "Vision-language path:", ""]
            lines += [f"- {key}: {value}" for key, value in model["vision"].items()]
    return "\n".join(lines)
