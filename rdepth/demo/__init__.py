"""``rdepth demo``: the main job on the embedded default data, end to end on a CPU.

- ``run``: :class:`DemoConfig` and :func:`run_demo`, the text mode's pipeline (prepare, train,
  evaluate, analyse, sweep) and the hand-over to the task mode;
- ``task``: the task mode, the default (task data, a looped model beside its no-loop baseline,
  accuracy per difficulty and loop budget, exits, geometry);
- ``report`` and ``task_report``: each mode's first screen, built from the saved files only.
"""

from rdepth.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
