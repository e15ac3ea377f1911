"""The exit rules on a run: what is saved beside it and how a run is evaluated under them.

The rules themselves live in :mod:`rdepth.exits`, below the run layer; this package sits above it
(dependencies point down the list):

* ``evaluate``: teacher-forced held-out evaluation with exits (through the run layer's one evaluation
  loop); ``gate_file``: the learned exit gate on disk beside a checkpoint, tied to its weights;
* ``profile``: a policy with one threshold per group, saved as JSON beside a run;
* ``profile_eval``: a profile evaluated on a run's held-out data (``rdepth eval --exit-profile``).

The workflows that make profiles and gates live beside this package: :mod:`rdepth.sweep`
(``rdepth sweep``) and :mod:`rdepth.calibrate` (``rdepth calibrate``, ``rdepth gate``).
"""
