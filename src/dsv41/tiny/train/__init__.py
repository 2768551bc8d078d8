"""Training the built-in tiny model (`dsv41 train-tiny`, docs/TINY_MODEL.md).

corpus.py (what it reads) -> data.py (token streams, batches by seed and step) -> net.py (the batched,
differentiable forward and the losses) -> trainer.py (AdamW, autocast, resumable checkpoints) -> export.py (the
release's FP8 layout, read by `dsv41.model.loader.load_model`). layout.py holds the trained config and reads the
tensor layout from a make-tiny skeleton; quant.py the storage and activation roundings with straight-through
gradients.
"""
