"""The run layer: a trained run on disk and held-out evaluation.

``checkpoint`` (save, list, resolve, load), ``heldout`` (the run's tokenizer,
held-out tokens, the one window maker), ``device``, ``evaluate`` (the one
held-out evaluation loop) and ``opened`` (a checkpoint with its held-out data
on a device). Training, exits, geometry, surrogates and tasks build on this
layer; it imports only ``config``, ``model`` and ``data``.
"""
