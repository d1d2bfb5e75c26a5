"""The data path: from rows on disk to the packed batch a model consumes, one stage per file, in the order data flows.

1. read: ``files.py`` (local JSONL / Parquet / Arrow / ``save_to_disk`` files -> rows), ``default_data.py`` (the
   shipped demo dataset, tokenizer and tiny model config, beside their files in this folder),
   ``default_preference_data.py`` (the demo preference pairs, made from the demo dataset)
2. prepare: ``preparation.py`` (a tokenized dataset -> truncated or packed rows with a ``seq_lengths`` column; the
   trainer only calls it)
3. pack: ``packing.py`` (lengths -> which samples share a row), ``streaming.py`` (the same on a stream, through a
   buffer), ``tensor_packing.py`` (token sequences written straight into packed tensors)
4. order: ``sampler.py`` (which rows each optimizer step and each process gets)
5. collate: ``collator.py`` (rows -> one flat batch: ``position_ids``, ``packed_seq_lengths``, ``cu_seq_lens_*``,
   labels ``-100`` at every sample start), ``preference.py`` (preference pairs -> one packed row beside TRL's padded
   view, the prompt once)

Beside the path: ``validation.py`` (the checks of ids, lengths and overflow every stage shares) and ``estimate.py``
(lengths -> packed rows needed and the estimated speedup, for the trainer's start line and ``unpack-trainer analyze``).

A module here imports only from this folder and the package's cross-cutting modules (``unpack_trainer._logging``,
``unpack_trainer.packed_seq_info``, whose constants name every key a batch carries, ``unpack_trainer._compat`` and
``unpack_trainer._trl_compat``); never from the kernels, models, trainers or CLI above it (``tests/test_layering.py``).
Users import the public names from the package root (``from unpack_trainer import pack_dataset,
DataCollatorForPacking``), not from these modules. Nothing is imported here: ``import unpack_trainer.data.files``
stays free of torch.
"""
