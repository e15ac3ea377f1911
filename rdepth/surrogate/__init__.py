"""Block-recurrent (Raptor) surrogates of pretrained transformers and their depth dynamics.

Pieces, in dependency order: ``layers`` (plain-PyTorch layers, :class:`Teacher`) <-
``hf_loader`` / ``minilm`` / ``onnx_loader`` (teachers from checkpoints and packages) <-
``similarity`` / ``phases`` (layer-similarity structure) <- ``model`` (the surrogate) <-
``bank`` / ``fit`` / ``evaluate`` / ``dynamics`` <- ``run`` (the ``rdepth surrogate``
pipeline) -> ``plots`` / ``report`` (drawn from the saved numbers). ``vit`` holds the small
Fashion-MNIST ViTs of ``scripts/vit_stochastic_depth.py``.

Typical use::

    teacher = load_teacher("minilm-l6")                      # or a Hugging Face folder
    lengths = dp_phases(similarity[1:, 1:], k=2)            # phases over layer outputs
    surrogate = RaptorSurrogate(teacher, SurrogateConfig(lengths))
    fit_surrogate(surrogate, bank, FitConfig())
"""
