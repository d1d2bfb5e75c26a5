"""The varlen path of the token mixers (unpack_trainer.patches.mixer_kernels + run_varlen): a mixer whose installed
kernels take ``seq_idx`` / ``cu_seqlens`` runs once on the packed row with them, instead of the padded buckets.

causal-conv1d, flash-linear-attention and mamba-ssm run on CUDA only. On the CPU their entry points are replaced the
way transformers itself resolves them (``use_kernel_func_from_hub_with_fallback`` finding the package installed, and,
where transformers runs a package only on the device types it lists, the CPU listed for it) by stand-ins:
transformers' own torch fallback run on each sample the varlen argument marks (or, to prove that the metadata is what
keeps samples apart, one that takes the argument and ignores it). With the kernels' device type widened to the CPU,
that checks on tiny fp32 models:

- which path each mixer takes, and the reason logged when it is not the varlen one;
- packed logits == each sample alone, loss and every gradient == a padded batch (fp32, relative 1e-5);
- a stand-in that ignores the varlen argument contaminates the packed row: the equivalence and the self-check fail.

The ``gpu``-marked tests run the real kernels (the ``gpu`` extra) on CUDA.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import types

import pytest
import torch
from packed_rows import assert_packed_equals_alone, assert_same_loss_and_grads, random_samples, two_rows

from unpack_trainer._logging import reset_log_once
from unpack_trainer.anatomy.structure import discover
from unpack_trainer.model_zoo.tiny import loss_and_grads, padded_batch, tiny_model
from unpack_trainer.models import patch_model, unpatch_model
from unpack_trainer.patches import mixer_kernels
from unpack_trainer.patches import mixers as mixer_patches
from unpack_trainer.patches.mixer_kernels import DECODE_STEP_NAMES, kernel_entry, varlen_plan
from unpack_trainer.selfcheck import check_uncontaminated

# The keywords each family's forward needs for its kernels to keep samples apart (what its code hands on).
EXPECTED_KEYWORDS = {
    "qwen3_5_text": (("seq_idx", "seq_idx"), ("cu_seq_lens_q", "cu_seqlens")),
    "granitemoehybrid": (("seq_idx", "seq_idx"),),
    "lfm2": (("seq_idx", "seq_idx"),),
    "kimi_linear": (("seq_idx", "seq_idx"), ("cu_seqlens", "cu_seqlens")),
}
FAMILIES = list(EXPECTED_KEYWORDS)
# The import name of each kernel's package, as transformers' modeling code names it.
PACKAGES = {"flash-linear-attention": "fla", "mamba-ssm": "mamba_ssm", "causal-conv1d": "causal_conv1d"}
PACKAGES_BY_IMPORT = {module: distribution for distribution, module in PACKAGES.items()}


# -- CPU stand-ins for the installed kernels ---------------------------------------------------------------------------


def _segments(batch, length, seq_idx, cu_seqlens):
    """``[(row, start, end)]`` of every sample the varlen argument marks (one per row without one)."""
    if cu_seqlens is not None:
        if batch != 1:  # as flash-linear-attention
            raise ValueError(f"The batch size is expected to be 1 rather than {batch} when using `cu_seqlens`.")
        bounds = cu_seqlens.tolist()
        return [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:])]
    if seq_idx is not None:
        assert seq_idx.shape == (batch, length) and seq_idx.dtype == torch.int32, (seq_idx.shape, seq_idx.dtype)
        found = []
        for row in range(batch):
            _, counts = torch.unique_consecutive(seq_idx[row], return_counts=True)
            start = 0
            for count in counts.tolist():
                found.append((row, start, start + count))
                start += count
        return found
    return [(row, 0, length) for row in range(batch)]


def _stand_in(torch_function, varlen, time_dim, *, honour, calls):
    """A CPU kernel taking ``varlen`` (``"seq_idx"`` or ``"cu_seqlens"``): ``torch_function`` run on each sample it
    marks (``honour=False``: on the whole rows, the argument ignored). Sequence tensors are the arguments with 3 or more
    dimensions whose first is the batch; ``time_dim`` is their time axis. Records the varlen argument of every call in
    ``calls``."""
    signature = inspect.signature(torch_function)

    def kernel(*args, **kwargs):
        marker = kwargs.pop(varlen, None)
        calls.append(marker)
        bound = signature.bind(*args, **kwargs)
        first = next(iter(bound.arguments.values()))
        batch, length = first.shape[0], first.shape[time_dim]
        if not honour:
            marker = None
        seq_idx, cu_seqlens = (marker, None) if varlen == "seq_idx" else (None, marker)
        segments = _segments(batch, length, seq_idx, cu_seqlens)
        rows: dict[int, list] = {}
        for row, start, end in segments:
            call = {}
            for name, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[0] == batch:
                    value = value[row : row + 1].narrow(time_dim, start, end - start)
                call[name] = value
            kw = call.pop("kwargs", {})
            rows.setdefault(row, []).append(torch_function(**call, **kw))
        first = rows[min(rows)][0]
        if first is None:  # a fused kernel declining, as transformers' fallback does: the model takes its unfused path
            return None
        per_token = (lambda part: part[0]) if isinstance(first, tuple) else (lambda part: part)
        out = torch.cat([torch.cat([per_token(p) for p in rows[row]], dim=time_dim) for row in sorted(rows)])
        return (out, None) if isinstance(first, tuple) else out  # no final state is requested on the packed path

    parameters = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    parameters.append(inspect.Parameter(varlen, inspect.Parameter.KEYWORD_ONLY, default=None))
    parameters += [p for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
    kernel.__signature__ = signature.replace(parameters=parameters)
    return kernel


def run_package_on_cpu(monkeypatch, package):
    """Where transformers runs an installed kernel package only on the device types it lists for it
    (``hub_kernels._PACKAGE_SUPPORTED_DEVICES``, transformers 5.25; inputs on any other device take the torch fallback,
    which refuses ``seq_idx`` / ``cu_seqlens``), list the CPU too, so that a CPU stand-in decorated from now on runs as
    the real package runs on a GPU. Nothing to do where transformers has no such list (it then runs the package on every
    device)."""
    from transformers.integrations import hub_kernels

    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if isinstance(devices, dict) and package in devices and "cpu" not in devices[package]:
        monkeypatch.setitem(devices, package, (*devices[package], "cpu"))


def install_stand_in_kernels(monkeypatch, model, *, honour=True, only=None):
    """Resolve every sequence kernel of ``model``'s modeling module(s) (those named in ``only``, when given) as
    transformers would with the package installed, to a CPU stand-in (see :func:`_stand_in`) that runs on the CPU
    (:func:`run_package_on_cpu`; whether the varlen path is taken there is still up to ``KERNEL_DEVICE_TYPES``).
    Returns ``{kernel name: [varlen argument of each call]}``."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    calls: dict[str, list] = {}
    modules = {sys.modules[type(m.module).__module__] for m in discover(model).mixers}
    for module in modules:
        for name, value in list(vars(module).items()):
            entry = kernel_entry(value)
            if entry is None or DECODE_STEP_NAMES.search(entry.hub_name):
                continue
            if only is not None and entry.hub_name not in only:
                continue
            # the fallback wrapper itself, also inside the `kernels` function module transformers 5.25 makes of it
            closure = inspect.getclosurevars(mixer_kernels._fallback_wrapper(value)).nonlocals
            torch_function, package = closure["torch_function"], closure["package"]
            varlen = "cu_seqlens" if package == "fla" else "seq_idx"
            time_dim = -1 if entry.hub_name == "causal_conv1d_fn" else 1
            record = calls.setdefault(entry.hub_name, [])
            kernel = _stand_in(torch_function, varlen, time_dim, honour=honour, calls=record)
            fake = types.ModuleType(package)
            setattr(fake, entry.hub_name, kernel)
            monkeypatch.setitem(sys.modules, package, fake)
            run_package_on_cpu(monkeypatch, package)  # read when the wrapper is made
            wrapper = use_kernel_func_from_hub_with_fallback(entry.hub_name, package)(torch_function)
            monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The stand-in kernels run on the CPU: widen the kernels' device types."""
    monkeypatch.setattr(mixer_kernels, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))


