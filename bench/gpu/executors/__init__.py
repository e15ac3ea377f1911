"""The GPU benchmarks' decoder executors (the product decodes with :class:`rdepth.model.executors.eager.Executor`):

* :class:`~bench.gpu.executors.masked.Masked`: eager pieces reading the whole cache (or a fixed span of it)
  under an additive mask, the fixed shapes compiled pieces and captured graphs need;
* :class:`~bench.gpu.executors.compiled.Compiled`: the loop step with its exit rule, and each run of
  single-pass layers, through Inductor (``torch.compile(fullgraph=True)``);
* :class:`~bench.gpu.executors.graphs.Captured`: the main budget's pieces recorded as CUDA graphs and
  replayed (optionally one set of graphs per read span, ``span_buckets``).

``decoder.use(Compiled(check_every=None))``, then ``Captured.record(decoder)``: the way gpt-fast applies
``torch.compile`` from the caller. The GPU suite (``bench/gpu``), ``bench/decode_speed.py``,
``bench/batched_exits.py`` and their exactness tests apply them.
"""
