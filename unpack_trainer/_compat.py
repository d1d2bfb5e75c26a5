"""Every private or moved name of transformers, torch and datasets the package reads, in one place.

Each is found by feature (no version numbers) and checked once, at first use: a name that is missing raises one
``RuntimeError`` that names it and the versions known to work ([`KNOWN_TO_WORK`]), instead of an ``AttributeError``
deep inside a forward. When a library makes a name public, renames or drops it, this is the one file to change. (TRL's
trainers and transformers' ``Trainer`` they extend are the trainer side's: ``unpack_trainer._trl_compat``.)

Names that moved between releases, both spellings handled:

- the KV cache keyword of a model's ``forward``: ``cache`` since transformers 5.24 (``past_key_values`` stays a
  deprecated alias until 5.40, renamed by a decorator before the model's own code runs), ``past_key_values`` before:
  :data:`CACHE_KEYWORDS`, :func:`cache_argument`, :func:`cache_keyword`, :func:`output_cache`; how many tokens a cache
  holds, for a cache of recurrent states too (:func:`cache_length`). A hook on a decoder sees whichever name the outer
  model passed;
- activation checkpointing on a ``PreTrainedModel``: ``activation_checkpointing_enable`` / ``_disable`` /
  ``is_activation_checkpointing`` since 5.24, ``gradient_checkpointing_*`` before (deprecated in 5.24, with a
  ``FutureWarning`` per call): :func:`checkpointing_enabled`, :func:`enable_checkpointing`,
  :func:`disable_checkpointing`;
- dynamo's recompile limit: ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before torch 2.7):
  :func:`recompile_limit_at_least` (without either, logged once and nothing changes);
- whether ``torch.compile`` or ``torch.export`` is tracing now: ``torch.compiler.is_compiling`` /
  ``is_exporting``, each where this torch has it (:func:`is_tracing`).

Private names, with what each is for and what would replace it:

- transformers' attention and mask registries: the class-wide tables ``AttentionInterface._global_mapping`` /
  ``AttentionMaskInterface._global_mapping`` (:func:`attention_functions`, :func:`mask_functions`: the functions the
  packed routing falls back to) and an interface instance's own ``_local_mapping`` (:func:`locally_registered`: what
  a name mapped to before the routing replaced it). transformers has no public lookup that tells the two apart;
- ``PretrainedConfig._attn_implementation``, the attention implementation a model runs (transformers' own models
  read it; no public getter): :func:`attention_implementation`, :func:`set_attention_implementation`;
- ``PreTrainedModel._supports_sdpa``, whether a model class runs SDPA (:func:`supports_sdpa`);
- the flag transformers' output capturing sets on a model once its capturing hooks are installed
  (``utils/output_capturing.py``; the self-check puts it back as found, with the hooks): :func:`output_capturing_flag`;
- torch's hook dictionaries on a module (``_forward_pre_hooks``, ``_forward_hooks``, ...): a hook removed by id, so
  a deep copy of a patched model removes its own (:func:`remove_hook`); every hook dict put back as found by the
  self-check (:func:`hook_dicts`);
- ``torch._C._current_graph_task_id``, whether autograd is running a backward now (a mixer recomputed by gradient
  checkpointing uses what its forward used): :func:`in_backward`;
- ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``, the parameters and buffers DDP does not
  synchronise (``--ignore_bias_buffers``, as TRL's DPO script sets them): :func:`ignore_in_ddp`;
- datasets' ``IterableDataset._formatting``, a stream's format (TRL's ``_get_dataset_format`` reads it too):
  :func:`stream_format_type`;
- ``torch._assert_async``, a check on the device that never waits for it (the fused loss's precondition on the
  gradient it receives): :func:`assert_on_device`;
- the ``kernels`` package's function modules (transformers 5.25 decorates ``apply_rotary_pos_emb`` and the mixers'
  sequence kernels with ``use_kernel_forward_from_hub``: the modeling module's global is an ``nn.Module`` whose class
  ``forward`` closes over the function as ``func``) and the per-layer wrappers ``use_kernelized_func`` keeps
  (``_kernel_funcs``, each with the hub repository ``kernelize`` chose under ``_kernel_repo``):
  :func:`hub_kernel_function`, :func:`kernel_function_copies`, :func:`hub_kernel_chosen`. ``kernels`` has no
  public accessor for these;
- transformers' ``masking_utils.find_packed_sequence_indices``, replaced while a decoder is routed so that a packed
  forward skips its read-back from the device: :func:`skip_packed_sequence_detection`.

- PEFT's LoRA linear layer internals (``peft.tuners.lora.Linear`` with its own ``forward``; ``lora_variant``,
  ``lora_dropout``, ``active_adapters``) and its input-cast switch ``cast_input_dtype_enabled`` (what
  ``peft.helpers.disable_input_dtype_casting`` sets): :func:`plain_lora_linear_layers`.

Optional libraries, found by feature (``None`` where missing, so the caller can give a reason):

- Liger-Kernel's chunked fused linear cross-entropy that returns per-token losses with the gradients of their sum
  computed in the forward (``liger_kernel.ops.fused_linear_cross_entropy.fused_linear_cross_entropy_forward``, not
  part of Liger's documented API): :func:`liger_linear_cross_entropy`.

Nothing is imported at module import: torch, transformers and datasets are imported by the functions that need them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from unpack_trainer._logging import log_once

__all__ = [
    "CACHE_KEYWORDS",
    "KNOWN_TO_WORK",
    "assert_on_device",
    "attention_functions",
    "attention_implementation",
    "cache_argument",
    "cache_keyword",
    "cache_length",
    "checkpointing_enabled",
    "disable_checkpointing",
    "enable_checkpointing",
    "gathered_parameters",
    "hook_dicts",
    "hub_kernel_chosen",
    "hub_kernel_function",
    "ignore_in_ddp",
    "in_backward",
    "is_tracing",
    "kernel_function_copies",
    "liger_linear_cross_entropy",
    "locally_registered",
    "mask_functions",
    "missing_name_error",
    "output_cache",
    "output_capturing_flag",
    "plain_lora_linear_layers",
    "recompile_limit_at_least",
    "remove_hook",
    "sequence_parallel_gradients_averaged",
    "sequence_parallel_group",
    "set_attention_implementation",
    "skip_packed_sequence_detection",
    "stream_format_type",
    "supports_sdpa",
]

logger = logging.getLogger("unpack_trainer")

KNOWN_TO_WORK = (
    "transformers 5.22 to 5.25, torch 2.11 to 2.13 and datasets 4.8.5 to 5.2 (pyproject allows transformers>=5.22,<6, "
    "torch>=2.11, datasets>=4.8.5)"
)

_MISSING = object()
# name -> what it resolved to: each private name is looked up and checked once per process.
_resolved: dict[str, Any] = {}


def missing_name_error(name: str) -> RuntimeError:
    """The one error for a private name the installed libraries do not have."""
    return RuntimeError(
        f"unpack_trainer needs `{name}`, which the installed libraries do not have (it moved or was removed). Known to "
        f"work: {KNOWN_TO_WORK}. Install a version in that range, or set UNPACK_DISABLE=1 to train exactly as TRL "
        "does."
    )


def _private(name: str, find: Callable[[], Any]) -> Any:
    """What ``find()`` returns for the private name ``name`` (``_MISSING`` when the name is not there), looked up
    once and cached; [`missing_name_error`] when it is missing."""
    value = _resolved.get(name, _MISSING)
    if value is _MISSING:
        value = find()
        if value is _MISSING:
            raise missing_name_error(name)
        _resolved[name] = value
    return value


# --------------------------------------------------------------------------------------------------------------------
# transformers: names that moved
# --------------------------------------------------------------------------------------------------------------------

# The KV cache keyword of a model's forward: the current name first.
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_argument(kwargs: Mapping[str, Any]) -> Any:
    """The KV cache in a forward's keyword arguments under either name of :data:`CACHE_KEYWORDS`, or ``None``."""
    for name in CACHE_KEYWORDS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def cache_keyword(model: Any) -> str:
    """The keyword ``model.forward`` takes its KV cache under (``cache`` or ``past_key_values``)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in parameters), CACHE_KEYWORDS[-1])


def output_cache(output: Any) -> Any:
    """The cache a model's forward returned: its output's ``cache`` field (transformers 5.24), ``past_key_values`` or,
    for state-space models before 5.24, ``cache_params``; read without touching a deprecated alias."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    name = next((name for name in (*CACHE_KEYWORDS, "cache_params") if name in fields), CACHE_KEYWORDS[-1])
    return getattr(output, name, None)


