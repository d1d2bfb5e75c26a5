"""Run by tests/test_sequence_parallel.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): a patched tiny model
inside DeepSpeed Ulysses (``sp_size=2``), each process embedding its half of a packed row, against each sample alone
in one process: logits, gradients, and the contamination probe; stock Ulysses on the same row beside it.

Usage: ``sp_model.py OUTPUT_DIR MODEL_TYPE BACKEND ...`` (backends: what ``UNPACK_ATTENTION_BACKEND`` names; ``stock``:
the model unpatched, as DeepSpeed runs it). Rank 0 writes OUTPUT_DIR/result.json: per backend and row layout, the
largest difference of the logits and of every gradient from the reference, and the largest change of another sample's
logits when one token of the first sample changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from unpack_trainer.data.collator import DataCollatorForPacking
from unpack_trainer.model_zoo.tiny import tiny_model
from unpack_trainer.models import patch_model, unpatch_model
from unpack_trainer.packed_seq_info import INFO_KEY, PACKED_INPUT_IDS_KEY, PACKED_POSITION_IDS_KEY, branched_row

SP = 2
# Four samples over a row of 64 tokens: the second crosses the shard boundary at 32.
LENGTHS = [13, 22, 9, 20]


def _samples(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def _packed(samples: list[list[int]]) -> dict:
    return DataCollatorForPacking(pad_token_id=0, sequence_shards=SP)([{"input_ids": s} for s in samples])


def _branched(samples: list[list[int]]) -> dict:
    """One prompt (sample 0) continued by three branches (samples 1-3), as DPO / GRPO lay shared prompts out."""
    row = branched_row([t for s in samples for t in s], LENGTHS, [-1, 0, 0, 0])
    return {
        "input_ids": row[PACKED_INPUT_IDS_KEY],
        "position_ids": row[PACKED_POSITION_IDS_KEY],
        INFO_KEY: row[INFO_KEY].for_sequence_shards(SP),
    }


def _alone(model, samples: list[list[int]], parents: list[int] | None) -> list[torch.Tensor]:
    """Each sample's logits alone (a branch after its prompt), in one process, without Ulysses."""
    out = []
    for index, sample in enumerate(samples):
        prefix = samples[parents[index]] if parents and parents[index] >= 0 else []
        ids = torch.tensor([prefix + sample])
        out.append(model(input_ids=ids).logits[0, len(prefix) :])
    return out


def _shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    size = tensor.shape[1] // SP
    return tensor[:, rank * size : (rank + 1) * size]


def _sharded_logits(model, batch: dict, rank: int) -> torch.Tensor:
    """This rank's shard through the model (Ulysses gathers the row for its heads), every rank's logits gathered."""
    local = model(
        input_ids=_shard(batch["input_ids"], rank),
        position_ids=_shard(batch["position_ids"], rank),
        use_cache=False,
        **({INFO_KEY: batch[INFO_KEY]} if INFO_KEY in batch else {}),
    ).logits
    gathered = [torch.empty_like(local) for _ in range(SP)]
    dist.all_gather(gathered, local.detach().contiguous())
    gathered[rank] = local  # keep this rank's share in the graph
    return torch.cat(gathered, dim=1)[0], local


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def _probe(model, batch: dict, rank: int, logits: torch.Tensor, token: int, others: list[int]) -> float:
    """The largest change of the logits of samples ``others`` when the token at ``token`` of the row changes."""
    changed = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
    changed["input_ids"][0, token] = (changed["input_ids"][0, token] + 1) % model.config.vocab_size
    with torch.no_grad():
        moved, _ = _sharded_logits(model, changed, rank)
    ends = torch.tensor(LENGTHS).cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return max(float((moved[starts[i] : ends[i]] - logits[starts[i] : ends[i]]).abs().max()) for i in others)


