"""``rdepth reproduce``: a paper's claims, end to end, inside a time budget.

``two-scale`` (the only paper so far) prepares data if needed, measures the
training speed on the device, sizes a model and a token count to the budget
(:mod:`rdepth.reproduce.plan`), trains with checkpoints spread over training,
runs ``analyze`` on the checkpoint series and ``sweep`` with the paper's tau
grid (:mod:`rdepth.reproduce.run`), judges each claim from the saved summaries
(:mod:`rdepth.reproduce.claims`) and writes ``claims.json`` and a claims table
on the report page (:mod:`rdepth.reproduce.report`).
"""
