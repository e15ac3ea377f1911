"""``rdepth sweep``: exit policies measured against fixed loop budgets (paper §4, Figure 4, Appendix D).

Built on the exit rules of :mod:`rdepth.exits`; dependencies point down the list:

* ``config`` (:class:`~rdepth.sweep.config.SweepConfig`, torch-free) and ``stats`` (torch-free:
  median, IQR and the noise rule);
* ``timing`` (warm, synchronised latency in interleaved rounds) and ``measure`` (one setting's
  quality and latency);
* ``summary`` (the saved format and every headline number, computed once);
* ``run`` (text data: orchestration and :func:`~rdepth.sweep.run.sweep_checkpoint`) and ``task``
  (reasoning-task data: answer accuracy against loop steps);
* ``plots``, ``report`` and ``task_report``, which only read a saved result.
"""
