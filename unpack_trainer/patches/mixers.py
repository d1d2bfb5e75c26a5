"""Token mixers other than attention on packed rows: convolutions and recurrent scans restart at every sample.

A packed row holds several samples back to back. Attention is made per-sample by the attention helper; a token mixer
that carries state along the sequence (a short causal convolution, a gated delta rule, Mamba's selective scan or SSD,
linear / lightning attention, RG-LRU, RWKV, ...) would carry it from one sample into the next. This module makes each
such mixer exact on packed rows, in one of three ways:

- **padded** (any causal mixer, the exact torch path): the mixer module runs on the row's samples as right-padded
  batches, samples bucketed by length so the padding stays small (the bucket plan of the SDPA backend with a linear
  cost), and its outputs are scattered back to the packed row. A causal mixer's outputs at a sample's real tokens do
  not depend on the padding after them, and its state starts from zero at every sample's first token, as when the
  sample runs alone. The layers around it (attention, MLP, norms) still run packed. Worked example, samples of
  lengths ``[3, 1, 2]`` in one row of 6 tokens, one bucket::

      row      a0 a1 a2 b0 c0 c1          (1, 6, hidden)
      buckets  a0 a1 a2                   (3, 3, hidden): padding slots are zeros
               b0 .  .
               c0 c1 .
      mixer    runs on (3, 3, hidden) with no cache; outputs at the padding slots are dropped

- **varlen** (a mixer whose installed kernels keep samples apart themselves; read from its code by
  :func:`unpack_trainer.patches.mixer_kernels.varlen_plan`, used when its tensors are on the kernels' device): the
  mixer runs once on the packed rows flattened into one, its forward handed the packing metadata the way the model's
  own kernel path expects it (``seq_idx`` for causal-conv1d and mamba-ssm, ``cu_seq_lens_q`` / ``cu_seqlens`` for
  flash-linear-attention). Same example::

      row      a0 a1 a2 b0 c0 c1          (1, 6, hidden)
      seq_idx  0  0  0  1  2  2           (1, 6) int32
      cu_seq_lens_q  [0, 3, 4, 6]         (4,) int32

  Which path each mixer class takes, and why, is logged once.

- **conv** (a bare depthwise ``nn.Conv1d`` with causal padding, e.g. inside an attention module): vectorised over the
  row, every tap that would read across a sample boundary is masked to zero: ``y[t] = b + sum_s w[k-1-s] x[t-s]`` over
  the taps ``s <= position[t]``.

Which modules run per sample is found from the model's structure
(:func:`unpack_trainer.anatomy.structure.find_token_mixers`); :class:`PerSampleMixers` is the handler that
:mod:`unpack_trainer.models.mixers` offers them to, and it owns every one it can make exact (a bare convolution that
is not depthwise causal, or a mixer outside the decoder layers, stays refused with the reason).

Only packed forwards change. A mixer reads the packing metadata from the ``packed_seq_info`` keyword where its layer
hands it down, else from the packed forward running on its decoder (``decoder.running``, the decoder state it was
patched with: a mixer's forward takes no such keyword in most models); a mixer recomputed in the backward (gradient
checkpointing, after that forward ended) uses what it used in its forward. Any
other forward (a padded batch, generation with a cache, a compiled forward without metadata) runs the mixer's own
forward unchanged. A packed forward that reaches a mixer with a cache is refused: the cache of a packed row would carry
one sample's state into the next.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from unpack_trainer._compat import in_backward, is_tracing
from unpack_trainer._logging import log_once
from unpack_trainer.packed_seq_info import FORWARD_KEYS, INFO_KEY, PackedSeqInfo
from unpack_trainer.patches import mixer_kernels
from unpack_trainer.patches.buckets import GatherSlots, ScatterTokens, build_plan
from unpack_trainer.patches.mixer_kernels import VarlenPlan, varlen_plan

logger = logging.getLogger(__name__)

__all__ = [
    "PerSampleMixers",
    "conv_problem",
    "is_mixer_patched",
    "mixer_kind",
    "packed_conv1d",
    "run_padded",
    "run_varlen",
]


# The mixers' plans of a batch (:class:`~unpack_trainer.packed_seq_info.PlanCache` keys).
class _MixerBuckets(NamedTuple):
    """:func:`_bucket_plan` on ``device``."""

    device: str


class _MixerVarlen(NamedTuple):
    """The varlen arguments of the mixer kernels on ``device``."""

    device: str


class _ConvTaps(NamedTuple):
    """The taps of a masked depthwise convolution of ``kernel_size`` in ``dtype`` on ``device``."""

    kernel_size: int
    dtype: torch.dtype
    device: str


# Token mixers that carry state along the sequence, by class name.
STATE_MIXER_NAMES = re.compile(
    r"Mamba|SSM|Ssm(?![a-z])|ShortConv|Recurren|RGLRU|Rglru|Rwkv|RWKV|LSTM|Lstm|DeltaNet|LinearAttention|Lightning"
    r"|Retention|Hyena"
)
# Classes whose names say they are per-token parts of a mixer family (RecurrentGemmaRMSNorm, MambaRMSNorm, ...).
PER_TOKEN_NAMES = re.compile(r"Norm|Mlp|MLP|Embedding|Rotary")
# Parameters only state-space layers have.
STATE_PARAMETERS = ("A_log", "dt_bias")
# Arguments that carry a cache or a recurrent state between calls.
CACHE_ARGUMENTS = ("cache_params", "past_key_values", "past_key_value", "cache", "state")
# Cost of one more mixer call (forward + backward) in units of one padded token, for the bucket plan (power 1).
_MIXER_CALL_COST_TOKENS = 512

_FORWARD_ATTRIBUTE = "forward"


def mixer_kind(module: torch.nn.Module) -> str | None:
    """``"convolution"`` or ``"recurrent / state-space"`` when ``module`` is a token mixer that carries state along the
    sequence (found from its class name, its own parameters, or its type), else ``None``."""
    from transformers import PreTrainedModel
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layer, not a convolution

    if isinstance(module, PreTrainedModel):
        return None  # the model classes are named after the family (MambaModel), their mixers after what they do
    convolution = isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) and not isinstance(
        module, Conv1D
    )
    name = type(module).__name__
    own = {p for p, _ in module.named_parameters(recurse=False)}
    named = STATE_MIXER_NAMES.search(name) and not PER_TOKEN_NAMES.search(name)
    if convolution or named or own & set(STATE_PARAMETERS):
        return "convolution" if convolution or "Conv" in name else "recurrent / state-space"
    return None


def conv_problem(module: torch.nn.Module) -> str | None:
    """Why a bare convolution cannot take the masked-taps path, or ``None``."""
    if not isinstance(module, torch.nn.Conv1d):
        return f"it is a {type(module).__name__}, not a 1-D convolution"
    (k,) = module.kernel_size
    depthwise = module.groups == module.in_channels == module.out_channels
    causal = module.padding == (k - 1,) and module.stride == (1,) and module.dilation == (1,)
    if not depthwise or not causal or module.padding_mode != "zeros":
        return (
            f"it is not a depthwise causal convolution (groups={module.groups}, in/out channels "
            f"{module.in_channels}/{module.out_channels}, kernel {k}, padding {module.padding}, stride {module.stride}, "
            f"dilation {module.dilation}, padding_mode {module.padding_mode!r})"
        )
    return None


# --------------------------------------------------------------------------------------------------------------------
# Packing metadata of the running forward
# --------------------------------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------------------------------
# The padded path
# --------------------------------------------------------------------------------------------------------------------


def _bucket_plan(info: PackedSeqInfo, device: torch.device) -> Any:
    """The samples of ``info`` bucketed by length with a linear cost per padded token (built once per batch)."""
    return info.plans.get(
        _MixerBuckets(str(device)), lambda: build_plan(info, device, call_cost=_MIXER_CALL_COST_TOKENS, power=1)
    )


def _is_sequence(x: Any, info: PackedSeqInfo) -> bool:
    return isinstance(x, Tensor) and x.dim() >= 2 and x.shape[1] == info.seq_len and x.shape[0] in (info.batch_size, 1)


def _to_buckets(x: Tensor, plan: Any, info: PackedSeqInfo) -> list[Tensor]:
    """``(B, T, *rest)`` (or ``(1, T, *rest)``) -> one ``(n, L, *rest)`` right-padded batch per bucket, zeros at the
    padding slots."""
    rest = x.shape[2:]
    if x.shape[0] != info.batch_size:
        x = x.expand(info.batch_size, *x.shape[1:])
    tokens = x.reshape(info.total_tokens, *rest)
    slots = GatherSlots.apply(tokens, plan.gather, plan.scatter)
    slots = slots.masked_fill(plan.pad_slots.view(-1, *([1] * len(rest))), 0)
    return [
        part.view(bucket.count, bucket.length, *rest) for part, bucket in zip(slots.split(plan.sizes), plan.buckets)
    ]


def _split(value: Any, plan: Any, info: PackedSeqInfo) -> list[Any]:
    """``value`` (an argument of the mixer) for each bucket: sequence tensors re-batched, tuples / lists element-wise,
    anything else as is."""
    count = len(plan.buckets)
    if _is_sequence(value, info):
        return _to_buckets(value, plan, info)
    if isinstance(value, (tuple, list)) and value:
        parts = [_split(item, plan, info) for item in value]
        return [type(value)(part[i] for part in parts) for i in range(count)]
    return [value] * count


def _merge(outputs: list[Any], plan: Any, info: PackedSeqInfo, owner: str) -> Any:
    """Bucket outputs -> the packed row's: ``(n, L, *rest)`` tensors scattered back to ``(B, T, *rest)``; a tensor
    that is not per token (a final state per sample) becomes ``None``."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if any(o.dim() < 2 or tuple(o.shape[:2]) != (b.count, b.length) for o, b in zip(outputs, plan.buckets)):
            # Not per token (e.g. the final recurrent state of each padded sample): meaningless for the packed row.
            # None, so a caller that uses it fails loudly instead of reading a state of the wrong samples.
            return None
        rest = first.shape[2:]
        flat = [o.reshape(-1, *rest) for o in outputs]
        slots = flat[0] if len(flat) == 1 else torch.cat(flat)
        tokens = ScatterTokens.apply(slots, plan.scatter, plan.gather, plan.pad_slots)
        return tokens.view(info.batch_size, info.seq_len, *rest)
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([o[i] for o in outputs], plan, info, owner) for i in range(len(first)))
    raise TypeError(
        f"unpack_trainer: the token mixer {owner} returned a {type(first).__name__}; the packed path only puts back "
        "tensors per token (and tuples of them)."
    )