# -- which path --------------------------------------------------------------------------------------------------------


def _func_module(obj):
    """What the `kernels` package makes of a function decorated with its ``use_kernel_forward_from_hub``: an
    ``nn.Module`` instance whose class (carrying the layer name) has a forward that calls the function. Where ``obj``
    already is one (``kernels`` installed, transformers 5.25), a fresh instance of its own class, as
    ``use_kernelized_func`` keeps one per layer; else one built the way ``kernels`` builds it."""
    if isinstance(obj, torch.nn.Module):
        return type(obj)()
    func = obj  # the name the class's forward closes over, as in `kernels`

    class Func(torch.nn.Module):
        kernel_layer_name = func.__name__

        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


def test_kernel_entry_reads_the_kernels_package_function_modules():
    from transformers.models.lfm2 import modeling_lfm2

    fallback = kernel_entry(modeling_lfm2.causal_conv1d_fn)
    assert fallback is not None and not fallback.installed and fallback.distribution == "causal-conv1d"
    wrapped = _func_module(modeling_lfm2.causal_conv1d_fn)
    assert kernel_entry(wrapped) == fallback
    wrapped.forward = types.MethodType(type(wrapped).forward, wrapped)  # kernelize without a kernel for it
    assert kernel_entry(wrapped) == fallback

    def hub_forward(self, x, weight, bias=None, seq_idx=None, activation=None):
        return x

    wrapped.forward = types.MethodType(hub_forward, wrapped)  # kernelize with a hub kernel layer
    entry = kernel_entry(wrapped)
    assert entry.installed and entry.accepts == ("seq_idx",)
    assert kernel_entry(torch.nn.functional.conv1d) is None


