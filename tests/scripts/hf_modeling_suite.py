"""transformers' common modeling tests (``ModelTesterMixin`` of the installed version) on a tiny model of each type.

One ``unittest`` class per ``model_type`` of :data:`MODEL_TYPES`, named ``HF_<model_type>``, inherits transformers'
``tests.test_modeling_common.ModelTesterMixin`` (the ~170 tests every model of transformers must pass: forward,
save / load, resizing, gradient checkpointing, attention implementations, training, ...) with a tester in the shape of
transformers' ``CausalLMModelTester`` (batch 13, length 7, a lower-triangular ``attention_mask``) on
:func:`unpack_trainer.model_zoo.tiny.tiny_config` of the type, and every model class the auto mappings have for it (base model,
causal LM, sequence / token classification, question answering). Five generation checks stand in for transformers'
``GenerationTesterMixin`` (not in transformers' sdist): greedy ``generate`` with the model's cache equals greedy
decoding without a cache (on a left-padded batch too), continuing from the returned cache equals generating at once,
``inputs_embeds`` generates what ``input_ids`` does, and beam search runs.

Not collected by our own suite; run from transformers' test tree of the installed version, stock and with
``-p patch_every_model`` (see ``tests/scripts/patch_every_model.py`` for the commands)::

    cd $HF_TESTS && OMP_NUM_THREADS=1 PYTHONPATH=$HF_TESTS:$REPO:$REPO/tests/scripts UNPACK_HF_TYPES=lfm2 \\
        python -m pytest -q -p no:cacheprovider --noconftest --timeout=240 -rA [-p patch_every_model] \\
        $REPO/tests/scripts/hf_modeling_suite.py

``$HF_TESTS`` is the folder holding transformers' ``tests/`` of the installed version: its common mixins are in the PyPI
sdist (``pip download transformers==<installed version> --no-deps --no-binary :all:``, then untar it: ``$HF_TESTS`` is
the ``transformers-<version>/`` folder). Its ``exporters/``, ``generation/`` and ``utils/`` helpers are not in the sdist:
this module puts empty stand-ins for the three names ``test_modeling_common`` imports from them into ``sys.modules``
(so the ``torch.export`` tests and transformers' ``GenerationTesterMixin`` tests are not run; the checks below stand
in for the second). ``UNPACK_HF_TYPES="lfm2 mamba2"`` restricts the classes built.
"""

from __future__ import annotations

import os
import sys
import types
import unittest

import torch
import transformers
from transformers.models.auto import modeling_auto

from unpack_trainer.model_zoo.tiny import tiny_config


def _stand_in(name: str, **attributes) -> None:
    """An empty module ``name`` (and its package) in ``sys.modules``, unless transformers' tests tree has it."""
    try:
        __import__(name)
    except ImportError:
        package = name.rpartition(".")[0]
        sys.modules.setdefault(package, types.ModuleType(package))
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules[name] = module


