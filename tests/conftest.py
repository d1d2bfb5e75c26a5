"""Fixtures shared by every test module: tiny models and the character tokenizer (built by
:mod:`unpack_trainer.model_zoo.tiny`), the trainer tests' arguments and data, and the clean-up after each test and module.

Test modules never import each other: what two of them share lives here.
"""

import gc
import random

import pytest
import torch

from unpack_trainer._logging import reset_log_once
from unpack_trainer.model_zoo import tiny

# The tests use tiny tensors: more than one intra-op thread only adds synchronisation, and on a shared 2-core machine
# it turns milliseconds into seconds.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds the checkout's directory names
            item.add_marker(skip_gpu)


# ---------------------------------------------------------------------------------------------------------- clean-up


@pytest.fixture(autouse=True)
def one_thread():
    """Torch on one CPU thread for every test (tiny tensors: one thread is faster than two, and far faster on a
    machine shared with other jobs), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_log_once():
    """Every test starts and ends with the package's log-once memory empty (``unpack_trainer._logging``)."""
    reset_log_once()
    yield
    reset_log_once()


@pytest.fixture(autouse=True, scope="module")
def _release_patched_models():
    """Collect each module's patched models at its end, so that the RoPE replacement does not outlive them (a patched
    model restores the modeling module's RoPE function when it is garbage collected; see ``patch_model``)."""
    yield
    gc.collect()


# --------------------------------------------------------------------------------------- stand-in attention kernels


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """``stand_in_kernel(backend, kernel, *, cpu=False, dtypes=None)``: for this test, the optional kernel the attention
    backend ``backend`` declares (its record's ``kernel``) loads as ``kernel`` (``None``: not installed); with ``cpu``
    it runs on the CPU as on CUDA, in ``dtypes`` (the kernel's own when ``None``). The record in ``REGISTRY`` is
    replaced for the test, as a new backend's would be listed."""
    from unpack_trainer.patches.attention import REGISTRY

    def install(backend, kernel, *, cpu=False, dtypes=None):
        record = REGISTRY[backend]
        declared = record.kernel._replace(
            load=lambda: kernel,
            device_types=("cuda", "cpu") if cpu else record.kernel.device_types,
            dtypes=dtypes or record.kernel.dtypes,
        )
        monkeypatch.setitem(REGISTRY, backend, record._replace(kernel=declared))

    return install


@pytest.fixture
def wrap_backends(monkeypatch):
    """``wrap_backends(wrap)``: for this test, every attention backend's forward is ``wrap(name, forward)`` (its
    record replaced in ``REGISTRY``); ``wrap_backends()`` records the name of every backend that runs and returns
    the list."""
    from unpack_trainer.patches.attention import REGISTRY

    def install(wrap=None):
        ran = []

        def record_run(name, forward):
            def spy(*args, **kwargs):
                ran.append(name)
                return forward(*args, **kwargs)

            return spy

        for name, record in list(REGISTRY.items()):
            monkeypatch.setitem(REGISTRY, name, record._replace(forward=(wrap or record_run)(name, record.forward)))
        return ran

    return install