@pytest.mark.parametrize("model_type", FAMILIES)
def test_without_the_kernels_the_plan_names_the_torch_fallbacks(model_type):
    model = tiny_model(model_type)
    for mixer in discover(model).mixers:
        plan = varlen_plan(mixer.module)
        assert plan.reason is not None and "torch fallback" in plan.reason and "is not installed" in plan.reason
        assert plan.keywords == ()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_with_varlen_kernels_the_plan_hands_the_model_its_own_keywords(model_type, monkeypatch):
    model = tiny_model(model_type)
    install_stand_in_kernels(monkeypatch, model)
    for mixer in discover(model).mixers:
        plan = varlen_plan(mixer.module)
        assert plan.reason is None, plan
        assert plan.keywords == EXPECTED_KEYWORDS[model_type]


def test_a_kernel_fed_no_metadata_keeps_the_padded_path(monkeypatch):
    """Mamba calls `selective_scan_fn` with no metadata, so even with every kernel installed it runs padded."""
    model = tiny_model("mamba")
    install_stand_in_kernels(monkeypatch, model)
    (mixer, *_) = discover(model).mixers
    plan = varlen_plan(mixer.module)
    assert plan.reason is not None and "no packing metadata" in plan.reason, plan


# -- kernels reached through module-level helpers (transformers 5.25) --------------------------------------------------

# A modeling module written as transformers 5.25 writes them: the mixers call module-level helpers (one decorated
# with `use_kernel_forward_from_hub`, a `kernels` function module where transformers uses that package) that call the
# kernel.
HELPER_MODELING_SOURCE = """
import torch
from transformers.integrations import use_kernel_forward_from_hub, use_kernel_func_from_hub_with_fallback


@use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")
def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    return hidden_states


@use_kernel_forward_from_hub("causal_conv1d_forward")
def conv_forward(hidden_states, weight, **kwargs):
    return causal_conv1d_fn(hidden_states, weight, **kwargs)


def two_hops(hidden_states, weight, **kwargs):
    return conv_forward(hidden_states, weight, **kwargs)


def reads_seq_idx(hidden_states, weight, **kwargs):
    return causal_conv1d_fn(hidden_states, weight, seq_idx=kwargs.get("seq_idx"))


def takes_seq_idx(hidden_states, weight, seq_idx=None, **kwargs):
    return causal_conv1d_fn(hidden_states, weight, **kwargs)


class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 3))


class Splat(Mixer):
    def forward(self, hidden_states, **kwargs):
        return conv_forward(hidden_states, self.weight, **kwargs)


class TwoHops(Mixer):
    def forward(self, hidden_states, **kwargs):
        return two_hops(hidden_states, self.weight, **kwargs)


class NoSplat(Mixer):
    def forward(self, hidden_states, **kwargs):
        return conv_forward(hidden_states, self.weight)


class ReadsInHelper(Mixer):
    def forward(self, hidden_states, **kwargs):
        return reads_seq_idx(hidden_states, self.weight, **kwargs)


class ReadsInHelperNoSplat(Mixer):
    def forward(self, hidden_states, **kwargs):
        return reads_seq_idx(hidden_states, self.weight)


class HelperTakesIt(Mixer):
    def forward(self, hidden_states, **kwargs):
        return takes_seq_idx(hidden_states, self.weight, **kwargs)
"""


