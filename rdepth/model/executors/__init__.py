"""How a :class:`~rdepth.model.decoder.Decoder` runs its pieces, applied from outside the decoder.

The decoder builds a plan per budget (pieces and host checks) and hands each token to its executor;
an executor changes how the pieces run, never a number:

* :class:`~rdepth.model.executors.eager.Executor` (the default): eager pieces reading the written
  prefix of the cache, a host check every ``check_every`` predicated steps of an exit loop;
* :class:`~rdepth.model.executors.compiled.Compiled`: the loop step with its exit rule, and each run of
  single-pass layers, through Inductor (``torch.compile(fullgraph=True)``);
* :class:`~rdepth.model.executors.graphs.Captured`: the main budget's pieces recorded as CUDA graphs and
  replayed (optionally one set of graphs per read span, ``span_buckets``).

``decoder.use(Compiled(check_every=None))``, then ``Captured.record(decoder)``: the way gpt-fast applies
``torch.compile`` from the caller. The product decodes with the default; the GPU benchmarks
(``bench/gpu``) and their exactness tests apply the others.
"""
