"""Issue 12's GPU targets, measured side by side on one card in one run (about 5 minutes on an H100).

    python3 -m bench.gpu_suite --out gpu_out --revision <git hash>     # the GPU session's one command
    python3 -m bench.gpu_suite --smoke --out /tmp/gpu_smoke            # CPU-sized, every section in seconds

Run from the repository root: no install of rdepth is needed (``python3 bench/gpu_suite.py`` runs the
same). Random weights (speed needs no trained ones; ``--checkpoint RUN`` puts a trained run's weights
under the decode sections), random token ids.
Sections, in order, each timed after warm-up, synchronised, repeated, kept as median and IQR:

  ceiling  a large bf16 matrix product and a device-to-device copy (CUDA only): the card's real peaks
  train    the trainer's own ``TrainStep.train_step`` (bf16 autocast and per-layer compile on CUDA, AdamW,
           clipping, truncated backprop) on the ``paper`` preset with the loop counts drawn as in
           training, then on a plain GPT of the same width and the mean unrolled depth: tokens/s,
           model FLOPs (:func:`train_flops_per_row`), MFU, per-layer-application throughput ratio
  decode   batch 1 at the full budget: the decoder eager, as CUDA graphs, and with Inductor-compiled pieces captured as CUDA graphs (``Compiled``; eager on
           a CPU); the plain 12-layer model on the same three static paths (ms/token)
  exits    batch 1: the per-step cost of an exit check (a rule that never fires against the fixed
           budget; without and with the per-chunk host check), on eager and on Inductor-compiled
           pieces (each against its own loop step), and a rule calibrated to about half the steps
           against the full budget and a fixed budget of the same mean steps
  batched  batch 8, 32, 128 (as time allows): tokens/s with exits, at the full budget and at a fixed
           budget of the same mean steps, with the greedy-token agreement against the full budget
  spread   batch 32, 128: exits drawn from a trained model's recorded exit histogram (predicated,
           batch quantiles) against the full budget and fixed budgets of the same mean
  loss     the training loss head, logits made whole against the fused head + cross-entropy
  fp8      (only when named: --sections fp8) the trainer's step with TrainConfig.fp8 (torchao float8
           matmuls in the layers and adapters) against bf16, from one seed on the same tokens
           (--fp8-data, a prepared folder, else random ids): both loss curves, the gap per step,
           tokens/s and MFU against the bf16 peak

One module per section (``bench/gpu/<section>.py``, each ``<section>_section(args, device, deadline,
context)``), the steps the decode sections share in ``decoding.py``, the budget, statistics and
environment in ``common.py``, the targets and the markdown page in ``report.py``, the flags and the
loop over sections in ``suite.py``.

Every section has a share of ``--budget-s``; it shortens its repeats or skips its later settings when
its time runs out, and says so. A section that fails records its error and the rest go on.
``OUT/gpu_suite.json`` (device, versions, revision, every number, each target met or missed and by
how much) and ``OUT/gpu_suite.md`` (the targets table) are rewritten after every section; the
table is printed at the end.

Training data: the ``paper`` preset's GPT-2 vocabulary needs tokenizer files that an offline GPU
machine does not hold, and the vocabulary size is part of what is timed (the head is ~8% of the
FLOPs). So the trainer's step runs on random token ids of the preset's vocabulary through the
trainer's own ``BatchSampler``; the trainer is built without a data folder
(``TrainStep.on_tokens``, :func:`bench.gpu.train.bench_trainer`), and only ``train_step`` is driven: the step
users run.
"""