@pytest.fixture
def helper_modeling(monkeypatch, tmp_path):
    """:data:`HELPER_MODELING_SOURCE` imported as a transformers modeling module, its kernel resolved to an installed
    causal-conv1d (a CPU stand-in taking ``seq_idx``). Returns ``(module, [seq_idx of each kernel call])``."""
    calls = []

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
        calls.append(seq_idx)
        return x

    fake = types.ModuleType("causal_conv1d")
    fake.causal_conv1d_fn = causal_conv1d_fn
    monkeypatch.setitem(sys.modules, "causal_conv1d", fake)
    run_package_on_cpu(monkeypatch, "causal_conv1d")
    name = "transformers.models.unpack_trainer_helpers.modeling_unpack_trainer_helpers"
    path = tmp_path / "modeling_unpack_trainer_helpers.py"
    path.write_text(HELPER_MODELING_SOURCE)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module, calls


@pytest.mark.parametrize(
    ("mixer", "reason"),
    [
        ("Splat", None),
        ("TwoHops", None),
        ("ReadsInHelper", None),
        ("NoSplat", "NoSplat.forward (through `conv_forward`) hands `causal_conv1d_fn` no packing metadata"),
        (
            "ReadsInHelperNoSplat",
            "ReadsInHelperNoSplat.forward (through `reads_seq_idx`) passes `seq_idx` to `causal_conv1d_fn` from no "
            "keyword argument",
        ),
        (
            "HelperTakesIt",
            "HelperTakesIt.forward (through `takes_seq_idx`) hands `causal_conv1d_fn` no packing metadata",
        ),
    ],
)
def test_a_kernel_reached_through_module_level_helpers(mixer, reason, helper_modeling):
    """transformers 5.25's mixers call their kernels inside module-level helpers (LFM2: ``forward`` ->
    ``causal_conv1d_forward(..., **kwargs)`` -> ``causal_conv1d_fn(..., **kwargs)``). The plan follows them: a forward
    keyword reaches the kernel only through an unbroken chain of ``**kwargs`` splats (not past a helper that takes it
    by name), ``kwargs.get("seq_idx")`` inside a helper reads it only at the end of such a chain; and the call does what
    the plan says: the kernel receives the forward's ``seq_idx`` exactly where the plan hands it one."""
    module, calls = helper_modeling
    plan = varlen_plan(getattr(module, mixer)())
    assert plan.kernels == ("causal_conv1d_fn (causal-conv1d)",)
    assert plan.reason == reason
    assert plan.keywords == ((("seq_idx", "seq_idx"),) if reason is None else ())
    marker = torch.zeros(1, 4, dtype=torch.int32)
    getattr(module, mixer)()(torch.zeros(1, 2, 4), seq_idx=marker)
    assert len(calls) == 1 and calls[0] is (marker if reason is None else None)


def test_helpers_are_followed_a_few_calls_deep(helper_modeling, monkeypatch):
    module, _ = helper_modeling
    monkeypatch.setattr(mixer_kernels, "HELPER_DEPTH", 1)
    assert varlen_plan(module.Splat()).reason is None
    assert varlen_plan(module.TwoHops()).reason == "TwoHops calls no kernel with a varlen entry point"


def test_the_plan_reads_the_kernel_copies_a_layer_keeps():
    """With the `kernels` package (transformers 5.25), a layer whose class carries ``use_kernelized_func`` keeps its own
    copy of each kernel function module (``_kernel_funcs``, an instance of the global's class), its forward sends the
    calls to the global to that copy, and ``kernelize`` puts a hub kernel on the copy, not on the global. The plan
    reads the copy: a hub kernel taking ``seq_idx`` there gets it (and the forward's ``seq_idx`` reaches it); a helper
    whose copy ``kernelize`` replaced runs code the plan cannot read and is not followed."""
    from transformers.models.lfm2 import modeling_lfm2

    model = tiny_model("lfm2").eval()
    (mixer, *_) = discover(model).mixers
    copies = vars(mixer.module).get("_kernel_funcs")
    if not copies:
        pytest.skip("transformers keeps no per-layer kernel function copies here (it uses no `kernels` package)")

    def copy_of(function_module):
        return next(copy for copy in copies.values() if type(copy) is type(function_module))

    assert "causal-conv1d is not installed" in varlen_plan(mixer.module).reason
    seen = []

    def hub_forward(self, x, weight, bias=None, seq_idx=None, activation=None):
        seen.append(seq_idx)
        return x

    conv = copy_of(modeling_lfm2.causal_conv1d_fn)
    conv.forward = types.MethodType(hub_forward, conv)  # what kernelize does with a hub kernel for it
    plan = varlen_plan(mixer.module)
    assert plan.reason is None and plan.keywords == (("seq_idx", "seq_idx"),), plan
    marker = torch.zeros(1, 5, dtype=torch.int32)
    with torch.no_grad():
        mixer.module(torch.randn(1, 5, model.config.hidden_size), seq_idx=marker)
    assert len(seen) == 1 and seen[0] is marker
    helper = copy_of(modeling_lfm2.causal_conv1d_forward)
    helper.forward = types.MethodType(lambda self, conv1d, hidden_states, *args, **kwargs: hidden_states, helper)
    assert varlen_plan(mixer.module).reason == "Lfm2ShortConv calls no kernel with a varlen entry point"


