"""pytest plugin: every transformers model a test session builds is passed to ``unpack_trainer.patch_model``.

Used to run transformers' own modeling test suites with every model patched, so that a patched model is shown to
behave as a stock one wherever no packed batch is involved (padded batches, generation with every cache, save / load,
resizing, gradient checkpointing, ...). ``PreTrainedModel.post_init`` (which every model's ``__init__`` calls last) is
wrapped: the model just built is patched; a refusal (:class:`unpack_trainer.PatchRefused`, or a ``TypeError`` for a
module holding no decoder) leaves it stock, as the trainer would. Any other error of ``patch_model`` fails the test that
built the model. At the end the terminal summary counts the models patched and refused, per class.

Not collected by our own suite (the file name does not start with ``test_``). With ``$HF_TESTS`` the untarred PyPI
sdist of the installed transformers (``pip download transformers==<version> --no-deps --no-binary :all:``; its
``tests/`` holds the common mixins), the per-type driver ``tests/scripts/hf_modeling_suite.py`` of this folder runs
stock and patched::

    cd $HF_TESTS && OMP_NUM_THREADS=1 PYTHONPATH=$HF_TESTS:$REPO:$REPO/tests/scripts UNPACK_HF_TYPES=lfm2 \\
        python -m pytest -q -p no:cacheprovider --noconftest --timeout=240 -rA \\
        $REPO/tests/scripts/hf_modeling_suite.py                      # stock
    ... the same with ``-p patch_every_model`` added                  # every model patched

(``$REPO`` is this repository; ``-p patch_every_model`` needs ``$REPO/tests/scripts`` on ``PYTHONPATH``.) Setting
``UNPACK_PATCH_EVERY_MODEL=0`` turns the plugin off without removing ``-p``.
"""

from __future__ import annotations

import collections
import functools
import os

_counts: dict[str, collections.Counter] = {"patched": collections.Counter(), "refused": collections.Counter()}
_refusals: dict[str, str] = {}
_original_post_init = None


def _patch_after_post_init(post_init):
    @functools.wraps(post_init)
    def post_init_then_patch(self, *args, **kwargs):
        result = post_init(self, *args, **kwargs)
        from unpack_trainer.models import PatchRefused, patch_model

        name = type(self).__name__
        try:
            patch_model(self)
        except (PatchRefused, TypeError) as refused:
            _counts["refused"][name] += 1
            _refusals.setdefault(name, str(refused).splitlines()[0][:200])
        else:
            _counts["patched"][name] += 1
        return result

    return post_init_then_patch


def pytest_configure(config):
    global _original_post_init
    if os.environ.get("UNPACK_PATCH_EVERY_MODEL", "1") == "0" or _original_post_init is not None:
        return
    from transformers import PreTrainedModel

    _original_post_init = PreTrainedModel.post_init
    PreTrainedModel.post_init = _patch_after_post_init(_original_post_init)


def pytest_unconfigure(config):
    global _original_post_init
    if _original_post_init is not None:
        from transformers import PreTrainedModel

        PreTrainedModel.post_init = _original_post_init
        _original_post_init = None


def pytest_terminal_summary(terminalreporter):
    if not (_counts["patched"] or _counts["refused"]):
        return
    write = terminalreporter.write_line
    write(
        f"patch_every_model: {sum(_counts['patched'].values())} models patched, "
        f"{sum(_counts['refused'].values())} refused"
    )
    for name, count in sorted(_counts["patched"].items()):
        write(f"  patched {count:5d}  {name}")
    for name, count in sorted(_counts["refused"].items()):
        write(f"  refused {count:5d}  {name}: {_refusals[name]}")
