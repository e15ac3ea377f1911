"""The report pages of ``rdepth surrogate`` (``text``, ``vision``) and their figures (``plots``), drawn
from saved numbers only."""