@pytest.mark.parametrize("on_cpu", [True, False])
def test_the_path_taken_and_its_reason_are_logged(on_cpu, monkeypatch, caplog):
    model = tiny_model("lfm2").eval()
    calls = install_stand_in_kernels(monkeypatch, model)
    if on_cpu:
        monkeypatch.setattr(mixer_kernels, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    reset_log_once()
    batch = two_rows(random_samples())
    patch_model(model)
    try:
        with caplog.at_level(logging.INFO, logger=mixer_patches.__name__), torch.no_grad():
            model(**{k: v for k, v in batch.items() if k != "labels"})
    finally:
        unpatch_model(model)
    messages = [r.getMessage() for r in caplog.records if "Lfm2ShortConv" in r.getMessage()]
    assert len(messages) == 1, messages
    if on_cpu:
        assert "varlen entry points" in messages[0] and "`seq_idx`" in messages[0]
        assert calls["causal_conv1d_fn"] and all(c is not None for c in calls["causal_conv1d_fn"])
    else:
        assert "padded buckets" in messages[0] and "tensors are on cpu" in messages[0]
        assert calls["causal_conv1d_fn"] and all(c is None for c in calls["causal_conv1d_fn"])


# -- exactness ---------------------------------------------------------------------------------------------------------


def assert_varlen_packed_row_is_exact(model, monkeypatch, *, records):
    """The patched ``model`` runs two packed rows of :func:`random_samples` without the padded buckets: logits ==
    each sample alone, loss and every gradient == a padded batch. ``records`` (lists of kernel calls) are emptied
    after the unpatched reference runs, so they hold the packed run's calls."""
    padded_path = []
    monkeypatch.setattr(mixer_patches, "run_padded", lambda *a, **k: padded_path.append(a) or pytest.fail("padded"))
    samples = random_samples()
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in samples]
    padded_loss, padded_grads = loss_and_grads(model, padded_batch(samples), skip_unused=True, use_cache=False)
    for record in records:
        record.clear()
    patch_model(model)
    try:
        batch = two_rows(samples)
        assert_packed_equals_alone(model, batch, alone)
        model.train()
        loss, grads = loss_and_grads(model, batch, skip_unused=True, use_cache=False)
    finally:
        unpatch_model(model)
    assert not padded_path
    assert_same_loss_and_grads(loss, grads, padded_loss, padded_grads)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_varlen_path_packed_equals_each_sample_alone_and_padded(model_type, monkeypatch, cpu_kernels):
    model = tiny_model(model_type).eval()
    calls = install_stand_in_kernels(monkeypatch, model)
    assert_varlen_packed_row_is_exact(model, monkeypatch, records=list(calls.values()))
    reached = {name: c for name, c in calls.items() if c}
    assert reached and all(marker is not None for c in reached.values() for marker in c), calls