# ------------------------------------------------------------------------------------------ tiny models, a tokenizer


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(model_type, *, seed=0, attn_implementation=None, **config_overrides)``: a tiny random causal LM
    of any architecture (:func:`unpack_trainer.model_zoo.tiny.tiny_model`; an override of ``None`` takes the config class's
    default)."""
    return tiny.tiny_model


@pytest.fixture(scope="session")
def tiny_llama():
    """``tiny_llama(vocab_size=128, seed=0, **config_overrides)``: the trainer tests' Llama (hidden 32, 2 layers, 4
    heads, 2 key/value heads, 512 positions, pad/bos/eos ids 0/1/2, the usual 0.02 initializer range)."""

    def build(vocab_size: int = 128, seed: int = 0, **overrides):
        overrides = dict(max_position_embeddings=512, initializer_range=None) | overrides
        return tiny.tiny_model("llama", seed=seed, vocab_size=vocab_size, **overrides)

    return build


@pytest.fixture(scope="module")
def tokenizer():
    """The character-level tokenizer (:func:`unpack_trainer.model_zoo.tiny.char_tokenizer`); a module that needs another one
    defines its own ``tokenizer`` fixture."""
    return tiny.char_tokenizer()


# ------------------------------------------------------------------------------------- the trainer tests' set-up


@pytest.fixture
def sft_args():
    """``sft_args(tmp_path, cls=SFTConfig, **overrides)``: one SGD step on the CPU, batch 64, ``max_length`` 48, no
    saving, no reporting, seed 0."""
    from unpack_trainer import SFTConfig

    def build(tmp_path, cls=SFTConfig, **kwargs):
        defaults = dict(
            output_dir=str(tmp_path / "out"),
            report_to="none",
            bf16=False,
            use_cpu=True,
            max_length=48,
            per_device_train_batch_size=64,
            max_steps=1,
            learning_rate=0.5,
            optim="sgd",
            lr_scheduler_type="constant",
            warmup_steps=0,
            gradient_checkpointing=False,
            save_strategy="no",
            logging_steps=1,
            dataloader_num_workers=0,
            seed=0,
            data_seed=0,
        )
        return cls(**(defaults | kwargs))

    return build


@pytest.fixture
def prompt_completion():
    """``prompt_completion(n=24, seed=0)``: a ``datasets.Dataset`` of ``n`` random prompt (1-20 letters) / completion
    (1-40 letters) pairs over ``a``-``j``."""
    from datasets import Dataset

    def build(n=24, seed=0):
        rng = random.Random(seed)
        letters = "abcdefghij"
        return Dataset.from_list(
            [
                {
                    "prompt": "".join(rng.choice(letters) for _ in range(rng.randint(1, 20))),
                    "completion": "".join(rng.choice(letters) for _ in range(rng.randint(1, 40))),
                }
                for _ in range(n)
            ]
        )

    return build


@pytest.fixture
def sft_train(tiny_llama, prompt_completion):
    """``sft_train(tokenizer, args, dataset=None, **trainer_kwargs) -> (trainer, train_output)``: our ``SFTTrainer``
    on a fresh ``tiny_llama`` (vocabulary of ``tokenizer``), trained; ``dataset`` defaults to
    ``prompt_completion()``."""
    from unpack_trainer import SFTTrainer

    def train(tokenizer, args, dataset=None, **kwargs):
        model = tiny_llama(vocab_size=len(tokenizer))
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset or prompt_completion(), processing_class=tokenizer, **kwargs
        )
        result = trainer.train()
        return trainer, result

    return train


@pytest.fixture
def param_snapshot():
    """``param_snapshot(model) -> {name: detached copy}`` of every named parameter."""

    def snapshot(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    return snapshot


# ------------------------------------------------------------------------------- a leaking branched attention path


def _sibling_leak(self):
    """A broken ``branch_units``: each prompt and all of its branches as one causal unit, so the second branch
    attends to the first (positions stay branched)."""
    from unpack_trainer.packed_seq_info import PackedSeqInfo

    lengths, parents = self.seq_lengths.tolist(), self.seq_parents.tolist()
    units = []
    for length, parent in zip(lengths, parents):
        if parent < 0:
            units.append(length)
        else:
            units[-1] += length
    gather = torch.arange(self.total_tokens)
    return PackedSeqInfo(torch.tensor(units), batch_size=1, seq_len=self.total_tokens), gather, gather


def _parents_ignored(record, query, key, value, info, options):
    """A broken branched attention: every sample attends only to itself, so a branch never sees its prompt."""
    return record.forward(query, key, value, info, options)


@pytest.fixture
def leak_branches(monkeypatch):
    """``leak_branches(kind)``: make the patched branched attention path (shared prompts, ``packed_seq_parents``) leak
    for the rest of the test: ``"sibling"`` (a branch sees the other branch) or ``"parents"`` (a branch does not see
    its prompt). Plain packed samples are untouched."""
    from unpack_trainer.packed_seq_info import PackedSeqInfo
    from unpack_trainer.patches.attention import dispatch

    def leak(kind: str) -> None:
        if kind == "sibling":
            # Every backend takes the [prefix; branch] units (no query-once spans), and the units leak.
            monkeypatch.setattr(PackedSeqInfo, "_build_branch_spans", lambda self: None)
            monkeypatch.setattr(PackedSeqInfo, "_build_branch_units", _sibling_leak)
        else:
            monkeypatch.setattr(dispatch, "_branched", _parents_ignored)

    return leak


# ------------------------------------------------------------------------------------- Liger-Kernel on the CPU

_LIGER_INTERPRETED: list[bool] = []  # whether this process imported Liger-Kernel under Triton's interpreter


def _triton_language_interpreted() -> bool:
    """On a machine without a GPU, import Triton's language under its interpreter, before any test module imports it
    (TRL does, compiled): ``triton.jit`` decides at import whether a function is interpreted, and an interpreted
    kernel (Liger-Kernel's, on CPU tensors) cannot call the compiled ``tl.max`` / ``tl.sum`` of a standard library
    imported without it. Nothing here launches a compiled kernel (the project's own RoPE kernel uses none of them).
    Returns whether Triton's language is interpreted in this process."""
    import importlib.util
    import os
    import sys

    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    if "triton.language" in sys.modules:
        from triton.runtime.jit import JITFunction

        return not isinstance(sys.modules["triton.language"].standard.max, JITFunction)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return True


_TRITON_LANGUAGE_INTERPRETED = _triton_language_interpreted()


@pytest.fixture
def liger_interpreted(monkeypatch):
    """Liger-Kernel's Triton kernels on CPU tensors: ``TRITON_INTERPRET=1`` for the test, and Liger-Kernel imported
    under it (``triton.jit`` decides at import whether a function is interpreted, so the first import in the process
    must be this fixture's). Skips without Liger-Kernel, on a machine with a GPU (its ``gpu`` tests run the compiled
    kernels in this process) and after an import without the interpreter."""
    import importlib.util
    import sys

    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("Liger-Kernel is not installed")
    if torch.cuda.is_available():
        pytest.skip("Liger-Kernel's kernels are tested compiled on this machine's GPU (the gpu tests)")
    if not _TRITON_LANGUAGE_INTERPRETED:
        pytest.skip("Triton's language was imported in this process without TRITON_INTERPRET=1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not _LIGER_INTERPRETED:
        if any(name == "liger_kernel" or name.startswith("liger_kernel.") for name in sys.modules):
            pytest.skip("Liger-Kernel was imported in this process without TRITON_INTERPRET=1")
        from unpack_trainer import _compat

        if _compat.liger_linear_cross_entropy() is None:
            pytest.skip("the installed Liger-Kernel has no per-token losses with forward gradients")
        _LIGER_INTERPRETED.append(True)
    _interpret_floats_as_fp32(monkeypatch)


def _interpret_floats_as_fp32(monkeypatch) -> None:
    """Have Triton's interpreter pass a kernel's Python ``float`` arguments as fp32 scalars, as compiled Triton does
    (the interpreter leaves them Python floats, a known gap of its: "TODO: wrap everything in triton tensors"), so
    kernels that call ``.to`` on one (Liger-Kernel's RMSNorm, SwiGLU, softcapped cross-entropy) run interpreted."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    monkeypatch.setattr(interpreter, "_implicit_cvt", implicit_cvt)