def cache_length(cache: Any) -> int:
    """How many tokens ``cache`` already holds; 0 for ``None`` or an object without ``get_seq_length``.

    A cache of recurrent states only (Mamba's since transformers 5.24) keeps no sequence length, and its
    ``get_seq_length`` raises ``ValueError``: it counts as 1 once it holds a state (it has seen tokens), else 0.
    """
    get_seq_length = getattr(cache, "get_seq_length", None)
    if not callable(get_seq_length):
        return 0
    try:
        return int(get_seq_length())
    except ValueError:
        has_previous_state = getattr(cache, "has_previous_state", None)
        return int(bool(has_previous_state())) if callable(has_previous_state) else 0


def checkpointing_enabled(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on for ``model`` (a ``PreTrainedModel``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def enable_checkpointing(model: Any, kwargs: dict[str, Any] | None = None) -> None:
    """Turn activation checkpointing on, with ``kwargs`` for ``torch.utils.checkpoint`` (``{"use_reentrant": False}``)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model: Any) -> None:
    """Turn activation checkpointing off."""
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


# --------------------------------------------------------------------------------------------------------------------
# transformers: private names
# --------------------------------------------------------------------------------------------------------------------


def hub_kernel_function(obj: Any) -> Callable[..., Any] | None:
    """The plain function behind a modeling module's global ``obj``: ``obj`` itself where it is a function; where
    transformers decorated it with ``use_kernel_forward_from_hub`` and the ``kernels`` package is installed
    (transformers 5.25 and newer: ``apply_rotary_pos_emb`` of Llama and every copy), the ``nn.Module`` instance
    ``kernels`` made of it (``_create_func_module``: a class whose ``forward`` calls the function it closes over as
    ``func`` unless a model's ``kernelize`` chose a hub kernel); ``None`` for anything else, or a module of that kind
    whose function cannot be read (then the caller says it cannot recognise it)."""
    if inspect.isfunction(obj):
        return obj
    if getattr(type(obj), "kernel_layer_name", None) is None:
        return None
    forward = getattr(type(obj), "forward", None)
    if not inspect.isfunction(forward):
        return None
    function = inspect.getclosurevars(forward).nonlocals.get("func")
    return function if inspect.isfunction(function) else None


def kernel_function_copies(module: Any) -> dict[str, Any]:
    """The per-layer copies of ``kernels`` function modules a layer keeps when its class carries
    ``use_kernelized_func`` (``_kernel_funcs``: function name -> an instance of the modeling module's global's class;
    the layer's forward routes calls of that global to its copy, and ``kernelize`` replaces the copy's ``forward``);
    ``{}`` for any other layer."""
    copies = vars(module).get("_kernel_funcs")
    return copies if isinstance(copies, dict) else {}


def hub_kernel_chosen(module: Any, name: str) -> str | None:
    """Where a model's ``kernelize`` (or ``from_pretrained(use_kernels=True)``) chose a hub kernel for the function
    ``name`` on ``module`` (a layer whose class carries ``use_kernelized_func``: the per-instance ``_kernel_funcs``
    wrappers, each with the chosen repository under ``_kernel_repo``), that repository in words; ``None`` where the
    function runs transformers' own code."""
    wrapper = kernel_function_copies(module).get(name)
    repository = vars(wrapper).get("_kernel_repo") if wrapper is not None else None
    return None if repository is None else str(repository)


def _class_table(module: str, cls: str) -> Callable[[], Any]:
    def find() -> Any:
        interface = getattr(importlib.import_module(module), cls)
        table = getattr(interface, "_global_mapping", _MISSING)
        return table if isinstance(table, dict) else _MISSING

    return find


def attention_functions() -> dict[str, Callable[..., Any]]:
    """transformers' class-wide attention registry, ``AttentionInterface._global_mapping``: implementation name ->
    attention function (``"sdpa"`` -> ``sdpa_attention_forward``, ...). The dict itself: read it per call, it follows
    ``AttentionInterface.register``."""
    return _private(
        "transformers.AttentionInterface._global_mapping", _class_table("transformers", "AttentionInterface")
    )


def mask_functions() -> dict[str, Callable[..., Any]]:
    """transformers' class-wide mask registry, ``AttentionMaskInterface._global_mapping``: implementation name -> mask
    function (``"sdpa"`` -> ``sdpa_mask``, ...). The dict itself, as [`attention_functions`]."""
    return _private(
        "transformers.masking_utils.AttentionMaskInterface._global_mapping",
        _class_table("transformers.masking_utils", "AttentionMaskInterface"),
    )


def skip_packed_sequence_detection(skip: Callable[[], bool]) -> Callable[[], None] | None:
    """Have transformers' ``masking_utils.find_packed_sequence_indices`` return ``None`` (no packed rows seen) while
    ``skip()`` is true outside a trace, calling it as before otherwise; returns the function that puts the original
    back, or ``None`` where this transformers has no such function.

    ``create_causal_mask`` and its siblings call it when ``position_ids`` come without an ``attention_mask``; outside a
    trace it reads ``(mask[:, -1] == 0).all()`` back from the device, a host sync per forward on a GPU. The packed
    mask function does not use its result, so a packed forward has no need of it.
    """
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        log_once(
            logger, logging.DEBUG, "unpack_trainer: transformers.masking_utils has no find_packed_sequence_indices."
        )
        return None

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: Any) -> Any:
        # (under a trace the original reads no value back either, and skip() reads tables no guard should be built on)
        return None if not is_tracing() and skip() else original(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices

    def restore() -> None:
        if masking_utils.find_packed_sequence_indices is find_packed_sequence_indices:
            masking_utils.find_packed_sequence_indices = original

    return restore


def locally_registered(interface: Any, name: str) -> Any:
    """What ``interface[name] = function`` set on this instance of an attention or mask interface
    (``ALL_ATTENTION_FUNCTIONS``, ``ALL_MASK_ATTENTION_FUNCTIONS``), read from its ``_local_mapping``; ``None`` when
    only the class-wide registry has ``name``."""

    def find() -> Any:
        table = getattr(interface, "_local_mapping", _MISSING)
        return True if isinstance(table, dict) else _MISSING

    _private(f"transformers.{type(interface).__name__}._local_mapping", find)
    return interface._local_mapping.get(name)


def _config_attribute() -> Any:
    from transformers import PretrainedConfig

    return True if hasattr(PretrainedConfig, "_attn_implementation") else _MISSING


def attention_implementation(config: Any) -> str | None:
    """``config._attn_implementation``: the attention implementation the model runs (``"sdpa"``, ``"eager"``, ...,
    ``None`` before transformers resolved it); ``None`` for an object that is not a model config."""
    _private("transformers.PretrainedConfig._attn_implementation", _config_attribute)
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config: Any, implementation: str) -> None:
    """Set ``config._attn_implementation`` (only the name: the model's ``set_attn_implementation`` also loads kernels)."""
    _private("transformers.PretrainedConfig._attn_implementation", _config_attribute)
    config._attn_implementation = implementation


def supports_sdpa(model_class: type) -> bool:
    """Whether ``model_class`` (a ``PreTrainedModel`` subclass) runs SDPA: its ``_supports_sdpa``."""

    def find() -> Any:
        from transformers import PreTrainedModel

        return True if hasattr(PreTrainedModel, "_supports_sdpa") else _MISSING

    _private("transformers.PreTrainedModel._supports_sdpa", find)
    return bool(getattr(model_class, "_supports_sdpa", False))


# Set by transformers on a model once its output-capturing forward hooks are installed (utils/output_capturing.py).
_OUTPUT_CAPTURING_FLAG = "_output_capturing_hooks_installed"


def output_capturing_flag() -> str | None:
    """The attribute transformers sets on a model once a forward asked for hidden states or attentions and its
    output-capturing hooks are installed; ``None`` where transformers has no output capturing (nothing to put back).

    Checked by reading the module's code: some function of ``transformers.utils.output_capturing`` sets the flag."""

    def find() -> Any:
        try:
            module = importlib.import_module("transformers.utils.output_capturing")
        except ImportError:
            return None
        for value in vars(module).values():
            code = getattr(value, "__code__", None)
            if code is not None and _OUTPUT_CAPTURING_FLAG in code.co_consts:
                return _OUTPUT_CAPTURING_FLAG
        return _MISSING

    return _private(f"transformers.utils.output_capturing: model.{_OUTPUT_CAPTURING_FLAG}", find)


# --------------------------------------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------------------------------------


# The dictionaries ``nn.Module.register_forward_pre_hook`` / ``register_forward_hook`` keep a module's hooks in, by id.
_FORWARD_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _module_hook_dicts() -> Any:
    import torch

    module = torch.nn.Module()
    return True if all(isinstance(getattr(module, name, None), dict) for name in _FORWARD_HOOK_DICTS) else _MISSING


def remove_hook(module: Any, hook_id: int) -> None:
    """What ``RemovableHandle.remove`` does, on ``module``'s own forward hook dicts (``_forward_pre_hooks``,
    ``_forward_hooks``, ...), by hook id: a handle of the original model would point at the original's dicts after
    ``copy.deepcopy``, an id stays valid in the copy."""
    _private("torch.nn.Module._forward_pre_hooks / _forward_hooks", _module_hook_dicts)
    for name in _FORWARD_HOOK_DICTS:
        getattr(module, name, {}).pop(hook_id, None)


def hook_dicts(module: Any) -> list[dict]:
    """Every hook dictionary torch keeps on ``module`` (``_forward_hooks``, ``_forward_pre_hooks``, ``_backward_hooks``,
    ``_state_dict_hooks``, ...: its attributes named ``*hooks`` that are dicts), to be put back as found."""
    _private("torch.nn.Module._forward_pre_hooks / _forward_hooks", _module_hook_dicts)
    return [hooks for name, hooks in vars(module).items() if name.endswith("hooks") and isinstance(hooks, dict)]


def is_tracing() -> bool:
    """Whether ``torch.compile`` (dynamo) or ``torch.export`` is tracing the code now running
    (``torch.compiler.is_compiling`` / ``is_exporting``, each where this torch has it)."""
    import torch

    compiler = getattr(torch, "compiler", None)
    for name in ("is_compiling", "is_exporting"):
        check = getattr(compiler, name, None)
        if check is not None and check():
            return True
    return False


def in_backward() -> bool:
    """Whether the code now running is part of a backward pass (where gradient checkpointing recomputes a layer's
    forward): ``torch._C._current_graph_task_id() != -1``. Not for a traced region (dynamo does not trace it)."""

    def find() -> Any:
        import torch

        return getattr(torch._C, "_current_graph_task_id", _MISSING)

    return _private("torch._C._current_graph_task_id", find)() != -1


def ignore_in_ddp(module: Any, names: Iterable[str]) -> None:
    """Make ``DistributedDataParallel`` leave the parameters and buffers ``names`` of ``module`` unsynchronised (set
    before the model is wrapped), through DDP's own static method for it."""

    def find() -> Any:
        from torch.nn.parallel import DistributedDataParallel

        return getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", _MISSING)

    _private("torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model", find)(
        module, list(names)
    )


def assert_on_device(condition: Any, message: str) -> None:
    """Raise ``RuntimeError(message)`` if the 0-d bool tensor ``condition`` is false, without waiting for its device:
    ``torch._assert_async`` (on a GPU a failure is a device-side assertion, reported at the next synchronisation; on
    the CPU it raises at once)."""

    def find() -> Any:
        import torch

        return getattr(torch, "_assert_async", _MISSING)

    _private("torch._assert_async", find)(condition, message)


# The parameters of Liger's chunked fused linear cross-entropy the fused loss passes by name.
_LIGER_PARAMETERS = (
    "reduction",
    "softcap",
    "accum_dtype",
    "return_token_accuracy",
    "compute_gradients",
    "weight_requires_grad",
)


def liger_linear_cross_entropy() -> Callable[..., Any] | None:
    """Liger-Kernel's ``fused_linear_cross_entropy_forward`` (``liger_kernel.ops.fused_linear_cross_entropy``), or
    ``None`` when Liger-Kernel is not installed or its function lacks one of the keywords the fused loss passes
    (``reduction="none"`` with ``compute_gradients`` and ``weight_requires_grad``: per-token losses and the gradients
    of their sum in one pass; liger-kernel 0.8.5 has them). Importing it compiles nothing."""
    try:
        module = importlib.import_module("liger_kernel.ops.fused_linear_cross_entropy")
    except ImportError:
        return None
    function = getattr(module, "fused_linear_cross_entropy_forward", None)
    if function is None:
        return None
    parameters = inspect.signature(function).parameters
    return function if all(name in parameters for name in _LIGER_PARAMETERS) else None


def recompile_limit_at_least(limit: int) -> contextlib.AbstractContextManager:
    """A context in which ``torch.compile`` recompiles a function up to ``limit`` times (its default is 8) before it
    falls back to eager: the flex attention backend compiles once per shape class and mask variant, which a long run
    can exceed. ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before torch 2.7) has no public
    equivalent; without either, nothing changes (logged once)."""
    from torch._dynamo import config

    for name in ("recompile_limit", "cache_size_limit"):
        current = getattr(config, name, None)
        if isinstance(current, int):
            return config.patch(**{name: max(limit, current)})
    log_once(
        logger,
        logging.WARNING,
        "unpack_trainer: torch._dynamo.config has neither `recompile_limit` nor `cache_size_limit`; flex attention "
        f"runs with torch's own recompile limit (known to work: {KNOWN_TO_WORK}).",
    )
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------------------------
# peft
# --------------------------------------------------------------------------------------------------------------------


def plain_lora_linear_layers(model: Any) -> list[Any]:
    """The modules of ``model`` that are PEFT LoRA linear layers running PEFT's own ``Linear.forward``, have the
    input-cast switch ``cast_input_dtype_enabled``, and whose every active adapter is vanilla LoRA (no ``lora_variant``
    such as DoRA) with no dropout (``nn.Identity``). Empty where PEFT is not installed or has no such layer class."""
    try:
        from peft.tuners.lora import Linear
    except ImportError:
        return []
    import torch

    layers = []
    for module in model.modules():
        if not isinstance(module, Linear) or type(module).forward is not Linear.forward:
            continue
        if not isinstance(getattr(module, "cast_input_dtype_enabled", None), bool):
            continue
        variants, dropouts = getattr(module, "lora_variant", None), getattr(module, "lora_dropout", None)
        active = [name for name in getattr(module, "active_adapters", ()) if name in module.lora_A]
        if variants is None or dropouts is None or not active:
            continue
        if all(name not in variants and isinstance(dropouts[name], torch.nn.Identity) for name in active):
            layers.append(module)
    return layers


# --------------------------------------------------------------------------------------------------------------------
# datasets
# --------------------------------------------------------------------------------------------------------------------


def stream_format_type(dataset: Any) -> str | None:
    """The format type of a streamed dataset (``IterableDataset``: ``"torch"``, ``"arrow"``, ..., ``None`` for
    Python objects), read from its ``_formatting`` as TRL's ``_get_dataset_format`` does."""

    def find() -> Any:
        from datasets import IterableDataset

        return True if "_formatting" in IterableDataset.__init__.__code__.co_names else _MISSING

    _private("datasets.IterableDataset._formatting", find)
    formatting = getattr(dataset, "_formatting", None)
    return formatting.format_type if formatting is not None else None


# --------------------------------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------------------------------


def sequence_parallel_group() -> Any:
    """The process group of this process's DeepSpeed Ulysses sequence parallelism (set up by
    ``UlyssesSPAttentionHF.register_with_transformers``, which accelerate calls for ``ParallelismConfig(sp_size=N,
    sp_backend="deepspeed")``): a ``torch.distributed`` group of ``N`` processes, or ``None`` where DeepSpeed is absent
    or has set up none."""
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
    except ImportError:
        return None
    try:
        return parallel_state_sp.get_sequence_parallel_group()
    except AssertionError:  # "sequence parallel group is not initialized"
        return None


def gathered_parameters(model: Any) -> contextlib.AbstractContextManager:
    """Under DeepSpeed ZeRO-3 (parameters partitioned across processes, each marked with DeepSpeed's ``ds_id``): a
    context in which every partitioned parameter of ``model`` holds its whole tensor, read-only (DeepSpeed's
    ``zero.GatheredParameters`` with ``modifier_rank=None``: nothing is written back), partitioned again on exit; a
    no-op for any other model."""
    partitioned = [parameter for parameter in model.parameters() if hasattr(parameter, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def sequence_parallel_gradients_averaged() -> bool:
    """Whether DeepSpeed averages the gradients of a sequence-parallel group instead of summing them: ZeRO-3 before
    deepspeed 0.20.2 (deepspeedai/DeepSpeed#8854 made it sum, as ZeRO-1 and 2 do). Nothing in DeepSpeed says which
    it does, so this reads the release, as transformers' ``deepspeed_sp_compute_loss`` does for the same question."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() and _deepspeed_before("0.20.2")


@functools.cache
def _deepspeed_before(release: str) -> bool:
    """Whether the installed deepspeed is older than ``release`` (its metadata read once per process, not per step)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("deepspeed")) < Version(release)