@pytest.mark.parametrize("reentrant", [False, True])
def test_varlen_path_under_gradient_checkpointing(reentrant, monkeypatch, cpu_kernels):
    """A checkpointed layer recomputes its mixer in the backward with the metadata of its forward."""
    model = tiny_model("qwen3_5_text")
    calls = install_stand_in_kernels(monkeypatch, model)
    samples = random_samples()
    padded_loss, padded_grads = loss_and_grads(model, padded_batch(samples), skip_unused=True, use_cache=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    calls["chunk_gated_delta_rule"].clear()
    patch_model(model)
    try:
        loss, grads = loss_and_grads(model, two_rows(samples), skip_unused=True, use_cache=False)
    finally:
        unpatch_model(model)
    layers = sum(t == "linear_attention" for t in model.config.layer_types)
    recorded = calls["chunk_gated_delta_rule"]
    assert len(recorded) == 2 * layers and all(c is not None for c in recorded)  # forward + recomputation
    assert_same_loss_and_grads(loss, grads, padded_loss, padded_grads)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_kernel_that_ignores_the_varlen_argument_is_caught(model_type, monkeypatch, cpu_kernels):
    """The metadata is what keeps samples apart: the same stand-ins ignoring it contaminate the packed row."""
    model = tiny_model(model_type).eval()
    install_stand_in_kernels(monkeypatch, model, honour=False)
    samples = random_samples()
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in samples]
    patch_model(model)
    try:
        batch = two_rows(samples)
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        report = check_uncontaminated(model)
    finally:
        unpatch_model(model)
    pieces = torch.cat(list(logits)).split([5, 3, 1, 7])
    error = max(float((piece - expected).abs().max()) for piece, expected in zip(pieces, alone))
    assert error > 1e-3, f"a kernel ignoring seq_idx / cu_seqlens left the packed row exact ({error:.2e})"
    assert not report.ok, f"the self-check passed a contaminated varlen path: {report.summary()}"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_selfcheck_passes_on_the_varlen_path(model_type, monkeypatch, cpu_kernels):
    model = tiny_model(model_type)
    install_stand_in_kernels(monkeypatch, model)
    patch_model(model)
    try:
        report = check_uncontaminated(model)
    finally:
        unpatch_model(model)
    assert report.ok and report.conclusive, report.summary()


# -- flash-linear-attention without causal-conv1d ----------------------------------------------------------------------


def install_fla_convolution(monkeypatch, calls):
    """A CPU stand-in for ``fla.modules.convolution.causal_conv1d`` (``x`` ``(1, T, D)``, ``weight`` ``(D, W)``,
    ``cu_seqlens``): transformers' torch convolution run on each sample ``cu_seqlens`` marks; records ``cu_seqlens``."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    wrapper = mixer_kernels._fallback_wrapper(modeling_qwen3_5.causal_conv1d_fn)
    torch_conv = inspect.getclosurevars(wrapper).nonlocals["torch_function"]

    def causal_conv1d(x, weight=None, bias=None, activation=None, cu_seqlens=None, **kwargs):
        calls.append(cu_seqlens)
        bounds = cu_seqlens.tolist()
        pieces = [
            torch_conv(x[:, start:end].transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
            for start, end in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(pieces, dim=1), None

    for name in ("fla.modules", "fla.modules.convolution"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["fla.modules.convolution"].causal_conv1d = causal_conv1d


@pytest.mark.parametrize("fla_convolution", [False, True])
def test_gated_delta_net_runs_varlen_with_fla_alone(fla_convolution, monkeypatch, cpu_kernels):
    """Issue 26 item 6: flash-linear-attention installed, causal-conv1d not. The gated delta rule takes cu_seqlens,
    and the short convolution, whose torch fallback would mix samples, runs packed_causal_conv1d: through
    flash-linear-attention's varlen convolution where it imports, else the exact torch path. The packed row runs once
    (no padded buckets): logits == each sample alone, loss and gradients == padded. Before: the torch fallback of
    causal_conv1d_fn made the plan refuse and every mixer ran the padded buckets."""
    model = tiny_model("qwen3_5_text").eval()
    calls = install_stand_in_kernels(monkeypatch, model, only={"chunk_gated_delta_rule"})
    conv_calls = []
    if fla_convolution:
        install_fla_convolution(monkeypatch, conv_calls)
    replaced_conv = []
    original = mixer_kernels.packed_causal_conv1d
    monkeypatch.setattr(
        mixer_kernels, "packed_causal_conv1d", lambda *a, **k: replaced_conv.append(1) or original(*a, **k)
    )
    for mixer in discover(model).mixers:
        plan = varlen_plan(mixer.module)
        assert plan.reason is None and plan.keywords == EXPECTED_KEYWORDS["qwen3_5_text"], plan
        assert [name for _, name in plan.replaced] == ["causal_conv1d_fn"]
    assert_varlen_packed_row_is_exact(model, monkeypatch, records=[calls["chunk_gated_delta_rule"], replaced_conv])
    assert calls["chunk_gated_delta_rule"] and replaced_conv
    assert bool(conv_calls) == fla_convolution and all(c is not None for c in conv_calls)
    from transformers.models.qwen3_5 import modeling_qwen3_5

    assert kernel_entry(modeling_qwen3_5.causal_conv1d_fn).hub_name == "causal_conv1d_fn"  # restored after each call


def test_packed_causal_conv1d_by_hand():
    """Two samples [1, 2, 3 | 4, 5] in one channel, kernel [a, b, c] = [1, 10, 100]: each output sums the taps of its
    own sample only (no silu): y = [100, 210, 321 | 400, 540]."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0]]])
    weight = torch.tensor([[1.0, 10.0, 100.0]])
    seq_idx = torch.tensor([[0, 0, 0, 1, 1]], dtype=torch.int32)
    out = mixer_kernels.packed_causal_conv1d(x, weight, None, None, seq_idx)
    assert out.tolist() == [[[100.0, 210.0, 321.0, 400.0, 540.0]]]


