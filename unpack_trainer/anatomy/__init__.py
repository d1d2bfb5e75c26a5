"""What a transformers model is made of, read from the model and its code (no list of architectures), and nothing
else: no hooks, no state on its modules, no registration. The patch (:mod:`unpack_trainer.models`) decides from it
what to change; the self-check, the trainers and ``unpack-trainer env`` ask it what a model is.

- :mod:`~unpack_trainer.anatomy.structure`: the decoder, its layers, its attention modules and what each hands its
  attention function, its token mixers (:func:`~unpack_trainer.anatomy.structure.discover`, once per model);
- :mod:`~unpack_trainer.anatomy.attention`: what its attention asks of a packed backend (features, head dims);
- :mod:`~unpack_trainer.anatomy.vision`: what a vision-language model is made of (its multimodal model, text decoder,
  position layout and image-block rule), what of it cannot be packed exactly, and what its own functions give each
  sample (multimodal positions, image spans) and each sequence-parallel shard (its image features);
- :mod:`~unpack_trainer.anatomy.score_head`: a sequence-classification model's decoder and score head, and whether it
  pools at the last non-pad token.

Nothing here changes a model (no hooks, no state on its modules, no registration): the structure is read from the
model and its code (a model built on the ``meta`` device too), and what runs is the model's own functions
(``get_rope_index``, ``get_block_sequence_ids_for_mask``, ``get_image_features``) on the inputs given.

This room stands on the floor of ``model_zoo/`` and beside it (neither imports the other), above the kernels it asks
which token mixers they make exact (``patches/mixers.py``) and the carrier of sample boundaries, below the patch.
Importing it imports neither torch nor transformers.
"""
