"""``rdepth calibrate``: one threshold per group for a quality target, chosen by replaying recorded
loop iterates (``run``), with its settings in ``config`` (torch-free). It writes an exit profile
(:mod:`rdepth.exitrun.profile`), which ``rdepth eval``, ``generate`` and ``export`` apply.
"""