def run(model, backend: str, rank: int, references: dict) -> dict:
    """One backend (``stock``: ``model`` is unpatched) on both row layouts."""
    os.environ["UNPACK_ATTENTION_BACKEND"] = "" if backend == "stock" else backend
    samples = _samples(model.config.vocab_size)
    results = {}
    layouts = {"packed": (_packed, None), "branched": (_branched, [-1, 0, 0, 0])}
    for name, (build, parents) in layouts.items():
        if backend == "stock" and name == "branched":
            continue  # stock Ulysses knows no branches
        batch = build(samples)
        if backend == "stock":
            batch.pop(INFO_KEY, None)
        alone, grads = references[name]
        model.zero_grad()
        with torch.no_grad() if backend == "flex" else contextlib.nullcontext():  # flex: no backward on the CPU
            logits, local = _sharded_logits(model, batch, rank)
        ends = torch.tensor(LENGTHS).cumsum(0).tolist()
        pieces = [logits[a:b] for a, b in zip([0, *ends[:-1]], ends)]
        logit_diff = max(float((p - a).abs().max()) for p, a in zip(pieces, alone))
        grad_diff = None
        if backend != "flex":  # torch's flex_attention has no backward on the CPU
            weights = _weights(torch.Size([batch["input_ids"].shape[1], logits.shape[-1]]))
            weights[sum(LENGTHS) :] = 0  # the padding sample
            size = batch["input_ids"].shape[1] // SP
            (local[0] * weights[rank * size : (rank + 1) * size]).sum().backward()
            grad_diff = 0.0
            for n, p in model.named_parameters():
                g = p.grad.clone()
                dist.all_reduce(g)  # DeepSpeed sums the gradients of the sequence-parallel group
                grad_diff = max(grad_diff, float((g - grads[n]).abs().max()))
        logits = logits.detach()
        if parents is None:  # a token of sample 0 changed: samples 1-3 (sample 1 crosses the shard boundary)
            contamination = _probe(model, batch, rank, logits, 5, [1, 2, 3])
        else:  # a token of branch 1 changed: the prompt and the sibling branches
            contamination = _probe(model, batch, rank, logits, LENGTHS[0] + 3, [0, 2, 3])
        scale = max(float(g.abs().max()) for g in grads.values())
        results[name] = {
            "logits": logit_diff,
            "gradients": grad_diff,
            "gradient_scale": scale,
            "contamination": contamination,
        }
    return results


def _references(model) -> dict:
    """Per row layout: each sample's logits alone and the gradients of the weighted sum of them, in one process."""
    samples = _samples(model.config.vocab_size)
    references = {}
    for name, parents in (("packed", None), ("branched", [-1, 0, 0, 0])):
        model.zero_grad()
        alone = _alone(model, samples, parents)
        weights = _weights(torch.Size([sum(LENGTHS) + (-sum(LENGTHS)) % SP, alone[0].shape[-1]]))
        (torch.cat(alone) * weights[: sum(LENGTHS)]).sum().backward()
        references[name] = ([a.detach() for a in alone], {n: p.grad.clone() for n, p in model.named_parameters()})
    return references


def main(output_dir: str, model_type: str, backends: list[str]) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's own communication layer, over torch's group
    rank = dist.get_rank()
    torch.manual_seed(0)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = tiny_model(model_type, attn_implementation="sdpa", hidden_size=64, head_dim=16)
    stock = tiny_model(model_type, attn_implementation="sdpa", hidden_size=64, head_dim=16)  # the same weights, never patched
    references = _references(model)
    patch_model(model)
    # After the patch, as accelerate does it after the trainer patched: Ulysses wraps what "sdpa" maps to, ours, which
    # runs transformers' own for a model it did not patch.
    UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="sdpa", sequence_parallel_size=SP, micro_batch_size=1
    )
    results = {}
    for backend in backends:
        results[backend] = run(stock if backend == "stock" else model, backend, rank, references)
        dist.barrier()
    unpatch_model(model)
    if rank == 0:
        with open(os.path.join(output_dir, "result.json"), "w") as handle:
            json.dump(results, handle, indent=1)
    dist.barrier()
    os._exit(0)  # gloo's teardown can hang after the work is done (see ddp_train.exit_without_teardown)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
