"""Block-recurrent (Raptor) surrogates of pretrained transformers and their depth dynamics.

Layout: ``config`` (torch-free settings: ``SurrogateRunConfig``, ``FitConfig``);
``teachers/`` (the teachers read layer by layer, their loaders and registry, their inputs);
``measure/`` (layer similarity, fidelity, retention, dynamics, basins, loop geometry);
``phases`` / ``choose`` (phases from the similarity structure) <- ``model`` (the surrogate)
<- ``bank`` / ``fit``; the pipelines ``run`` (text), ``vision`` (the Fashion-MNIST ViT) and
``text_probe`` (the WordNet probe); ``pages/`` (report pages and figures, drawn from the saved
numbers).

Typical use::

    teacher = load_teacher("minilm-l6")                      # rdepth.surrogate.teachers.registry
    lengths = dp_phases(similarity[1:, 1:], k=2)            # phases over layer outputs
    surrogate = RaptorSurrogate(teacher, SurrogateConfig(lengths))
    fit_surrogate(surrogate, bank, FitConfig())
"""
