"""The pytest plugin that runs transformers' modeling suites with every model patched
(``tests/scripts/patch_every_model.py``): every model built while it is on is patched, a refused one stays stock."""

import importlib.util
import os

import transformers

from unpack_trainer.model_zoo.tiny import tiny_config
from unpack_trainer.models import is_patched

PLUGIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "patch_every_model.py")


def _plugin():
    spec = importlib.util.spec_from_file_location("patch_every_model_under_test", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_model_built_is_patched_and_a_refused_one_stays_stock():
    plugin = _plugin()
    plugin.pytest_configure(None)
    try:
        patched = transformers.LlamaForCausalLM(tiny_config("llama"))
        refused = transformers.AutoModelForCausalLM.from_config(tiny_config("inkling_text"))
    finally:
        plugin.pytest_unconfigure(None)
    after = transformers.LlamaForCausalLM(tiny_config("llama"))
    assert is_patched(patched)
    assert not is_patched(refused)
    assert plugin._counts["refused"][type(refused).__name__] >= 1
    assert not is_patched(after)  # the plugin's unconfigure gives post_init back
