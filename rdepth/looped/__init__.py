"""Looped models that ship inside ``transformers`` (HRM-Text, Inkling-2), driven step by step.

``protocol``: the adapter protocol (embed, enter a loop, one step, leave, readout, each step's KV slots)
and the drivers every feature shares (:func:`~rdepth.looped.protocol.forward`,
:func:`~rdepth.looped.protocol.greedy`); ``hrm_text`` and ``inkling2``: the adapters, calling the
``transformers`` classes' own modules; ``load``: adapters by ``model_type`` and folder loading;
``geometry``: rdepth's loop-geometry metrics over the adapter's iterates; ``exits``: per-token exit of
HRM-Text's loops under the training-free rules. The commands on a folder of such a model (recognised by
``load.looped_source``): ``analyze`` (``rdepth analyze``: rdepth's observer, summary, page and claim judges over
the adapter's loops), ``sweep`` (``rdepth sweep``: every rule against the full and fixed budgets on a text) and
``generate`` (``rdepth generate``, fixed budget or ``--exit``). rdepth's own model is untouched: these drive a
foreign implementation, they do not copy it.
"""
