"""rdepth and the tools people already use: Hugging Face export and import, retrofitting
recurrence into a plain model, and the ``lm-eval`` harness.

- :mod:`.export`: an rdepth run -> a folder that ``transformers`` loads with
  ``trust_remote_code=True`` (weights, config, tokenizer files, and modeling code
  generated from rdepth's own source by :mod:`.source`).
- :mod:`.hf_import`: a Hugging Face folder -> an rdepth run, where the architectures match.
- :mod:`.retrofit`: a plain rdepth model -> a recurrent one whose one loop is the original.
- :mod:`.lm_eval_model`: the ``rdepth`` model of EleutherAI's ``lm-eval`` harness.

``transformers`` and ``lm_eval`` are optional (the ``hf`` and ``lm-eval`` extras) and
imported only where used.
"""
