"""One DPO training step of a built trainer on one batch, and what the equivalence tests compare from it, shared by
``tests/test_dpo_trainer.py`` (tiny models) and ``tests/test_real_model.py`` (SmolLM2). Importable from every test
folder: pytest puts ``tests/`` (the folder of the root ``conftest.py``) on ``sys.path``.
"""

from __future__ import annotations

import torch


def one_dpo_step(trainer, examples: list[dict]) -> dict:
    """``trainer.compute_loss`` and its backward on the collated ``examples`` (one batch), in train mode.

    Returns the loss (detached), every parameter gradient (cloned), the per-pair chosen/rejected log-probs of
    ``compute_ref_log_probs`` (``(2, num_pairs)``), the last logged value of every train metric, the trainer and the
    prepared batch.
    """
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    model = trainer.model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        logps = torch.stack(trainer.compute_ref_log_probs(model, batch))
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return {"loss": loss.detach(), "grads": grads, "metrics": metrics, "logps": logps, "trainer": trainer,
            "batch": batch}  # fmt: skip
