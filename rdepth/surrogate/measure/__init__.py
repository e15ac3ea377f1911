"""What is measured of a teacher and its surrogates: layer similarity (``similarity``), fidelity beside the
same-budget baselines (``fidelity``), downstream retention (``retention``), depth dynamics (``dynamics``),
the Raptor paper's class basins and self-correction (``basins``), and loop geometry (``geometry``)."""
