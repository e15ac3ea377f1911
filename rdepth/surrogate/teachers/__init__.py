"""The teachers a surrogate is fitted to, read layer by layer: plain-PyTorch layers (``layers``), the
loaders of Hugging Face folders (``hf_loader``) and of the packaged MiniLMs (``minilm``, ``onnx_loader``),
rdepth's own non-recurrent runs (``rdepth_teacher``), the Fashion-MNIST ViT (``vit``), the registry by
name or path (``registry``), and their inputs (``text``: token batches; ``sentences``: corpus sentences)."""
