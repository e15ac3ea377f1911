"""Block-recurrent (Raptor) surrogates of pretrained transformers and their depth dynamics.

Pieces, in dependency order: ``config`` (torch-free settings: ``SurrogateRunConfig``,
``FitConfig``) and ``layers`` (plain-PyTorch layers, :class:`Teacher`) <- ``text``
(sentences -> padded batches) <- ``hf_loader`` / ``onnx_loader`` / ``minilm`` /
``rdepth_teacher`` (teachers from checkpoints, packages and rdepth runs) <- ``teachers``
(the registry: a teacher and its sentence encoder by name or path) <- ``similarity`` /
``phases`` (layer-similarity structure) <- ``model`` (the surrogate) <- ``bank`` / ``fit`` /
``evaluate`` / ``dynamics`` / ``geometry`` <- ``run`` (the ``rdepth surrogate`` pipeline) ->
``plots`` / ``report`` (drawn from the saved numbers). ``vit`` holds the small
Fashion-MNIST ViTs of ``scripts/vit_stochastic_depth.py``.

Typical use::

    teacher = load_teacher("minilm-l6")                      # rdepth.surrogate.teachers
    lengths = dp_phases(similarity[1:, 1:], k=2)            # phases over layer outputs
    surrogate = RaptorSurrogate(teacher, SurrogateConfig(lengths))
    fit_surrogate(surrogate, bank, FitConfig())
"""