# -- the real kernels --------------------------------------------------------------------------------------------------


# The packages each family's varlen path needs (Qwen3.5: flash-linear-attention alone, the convolution runs
# packed_causal_conv1d without causal-conv1d).
CUDA_PACKAGES = {
    "qwen3_5_text": ("fla",),
    "lfm2": ("causal_conv1d",),
    "granitemoehybrid": ("mamba_ssm", "causal_conv1d"),
    "falcon_h1": ("mamba_ssm", "causal_conv1d"),
    "mamba2": ("mamba_ssm", "causal_conv1d"),
}


def _fla_gated_backward_refusal() -> str | None:
    """Why flash-linear-attention itself refuses the gated delta rule's backward here, read from its own flags
    (fla 0.6: on Hopper with Triton >= 3.4 and < 3.7.1, "produces incorrect results for gated chunk_bwd_dqkwg"), or
    ``None``. An installation's limit, not ours: stock transformers fails the same way on such a machine."""
    import fla.utils

    flags = [getattr(fla.utils, name, None) for name in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")]
    if None in flags or not (flags[0] and flags[1] and not flags[2]):
        return None
    import triton

    return f"flash-linear-attention refuses the gated delta rule's backward on Hopper with Triton {triton.__version__}"


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", list(CUDA_PACKAGES))
def test_varlen_path_on_cuda_with_the_installed_kernels(model_type, monkeypatch):
    """The `gpu` extra's kernels: the varlen path is taken, and packed == each sample alone within a small multiple
    of the bf16 error the same model makes against its fp32 self; gradients flow through the kernels. Skipped, with
    the packages named, where the family's kernels are not installed (no causal-conv1d / mamba-ssm wheel installs
    without a CUDA build)."""
    import importlib.util

    missing = [package for package in CUDA_PACKAGES[model_type] if importlib.util.find_spec(package) is None]
    if missing:
        pytest.skip(f"{model_type}'s varlen kernels need {', '.join(PACKAGES_BY_IMPORT[p] for p in missing)}")
    refusal = _fla_gated_backward_refusal() if "fla" in CUDA_PACKAGES[model_type] else None
    if refusal:
        pytest.skip(refusal)
    model = tiny_model(model_type).eval().cuda()
    for mixer in discover(model).mixers:
        plan = varlen_plan(mixer.module)
        assert plan.reason is None, plan
    padded_path = []
    original = mixer_patches.run_padded
    monkeypatch.setattr(mixer_patches, "run_padded", lambda *a, **k: padded_path.append(1) or original(*a, **k))
    samples = [s.cuda() for s in random_samples()]
    with torch.no_grad():
        reference = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0].float() for s in samples]
        model.to(torch.bfloat16)
        alone = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0].float() for s in samples]
    patch_model(model)
    try:
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in two_rows(samples).items()}
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        model.train()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
    finally:
        unpatch_model(model)
    assert not padded_path
    assert torch.isfinite(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    packed = torch.cat(list(logits)).split([5, 3, 1, 7])
    for index, (piece, single, exact) in enumerate(zip(packed, alone, reference)):
        bf16_error = float((single - exact).abs().max())
        error = float((piece - exact).abs().max())
        assert error <= 4 * bf16_error + 1e-2, f"sample {index}: {error:.3e} vs bf16 error {bf16_error:.3e}"
