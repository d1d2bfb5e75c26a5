"""The package's one log-once helper, like transformers' ``logger.warning_once``: each message once per process, on
the main process only, with a reset for tests."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["announce_level", "is_main_process", "log_once", "quiet_loggers", "reset_log_once"]

_logged: set[tuple[int, str]] = set()


def is_main_process() -> bool:
    """Whether this is the main process: rank 0 of an initialized ``torch.distributed`` group, else ``RANK`` unset or
    ``0`` (set by ``torchrun`` / ``accelerate launch`` before the group exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def announce_level() -> int:
    """The level of the one line per trainer every user should see (what the trainer decided, or that
    ``UNPACK_DISABLE`` turned the package off): ``WARNING`` -- shown at transformers' default verbosity, as
    transformers' and TRL's own notices are, by Python's last-resort handler when no logging is configured -- while
    transformers' verbosity (the Trainer's ``log_level``, ``TRANSFORMERS_VERBOSITY``, ``set_verbosity_*``) is
    ``WARNING`` or more verbose; ``INFO`` once the user turned it above ``WARNING`` (``log_level="error"``)."""
    from transformers.utils import logging as hf_logging

    return logging.WARNING if hf_logging.get_verbosity() <= logging.WARNING else logging.INFO


def log_once(logger: logging.Logger, level: int, message: str, *, main_process_only: bool = True) -> None:
    """Log ``message`` at ``level`` the first time it is seen in this process, on the main process only (unless
    ``main_process_only=False``). The package's one log-once helper; ``reset_log_once()`` forgets what was logged."""
    if (level, message) in _logged:
        return
    _logged.add((level, message))
    if main_process_only and not is_main_process():
        return
    logger.log(level, message, stacklevel=2)


def reset_log_once() -> None:
    """Forget every message [`log_once`] has logged (for tests, or a second trainer that should log again)."""
    _logged.clear()


@contextlib.contextmanager
def quiet_loggers() -> Iterator[None]:
    """transformers' and this package's loggers at error level inside the block, where throwaway configs and models
    are built (their notices say nothing about the user's run)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    ours = logging.getLogger("unpack_trainer")
    previous = ours.level
    ours.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        ours.setLevel(previous)
