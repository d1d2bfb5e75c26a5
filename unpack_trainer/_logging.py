"""The package's one log-once helper, like transformers' ``logger.warning_once``: each message once per process, on
the main process only, with a reset for tests."""

from __future__ import annotations

import logging
import os

__all__ = ["is_main_process", "log_once", "reset_log_once"]

_logged: set[tuple[int, str]] = set()


def is_main_process() -> bool:
    """Whether this is the main process: rank 0 of an initialized ``torch.distributed`` group, else ``RANK`` unset or
    ``0`` (set by ``torchrun`` / ``accelerate launch`` before the group exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


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
