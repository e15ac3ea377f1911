"""How a :class:`~rdepth.model.decoder.Decoder` runs its pieces, applied from outside the decoder.

The decoder builds a plan per budget (pieces and host checks) and hands each token to its executor;
an executor changes how the pieces run, never a number. The product decodes with
:class:`~rdepth.model.executors.eager.Executor` (eager pieces reading the written prefix of the cache,
a host check every ``check_every`` predicated steps of an exit loop), the decoder's default;
``decoder.use(Executor(check_every))`` changes the checks. The GPU benchmarks' executors (masked
whole-cache reads, Inductor-compiled pieces, CUDA graphs: ``bench/gpu/executors/``) keep its interface.
"""
