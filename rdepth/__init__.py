"""rdepth: recurrent-depth transformers.

Layout (dependencies point one way):
    config <- model <- (data, train, geometry, exits, surrogate) <- report <- cli
"""

__version__ = "0.1.0"
