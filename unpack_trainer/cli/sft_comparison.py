"""Train the same model on the same data packed and padded, and measure both: wall-clock, real tokens/s, training
loss curves and the loss per token on held-out samples, with a verdict against the quality benchmark's seed noise.

This is the measuring machinery behind the main job (``examples/sft_packing.py``) and ``benchmarks/bench_quality.py``;
the example stays a readable training script that calls it.

    result, trainer = train_once("packed", make_model=..., tokenizer=tok, train_dataset=train, eval_dataset=held_out,
                                 config=dict(output_dir="out", packing=True, max_length=1024))
    print(format_table([result]))
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from unpack_trainer.packed_seq_info import SEQ_LENGTHS_KEY

QUALITY_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS_quality.json"
# Measured by benchmarks/bench_quality.py at the main job's configuration (all samples, rows of 512, 2 per step;
# the table of docs/quality.md); used when its results file is not at hand.
BENCHMARK_SEED_NOISE = {
    "command": "python benchmarks/bench_quality.py",
    "padded_std": 0.0271,
    "diff_mean": -0.0025,
    "diff_std": 0.0404,
}
NOISE_STDS = 2.0
"""How many standard deviations of the seed noise [`quality_verdict`] still calls "within the seed noise": two-sided,
about 95% of the differences that seeds alone give."""


@dataclasses.dataclass
class RunResult:
    """One training run, measured in this process (summed over processes where noted).

    Attributes:
        name: ``"packed"`` or ``"padded"``.
        setup_s: seconds in the trainer's constructor (tokenization, truncation, packing, self-check).
        train_s: seconds in ``trainer.train()`` (wall-clock; the plot's time axis starts there).
        steps: optimizer steps taken.
        samples_per_step: samples per optimizer step (per process), on average.
        real_tokens: tokens of the samples trained on, padding excluded (all processes).
        computed_tokens: tokens the model ran on, padding included (all processes).
        curve: ``(seconds since the start of training, optimizer step, training loss)`` at each logging step.
        eval_loss: loss per trained token on the held-out samples ([`held_out_loss`], the same for every run).
        samples_seen: samples trained on after each optimizer step (all processes): ``samples_seen[s - 1]`` after
            step ``s``.
    """

    name: str
    setup_s: float
    train_s: float
    steps: int
    samples_per_step: float
    real_tokens: int
    computed_tokens: int
    curve: list[tuple[float, int, float]]
    eval_loss: float
    notes: list[str] = dataclasses.field(default_factory=list)
    samples_seen: list[int] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.train_s

    @property
    def final_loss(self) -> float:
        """Training loss averaged over the logged points of the last 10% of the steps (at least the last point)."""
        reached = self.loss_at(math.inf)
        return math.nan if reached is None else reached[1]

    def loss_at(self, seconds: float) -> tuple[int, float] | None:
        """``(step, training loss)`` reached ``seconds`` into training: the loss averaged over the logged points of
        the last 10% of the steps up to then (at least the last point). ``None`` before the first logged point."""
        points = [point for point in self.curve if point[0] <= seconds]
        if not points:
            return None
        step = points[-1][1]
        tail = [loss for _, at, loss in points if at >= 0.9 * step]
        return step, sum(tail) / len(tail)


class _TokenCounter:
    """Wraps a data collator and records the real (non-pad) tokens, computed tokens and samples of every batch.

    The dataloader collates one batch ahead of the training loop, so a run stopped by ``max_steps`` collates a batch
    it never trains on; [`totals`] counts only the first ``num_batches``.
    """

    def __init__(self, collate: Callable[[list[dict]], dict]) -> None:
        self.collate = collate
        self.batches: list[tuple[int, int, int]] = []

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collate(examples)
        input_ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        real = int(mask.sum()) if mask is not None else int(input_ids.numel())
        lengths = batch.get(SEQ_LENGTHS_KEY)
        samples = int(lengths.numel()) if lengths is not None else int(input_ids.shape[0])
        self.batches.append((real, int(input_ids.numel()), samples))
        return batch

    def totals(self, num_batches: int) -> tuple[int, int, int]:
        """``(real tokens, computed tokens, samples)`` of the first ``num_batches`` batches."""
        used = self.batches[:num_batches]
        return sum(b[0] for b in used), sum(b[1] for b in used), sum(b[2] for b in used)


def _callbacks(name: str) -> tuple[Any, Any]:
    """A callback recording the loss curve against wall-clock time, and a progress bar showing the loss."""
    from transformers import ProgressCallback, TrainerCallback

    class LossClock(TrainerCallback):
        """Records ``(seconds since train begin, step, loss)`` whenever the Trainer logs a training loss."""

        def __init__(self) -> None:
            self.start = 0.0
            self.points: list[tuple[float, int, float]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.points.append((time.perf_counter() - self.start, state.global_step, float(logs["loss"])))

    class LossProgress(ProgressCallback):
        """The Trainer's progress bar with the latest loss on it, and one line per tenth of the run."""

        def __init__(self) -> None:
            super().__init__()
            self.next_line = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or self.training_bar is None or not logs or "loss" not in logs:
                return
            loss = float(logs["loss"])
            self.training_bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            if state.global_step >= self.next_line or state.global_step == state.max_steps:
                self.training_bar.write(f"[{name}] step {state.global_step:>5}/{state.max_steps}: loss {loss:.3f}")
                self.next_line = state.global_step + max(1, state.max_steps // 10)

    return LossClock(), LossProgress()


def checkpointing_off(config_cls: type) -> dict[str, bool]:
    """Turn activation checkpointing off under the name this transformers version uses (TRL defaults it to on)."""
    names = {field.name for field in dataclasses.fields(config_cls)}
    return (
        {"activation_checkpointing": False}
        if "activation_checkpointing" in names
        else {"gradient_checkpointing": False}
    )


def held_out_loss(trainer: Any) -> float:
    """Mean next-token loss over every trained token of the held-out set: summed over all tokens, then divided by
    their count (all processes), so it does not depend on how the samples are batched, padded or flattened.

    Tokens with label -100 (prompt, padding, the first token of each sample in a packed row) are not counted.
    """
    import torch
    import torch.nn.functional as F

    model = trainer.model
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=trainer.accelerator.device)
    with torch.no_grad():
        for batch in trainer.get_eval_dataloader():
            labels = batch.pop("labels")
            batch.pop("completion_mask", None)
            batch.pop("assistant_masks", None)
            logits = model(**batch).logits[:, :-1].float()
            targets = labels[:, 1:].to(logits.device)
            trained = targets != -100
            total[0] += F.cross_entropy(logits[trained], targets[trained], reduction="sum").double()
            total[1] += trained.sum()
    model.train(was_training)
    total = trainer.accelerator.reduce(total, reduction="sum")
    return float(total[0] / total[1].clamp(min=1))


def train_once(
    name: str,
    *,
    make_model: Callable[[], Any],
    tokenizer: Any,
    train_dataset: Any,
    eval_dataset: Any,
    config: dict[str, Any],
    on_trainer: Callable[[Any], None] | None = None,
) -> tuple[RunResult, Any]:
    """Build an ``unpack_trainer.SFTTrainer`` with ``config``, train, evaluate; return the measurements and trainer."""
    import torch

    from unpack_trainer import SFTConfig, SFTTrainer

    args = SFTConfig(**config, **checkpointing_off(SFTConfig))
    start = time.perf_counter()
    trainer = SFTTrainer(
        model=make_model(),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )
    setup_s = time.perf_counter() - start
    if on_trainer is not None:
        on_trainer(trainer)
    collate = trainer.data_collator
    counter = _TokenCounter(collate)
    clock, progress = _callbacks(name)
    trainer.data_collator = counter
    trainer.add_callback(clock)
    from transformers import ProgressCallback

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(progress)
    start = time.perf_counter()
    output = trainer.train()
    train_s = time.perf_counter() - start
    trainer.data_collator = collate
    eval_loss = held_out_loss(trainer)

    accumulation = args.gradient_accumulation_steps
    real, computed, samples = counter.totals(output.global_step * accumulation)
    per_step = [
        sum(b[2] for b in counter.batches[step * accumulation : (step + 1) * accumulation])
        for step in range(output.global_step)
    ]
    processes = trainer.accelerator.num_processes
    samples_seen = [processes * total for total in itertools.accumulate(per_step)]
    totals = torch.tensor([real, computed], dtype=torch.int64, device=trainer.accelerator.device)
    totals = trainer.accelerator.reduce(totals, reduction="sum").tolist()
    result = RunResult(
        name=name,
        setup_s=setup_s,
        train_s=train_s,
        steps=output.global_step,
        samples_per_step=samples / max(output.global_step, 1),
        real_tokens=int(totals[0]),
        computed_tokens=int(totals[1]),
        curve=clock.points,
        eval_loss=eval_loss,
        samples_seen=samples_seen,
    )
    return result, trainer


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def format_table(results: Sequence[RunResult]) -> str:
    headers = [
        "run",
        "steps",
        "samples/step",
        "train wall-clock (s)",
        "real tokens",
        "padding",
        "real tokens/s",
        "final train loss",
        "held-out loss/token",
    ]
    rows = [
        [
            r.name,
            f"{r.steps:,}",
            f"{r.samples_per_step:.1f}",
            f"{r.train_s:.1f}",
            f"{r.real_tokens:,}",
            f"{1 - r.real_tokens / max(r.computed_tokens, 1):.1%}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.final_loss:.3f}",
            f"{r.eval_loss:.3f}",
        ]
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [
        " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    ]
    return "\n".join(lines)


def _moving_average(values: Sequence[float], half_window: int) -> list[float]:
    """Centred moving average over ``2 * half_window + 1`` points (fewer at the ends)."""
    out = []
    for index in range(len(values)):
        window = values[max(0, index - half_window) : index + half_window + 1]
        out.append(sum(window) / len(window))
    return out


def write_plot(results: Sequence[RunResult], path: Path, *, title: str) -> None:
    """Two panels, one line per run, as a PNG: training loss against seconds since the start of training (left:
    which run is faster) and against samples trained on (right: whether the same data teaches as much)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_time, by_samples) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    for result, color in zip(results, ("tab:blue", "tab:orange")):
        seconds = [point[0] for point in result.curve]
        losses = [point[2] for point in result.curve]
        seen = [result.samples_seen[min(point[1], len(result.samples_seen)) - 1] for point in result.curve]
        label = f"{result.name}: {result.train_s:.0f} s, {result.tokens_per_s:,.0f} real tokens/s"
        for axes, xs in ((by_time, seconds), (by_samples, seen)):
            if len(losses) >= 20:  # raw points faint, a centred moving average on top
                axes.plot(xs, losses, color=color, linewidth=0.8, alpha=0.3)
                axes.plot(xs, _moving_average(losses, len(losses) // 20), color=color, label=label, linewidth=1.8)
            else:
                axes.plot(xs, losses, color=color, label=label, linewidth=1.5, marker=".")
        by_time.axvline(result.train_s, color=color, linestyle=":", linewidth=1)
    by_time.set_xlabel("wall-clock time since the start of training (s)")
    by_samples.set_xlabel("samples trained on")
    for axes in (by_time, by_samples):
        axes.set_ylabel("training loss")
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def load_seed_noise(path: Path = QUALITY_RESULTS) -> dict[str, Any]:
    """The seed noise of the held-out loss measured by ``benchmarks/bench_quality.py``: its results file when there
    is one (a checkout of the repository), else the figures of the run in docs/quality.md (``BENCHMARK_SEED_NOISE``)."""
    try:
        payload = json.loads(path.read_text())
        noise = dict(payload["seed_noise"], command=payload["command"])
        noise["padded_std"]  # noqa: B018  (the key the verdict needs)
    except (OSError, ValueError, KeyError):
        return dict(BENCHMARK_SEED_NOISE)
    return noise


def quality_verdict(packed_loss: float, padded_loss: float, noise: dict[str, Any]) -> str:
    """One line: the held-out losses, their difference, and whether it is within the seed noise the quality benchmark
    measured for that difference.

    One packed run and one padded run from the same seed differ by their packing as well as by chance, and that
    difference varies over seeds more than either run does: the yardstick is the standard deviation over seeds of
    the paired difference, packed - padded (``noise["diff_std"]``), or, without it, ``sqrt(2)`` times the padded
    run's standard deviation (two independent runs). A difference within [`NOISE_STDS`] (2) of those standard
    deviations of zero is what seeds alone give about 95% of the time (a two-sided test at the 5% level, the
    differences being roughly normal): "WITHIN the seed noise"; beyond it, "BETTER" or "WORSE". The number of
    standard deviations is printed either way.

    Example (the seed-0 run of docs/quality.md, ``examples/sft_packing.py``)::

        >>> noise = {"command": "python benchmarks/bench_quality.py", "padded_std": 0.027, "diff_mean": -0.003,
        ...          "diff_std": 0.040}
        >>> quality_verdict(2.514, 2.493, noise).split(" -> ")[1]
        'the difference is WITHIN the seed noise (0.5 std, within 2): as good as padded'
    """
    difference = packed_loss - padded_loss
    padded_std = float(noise["padded_std"])
    head = (
        f"held-out loss per token: packed {packed_loss:.3f}, padded {padded_loss:.3f} (packed - padded "
        f"{difference:+.3f}); seed noise from `{noise['command']}`: std of the padded held-out loss over seeds "
        f"{padded_std:.3f}"
    )
    if "diff_std" in noise:
        std = float(noise["diff_std"])
        head += f", packed - padded over seeds {noise['diff_mean']:+.3f} ± {std:.3f}"
    else:
        std = math.sqrt(2) * padded_std
    if std <= 0:
        if difference == 0:
            return head + " -> the difference is WITHIN the seed noise: as good as padded"
        return head + " -> no seed noise measured: run the benchmark to judge the difference"
    stds = abs(difference) / std
    if stds <= NOISE_STDS:
        verdict = f"the difference is WITHIN the seed noise ({stds:.1f} std, within {NOISE_STDS:g}): as good as padded"
        return f"{head} -> {verdict}"
    better_or_worse = "BETTER" if difference < 0 else "WORSE"
    return head + f" -> packed is {better_or_worse} by more than the seed noise ({stds:.1f} std, over {NOISE_STDS:g})"


def comparison_lines(packed: RunResult, padded: RunResult, noise: dict[str, Any] | None = None) -> list[str]:
    """The lines printed under the table of a packed and a padded run: speed, where the padded run was when the
    packed one finished, and the held-out verdict ([`quality_verdict`] against ``noise``, default
    [`load_seed_noise`])."""
    lines = [
        f"packed vs padded: {padded.train_s / packed.train_s:.2f}x less wall-clock, "
        f"{packed.tokens_per_s / padded.tokens_per_s:.2f}x the real tokens/s "
        f"(setup: tokenize + truncate + pack + self-check {packed.setup_s:.1f} s, "
        f"padded {padded.setup_s:.1f} s, not included)"
    ]
    caught_up = padded.loss_at(packed.train_s)
    if caught_up is not None:
        step, loss = caught_up
        lines.append(
            f"after {packed.train_s:.0f} s, when the packed run had finished, the padded run was at step "
            f"{step} of {padded.steps} with a training loss of {loss:.3f} (packed: {packed.final_loss:.3f})"
        )
    lines.append(
        quality_verdict(packed.eval_loss, padded.eval_loss, noise if noise is not None else load_seed_noise())
    )
    return lines
