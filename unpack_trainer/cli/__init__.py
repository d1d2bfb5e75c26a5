"""The ``unpack-trainer`` command line, laid out as TRL's ``trl/cli``: [`main`] in ``main.py`` and one module per
subcommand in ``commands/`` (``analyze``, ``bench``, ``smollm2``, and ``train``: one command per trainer, ``sft``,
``dpo``, ...), the training script those launch in ``train.py``; the trainer comparison that ``bench`` runs is
``trainer_comparison.py``. ``python -m unpack_trainer.cli`` is the same as the ``unpack-trainer`` console script.
"""

from unpack_trainer.cli.main import CLIError, build_parser, main

__all__ = ["CLIError", "build_parser", "main"]