_stand_in("tests.exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
_stand_in("tests.generation.test_utils", GenerationTesterMixin=type("GenerationTesterMixin", (), {}))
_stand_in("tests.utils.test_configuration_utils", config_common_kwargs={})

from tests.generation.test_utils import GenerationTesterMixin  # noqa: E402  transformers' tests/ ($HF_TESTS)
from tests.test_modeling_common import ModelTesterMixin, ids_tensor  # noqa: E402

# The token-mixer types patched for issue 18 (hybrid, state-space, recurrent), the ALiBi and chunked-attention types,
# and the others newly patched with them.
MODEL_TYPES = (
    "qwen3_5_text qwen3_5_moe_text qwen3_next lfm2 granitemoehybrid nemotron_h falcon_h1 mamba2 mamba jamba bamba "
    "zamba2 bloom mpt llama4_text lfm2_moe lfm3 falcon_mamba zamba kimi_linear olmo_hybrid minimax rwkv xlstm "
    "recurrent_gemma bailing_hybrid zaya dbrx gemma3n_text gemma4_text"
).split()

_MAPPINGS = (
    modeling_auto.MODEL_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
)


class TinyTester:
    """What ``ModelTesterMixin`` reads from ``self.model_tester`` (the shape of transformers' ``CausalLMModelTester``)."""

    batch_size = 13
    seq_length = 7
    is_training = True
    vocab_size = 99

    def __init__(self, parent: unittest.TestCase, model_type: str) -> None:
        self.parent, self.model_type = parent, model_type
        config = self.get_config()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.hidden_size = text.hidden_size
        self.num_hidden_layers = text.num_hidden_layers
        self.num_attention_heads = getattr(text, "num_attention_heads", None)

    def get_config(self):
        config = tiny_config(self.model_type, vocab_size=self.vocab_size)
        for name, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
            if hasattr(config, name):
                setattr(config, name, value)
        return config

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class GenerationChecks(GenerationTesterMixin):
    """Generation with the model's own cache equals decoding without one (stand-in for ``GenerationTesterMixin``)."""

    def _causal_lm(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        classes = [c for c in self.all_model_classes if c.can_generate()]
        if not classes:
            self.skipTest("no generative model class")
        torch.manual_seed(0)
        return classes[0](config).eval(), inputs

    @staticmethod
    def _greedy_without_cache(model, input_ids, attention_mask, new_tokens):
        for _ in range(new_tokens):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            input_ids = torch.cat([input_ids, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(input_ids), 1))], dim=-1)
        return input_ids

    def _assert_cached_greedy_equals_no_cache(self, model, input_ids, attention_mask):
        """4 greedy tokens through ``generate`` (KV cache) == 4 full forwards without a cache."""
        with torch.no_grad():
            cached = model.generate(
                input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, min_new_tokens=4
            )
            reference = self._greedy_without_cache(model, input_ids, attention_mask, 4)
        torch.testing.assert_close(cached, reference)

    def test_generate_greedy_with_cache_equals_no_cache(self):
        model, inputs = self._causal_lm()
        input_ids = inputs["input_ids"][:2, :5]
        self._assert_cached_greedy_equals_no_cache(model, input_ids, torch.ones_like(input_ids))

    def test_generate_greedy_left_padded_equals_no_cache(self):
        model, inputs = self._causal_lm()
        input_ids = inputs["input_ids"][:2, :5].clone()
        attention_mask = torch.ones_like(input_ids)
        input_ids[1, :2], attention_mask[1, :2] = model.config.pad_token_id or 0, 0
        self._assert_cached_greedy_equals_no_cache(model, input_ids, attention_mask)

    def test_generate_continue_from_past_key_values(self):
        model, inputs = self._causal_lm()
        input_ids = inputs["input_ids"][:2, :5]
        greedy = {"do_sample": False, "return_dict_in_generate": True}
        with torch.no_grad():
            whole = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4, **greedy)
            first = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2, **greedy)
            rest = model.generate(
                first.sequences,
                attention_mask=torch.ones_like(first.sequences),
                past_key_values=first.past_key_values,
                max_new_tokens=2,
                **greedy,
            )
        torch.testing.assert_close(rest.sequences, whole.sequences)

    def test_generate_from_inputs_embeds_equals_input_ids(self):
        model, inputs = self._causal_lm()
        input_ids = inputs["input_ids"][:2, :5]
        attention_mask = torch.ones_like(input_ids)
        with torch.no_grad():
            from_ids = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
            embeds = model.get_input_embeddings()(input_ids)
            from_embeds = model.generate(
                inputs_embeds=embeds, attention_mask=attention_mask, max_new_tokens=3, do_sample=False
            )
        torch.testing.assert_close(from_embeds, from_ids[:, input_ids.shape[1] :])

    def test_generate_beam_search_runs(self):
        model, inputs = self._causal_lm()
        input_ids = inputs["input_ids"][:2, :5]
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=3, num_beams=2, do_sample=False
            )
        self.assertEqual(out.shape[0], 2)


def _model_classes(model_type: str) -> tuple[type, ...]:
    names = [mapping.get(model_type) for mapping in _MAPPINGS]
    return tuple(getattr(transformers, name) for name in dict.fromkeys(names) if name and hasattr(transformers, name))


def _test_class(model_type: str) -> type:
    def setUp(self):
        # transformers' ids_tensor / floats_tensor draw from an unseeded global_rng: seeded here, a stock run and a
        # patched run of a test see the same inputs and weights, so their results can be compared test by test.
        sys.modules[ModelTesterMixin.__module__].global_rng.seed(0)
        torch.manual_seed(0)
        self.model_tester = TinyTester(self, model_type)

    return type(
        f"HF_{model_type}",
        (ModelTesterMixin, GenerationChecks, unittest.TestCase),
        {"all_model_classes": _model_classes(model_type), "setUp": setUp, "__module__": __name__},
    )


for _model_type in os.environ.get("UNPACK_HF_TYPES", " ".join(MODEL_TYPES)).split():
    globals()[f"HF_{_model_type}"] = _test_class(_model_type)
