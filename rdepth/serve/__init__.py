"""An OpenAI-compatible HTTP server on the continuous depth batching engine (``rdepth serve``)."""