def _refuse_cache(owner: str, kwargs: dict[str, Any], args: tuple, parameters: Sequence[str]) -> None:
    bound = dict(zip(parameters, args))
    bound.update(kwargs)
    for name in CACHE_ARGUMENTS:
        if bound.get(name) is not None:
            raise ValueError(
                f"A packed batch reached the token mixer {owner} with a cache (`{name}`): the cache of a packed row "
                "would carry one sample's state into the next. Run packed training batches with `use_cache=False` "
                "and no `past_key_values`."
            )


def _positional_names(module: torch.nn.Module) -> list[str]:
    import inspect

    try:
        signature = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return []
    names = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[1:]  # self


def _mixer_call(
    owner: str, info: PackedSeqInfo, args: tuple, kwargs: dict[str, Any], purpose: str
) -> tuple[dict[str, Any], torch.device]:
    """A mixer call's keyword arguments without the packing keywords (``FORWARD_KEYS``), and the device of its
    sequence tensors; ``TypeError`` when it has none (``purpose`` says what it was wanted for)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in FORWARD_KEYS}
    reference = next((x for x in (*args, *kwargs.values()) if _is_sequence(x, info)), None)
    if reference is None:
        raise TypeError(
            f"unpack_trainer: the token mixer {owner} got no (batch, {info.seq_len}, ...) tensor {purpose}."
        )
    return kwargs, reference.device


def run_padded(
    forward: Callable[..., Any], owner: str, info: PackedSeqInfo, args: tuple, kwargs: dict[str, Any]
) -> Any:
    """``forward(*args, **kwargs)`` run on the samples of the packed row ``info`` as right-padded batches.

    Every argument that is a sequence tensor ``(B, T, *rest)`` (or ``(1, T, *rest)``, broadcast over the rows; also
    inside tuples, e.g. ``position_embeddings``) is re-batched to ``(n, L, *rest)`` per bucket of similar lengths, with
    zeros at the padding slots; the packing keywords (``unpack_trainer.packed_seq_info.FORWARD_KEYS``) are dropped; ``forward`` runs once per
    bucket, and every per-token output is scattered back to ``(B, T, *rest)`` (padding slots get a zero gradient).
    Exact for a causal ``forward``: a real token's output reads only its own sample's earlier tokens.
    """
    kwargs, device = _mixer_call(owner, info, args, kwargs, "to split per sample")
    plan = _bucket_plan(info, device)
    count = len(plan.buckets)
    split_args = [_split(arg, plan, info) for arg in args]
    split_kwargs = {key: _split(value, plan, info) for key, value in kwargs.items()}
    outputs = [
        forward(*(arg[i] for arg in split_args), **{key: value[i] for key, value in split_kwargs.items()})
        for i in range(count)
    ]
    return _merge(outputs, plan, info, owner)


# --------------------------------------------------------------------------------------------------------------------
# The varlen path
# --------------------------------------------------------------------------------------------------------------------


def _varlen_metadata(info: PackedSeqInfo, device: torch.device) -> dict[str, Tensor]:
    """``{"seq_idx": (1, B * T) int32 sample index of every token, "cu_seqlens": (num_seqs + 1,) int32}`` on
    ``device`` (built once per batch)."""

    def build() -> dict[str, Tensor]:
        seq_idx = torch.repeat_interleave(torch.arange(info.num_seqs, dtype=torch.int32), info.seq_lengths.long())
        return {
            "seq_idx": seq_idx.view(1, -1).to(device, non_blocking=True),
            "cu_seqlens": info.cu_seqlens.to(device, non_blocking=True),
        }

    return info.plans.get(_MixerVarlen(str(device)), build)


def _flatten_rows(value: Any, info: PackedSeqInfo) -> Any:
    """``value`` with every sequence tensor ``(B, T, *rest)`` (or ``(1, T, *rest)``) as one row ``(1, B * T, *rest)``."""
    if _is_sequence(value, info):
        if value.shape[0] != info.batch_size:
            value = value.expand(info.batch_size, *value.shape[1:])
        return value.reshape(1, info.total_tokens, *value.shape[2:])
    if isinstance(value, (tuple, list)) and value:
        return type(value)(_flatten_rows(item, info) for item in value)
    return value


def _unflatten_rows(value: Any, info: PackedSeqInfo, owner: str) -> Any:
    """The mixer's output on the flattened row back to ``(B, T, *rest)``; a tensor that is not per token (a final
    state) becomes ``None``, as on the padded path."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.dim() < 2 or tuple(value.shape[:2]) != (1, info.total_tokens):
            return None
        return value.reshape(info.batch_size, info.seq_len, *value.shape[2:])
    if isinstance(value, (tuple, list)):
        return type(value)(_unflatten_rows(item, info, owner) for item in value)
    raise TypeError(
        f"unpack_trainer: the token mixer {owner} returned a {type(value).__name__}; the packed path only puts back "
        "tensors per token (and tuples of them)."
    )


