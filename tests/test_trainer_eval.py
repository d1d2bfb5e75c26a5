"""Evaluation loss of the trainer: how the batches of an evaluation are weighed into ``eval_loss``."""

from __future__ import annotations

import pytest
import trl

from unpack_trainer import SFTTrainer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _metrics(prediction):
    return {"n": float(prediction.label_ids.shape[0])}


@pytest.mark.parametrize("setup", ["padding_free", "packing_with_metrics"])
def test_streamed_eval_loss_equals_stock_with_a_short_last_batch(
    tokenizer, tmp_path, setup, prompt_completion, sft_args, tiny_llama
):
    """Issue 20 item 1: 10 streamed examples in batches of 4; the short last batch was weighed as a full one (batch
    dispatching is off for packed training, so accelerate does not know the remainder)."""
    extra, kwargs = ({}, {}) if setup == "padding_free" else ({"packing": True}, {"compute_metrics": _metrics})

    def evaluate(cls, config_cls, **config):
        trainer = cls(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, cls=config_cls, per_device_eval_batch_size=4, **config),
            train_dataset=prompt_completion(),
            eval_dataset=prompt_completion(10, seed=1).to_iterable_dataset(),
            processing_class=tokenizer,
            **kwargs,
        )
        return trainer, trainer.evaluate()

    ours, ours_metrics = evaluate(SFTTrainer, type(sft_args(tmp_path)), **extra)
    _, stock_metrics = evaluate(trl.SFTTrainer, trl.SFTConfig)
    assert ours.unpack_decision.mode == ("padding_free" if setup == "padding_free" else "pack")
    assert ours_metrics["eval_loss"] == pytest.approx(stock_metrics["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("stream", [False, True])
def test_sample_normalized_packed_eval_is_the_mean_over_samples(
    tokenizer, tmp_path, stream, prompt_completion, sft_args, tiny_llama
):
    """Issue 20 item 6: with ``loss_normalization="sample"`` and packed evaluation rows over several batches, each
    batch weighed as one row instead of by its samples. The reference: padded evaluation in one batch (the mean
    over samples of each sample's mean token loss)."""

    def evaluate(**config):
        eval_dataset = prompt_completion(12, seed=1)
        trainer = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, loss_normalization="sample", **config),
            train_dataset=prompt_completion(),
            eval_dataset=eval_dataset.to_iterable_dataset() if stream else eval_dataset,
            processing_class=tokenizer,
        )
        return trainer, trainer.evaluate()

    packed, packed_metrics = evaluate(packing=True, per_device_eval_batch_size=1)
    padded, padded_metrics = evaluate(padding_free=False, per_device_eval_batch_size=64)
    assert packed.unpack_decision.mode == "pack" and padded.unpack_decision.mode == "padded"
    assert packed_metrics["eval_loss"] == pytest.approx(padded_metrics["eval_loss"], rel=1e-5)