def run_varlen(
    forward: Callable[..., Any],
    owner: str,
    info: PackedSeqInfo,
    plan: VarlenPlan,
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """``forward(*args, **kwargs)`` run once on the packed rows of ``info``, its kernels told where samples start.

    The rows are flattened into one (every sequence tensor ``(B, T, *rest)`` becomes ``(1, B * T, *rest)``; the
    flash-linear-attention kernels take a batch of 1 with ``cu_seqlens``); the packing keywords
    (``unpack_trainer.packed_seq_info.FORWARD_KEYS``) are replaced by ``plan.keywords``, each carrying its varlen argument: ``seq_idx``
    ``(1, B * T)`` int32, the sample index of every token, or ``cu_seqlens`` ``(num_seqs + 1,)`` int32; per-token
    outputs come back as ``(B, T, *rest)``. Exact when every sequence kernel the forward calls honours its varlen
    argument (what :func:`~unpack_trainer.patches.mixer_kernels.varlen_plan` checks from the code; the self-check
    verifies it on the model).
    """
    kwargs, device = _mixer_call(owner, info, args, kwargs, "to run packed")
    metadata = _varlen_metadata(info, device)
    args = tuple(_flatten_rows(arg, info) for arg in args)
    kwargs = {key: _flatten_rows(value, info) for key, value in kwargs.items()}
    kwargs.update({key: metadata[argument] for key, argument in plan.keywords})
    with mixer_kernels.replaced_kernels(plan, metadata["cu_seqlens"]):
        out = forward(*args, **kwargs)
    return _unflatten_rows(out, info, owner)


# --------------------------------------------------------------------------------------------------------------------
# The conv path
# --------------------------------------------------------------------------------------------------------------------


def _tap_masks(info: PackedSeqInfo, kernel_size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(kernel_size, B, 1, T)`` ``dtype``: 1 where tap ``s`` (reading ``x[t - s]``) stays in ``t``'s sample."""

    def build() -> Tensor:
        positions = info.position_ids().unsqueeze(1)  # (B, 1, T)
        taps = torch.arange(kernel_size, dtype=torch.int64).view(-1, 1, 1, 1)
        return (positions.unsqueeze(0) >= taps).to(device=device, dtype=dtype, non_blocking=True)

    return info.plans.get(_ConvTaps(kernel_size, dtype, str(device)), build)


def packed_conv1d(module: torch.nn.Conv1d, x: Tensor, info: PackedSeqInfo) -> Tensor:
    """A depthwise causal ``nn.Conv1d`` (padding ``k - 1``) on packed rows, no tap crossing a sample boundary.

    Args:
        module: the convolution (``groups == in_channels == out_channels``, kernel ``k``, padding ``k - 1``).
        x: ``(B, C, T)`` the packed rows, channels first, any floating dtype.
        info: the packing metadata of the rows.

    Returns:
        ``(B, C, T + k - 1)`` as the module returns it: the first ``T`` outputs are each sample's causal convolution
        (``y[t] = bias + sum_{s <= position[t]} w[k - 1 - s] * x[t - s]``); the last ``k - 1`` (outputs past the row,
        which causal callers slice off) are zeros.
    """
    (k,) = module.kernel_size
    if x.dim() != 3 or x.shape[0] != info.batch_size or x.shape[-1] != info.seq_len:
        raise ValueError(
            f"unpack_trainer: packed convolution input of shape {tuple(x.shape)}; expected (batch={info.batch_size}, "
            f"channels, {info.seq_len})."
        )
    masks = _tap_masks(info, k, x.dtype, x.device)
    out = mixer_kernels.masked_causal_taps(x, module.weight[:, 0, :], masks.__getitem__)
    if module.bias is not None:
        out = out + module.bias.unsqueeze(-1)
    return torch.nn.functional.pad(out, (0, k - 1))


# --------------------------------------------------------------------------------------------------------------------
# Patch and unpatch
# --------------------------------------------------------------------------------------------------------------------


class _PackedMixerForward:
    """Installed as ``module.forward`` (an instance attribute, removed by :meth:`PerSampleMixers.unpatch`): the
    module's own forward, except on packed forwards, where it runs per sample (``path``: ``"padded"`` or ``"conv"``;
    a ``"padded"`` mixer whose installed kernels take varlen metadata (``varlen.reason is None``) runs through them
    when its tensors are on their device)."""

    def __init__(self, module: torch.nn.Module, decoder: Any) -> None:
        self.module = module
        self.decoder = decoder
        self.path = "conv" if isinstance(module, torch.nn.Conv1d) else "padded"
        self.parameters = _positional_names(module)
        self.varlen = varlen_plan(module) if self.path == "padded" else None
        # The packing metadata of the mixer's last forward that built a graph, for its recomputation in the backward
        # (gradient checkpointing recomputes a layer after the forward, and the decoder's running forward, ended).
        self.last_info: PackedSeqInfo | None = None

    def _info(self, kwargs: dict[str, Any]) -> PackedSeqInfo | None:
        """The packing metadata of the call now running, or ``None`` (not packed): the ``packed_seq_info`` keyword
        when the layer handed it down, else the packed forward running on the decoder, else, in a recomputation during
        the backward, what this mixer used in its last forward."""
        info = kwargs.get(INFO_KEY)
        if info is None:
            info = self.decoder.running
        if is_tracing():
            return info  # a compiled / exported forward: no state kept, no backward recomputation here
        if in_backward():
            return info if info is not None else self.last_info
        if torch.is_grad_enabled():  # only a forward that builds a graph can be recomputed in its backward
            self.last_info = info
        return info

    def _takes_varlen(self, owner: str, info: PackedSeqInfo, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether this packed call runs through the installed kernels' varlen entry points; logs once per mixer
        class, path and reason which path it takes."""
        if is_tracing():
            return False  # a compiled / exported forward keeps the path it traced before: no logging inside a trace
        plan = self.varlen
        reference = next((x for x in (*args, *kwargs.values()) if _is_sequence(x, info)), None)
        device = None if reference is None else reference.device.type
        if plan.reason is not None:
            reason = plan.reason
        elif device not in mixer_kernels.KERNEL_DEVICE_TYPES:
            reason = (
                f"its tensors are on {device}, the installed kernels ({', '.join(plan.kernels)}) run on "
                f"{' / '.join(mixer_kernels.KERNEL_DEVICE_TYPES)}"
            )
        else:
            keywords = ", ".join(f"`{key}`" for key, _ in plan.keywords)
            log_once(
                logger,
                logging.INFO,
                f"unpack_trainer: the token mixers {owner} run once on the packed row through their installed "
                f"kernels' varlen entry points ({', '.join(plan.kernels)}; {keywords} handed to the forward).",
            )
            return True
        log_once(
            logger,
            logging.INFO,
            f"unpack_trainer: the token mixers {owner} run per sample in padded buckets on packed rows: {reason}.",
        )
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = type(module).forward
        info = self._info(kwargs)
        if info is None:
            return forward(module, *args, **kwargs)
        owner = type(module).__name__
        if info.is_branched:
            raise ValueError(
                f"{owner} is a token mixer that carries state along the sequence, and this packed batch is branched "
                "(samples continuing an earlier sample's prefix, e.g. DPO with prefix sharing): run per sample, a "
                "branch would restart the state instead of continuing its prefix's. Use prefix_sharing=False (each "
                "[prompt, completion] packed as a sample of its own) for this model."
            )
        if self.path == "conv":
            (x,) = args if args else tuple(kwargs.values())
            return packed_conv1d(module, x, info)
        _refuse_cache(owner, kwargs, args, self.parameters)
        if self._takes_varlen(owner, info, args, kwargs):
            return run_varlen(lambda *a, **k: forward(module, *a, **k), owner, info, self.varlen, args, kwargs)
        return run_padded(lambda *a, **k: forward(module, *a, **k), owner, info, args, kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "decoder": self.decoder}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["module"], state["decoder"])


class PerSampleMixers:
    """The mixer handler (:mod:`unpack_trainer.models.mixers`) of every causal token mixer the model's structure
    shows (:func:`unpack_trainer.anatomy.structure.find_token_mixers`): a bare depthwise causal ``nn.Conv1d`` gets the
    masked taps, anything else its installed kernels' varlen entry points where it can (on their device), else the
    padded buckets (see the module docstring)."""

    name = "per_sample"

    def handles(self, mixer: Any) -> bool:
        """Whether ``mixer`` (a :class:`~unpack_trainer.anatomy.structure.TokenMixer`) can run per sample."""
        return mixer.problem is None and mixer.layer is not None

    def patch(self, module: torch.nn.Module, decoder: Any) -> None:
        """Replace ``module.forward`` by the per-sample path on packed forwards (idempotent); ``decoder``: the state of
        its decoder (``decoder.running``: the packed forward running now, or ``None``)."""
        if not is_mixer_patched(module):
            module.__dict__[_FORWARD_ATTRIBUTE] = _PackedMixerForward(module, decoder)

    def unpatch(self, module: torch.nn.Module) -> None:
        """Give ``module`` its own forward back (a no-op when it is not patched)."""
        if is_mixer_patched(module):
            del module.__dict__[_FORWARD_ATTRIBUTE]


def is_mixer_patched(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is replaced by the per-sample path."""
    return isinstance(module.__dict__.get(_FORWARD_ATTRIBUTE), _PackedMixerForward)
