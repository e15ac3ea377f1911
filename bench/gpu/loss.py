"""Section ``loss``: the training loss head, the logits made whole against the fused head and
cross-entropy, forward + backward at the training shape."""

from __future__ import annotations

import time

from bench.gpu.common import ratio


def loss_section(args, device, deadline, context) -> dict:
    """The training loss's head: ``lm_loss(F.linear(h, W))`` (the logits made whole) against the fused
    head + cross-entropy (:func:`rdepth.model.fused_loss.linear_cross_entropy`: gradients made in the
    forward, chunk by chunk), and where the trainer compiles (CUDA, or ``--compile on``) the fused head with
    each chunk's arithmetic compiled (``fused_compiled``, its compilation in the warm-up rounds), forward +
    backward at the training shape (``--train-batch`` x block size rows, bf16 autocast on CUDA): ms and
    peak memory."""
    import torch
    import torch.nn.functional as F

    from bench.decode_speed import summary
    from rdepth.config import get_preset
    from rdepth.model.fused_loss import linear_cross_entropy
    from rdepth.model.recurrent import lm_loss

    config = get_preset(args.preset)
    rows, d, vocab = args.train_batch * config.block_size, config.d_model, config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(rows, d, generator=generator).to(device).requires_grad_()
    weight = (0.02 * torch.randn(vocab, d, generator=generator)).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    paths = {"unfused": lambda: lm_loss(F.linear(hidden, weight), targets),
             "fused": lambda: linear_cross_entropy(hidden, weight, targets)}
    if args.compile == "on" or (args.compile == "auto" and device.type == "cuda"):  # as the trainer compiles
        paths["fused_compiled"] = lambda: linear_cross_entropy(hidden, weight, targets, compiled=True)
    out = {"status": "ok", "rows": rows, "d_model": d, "vocab": vocab,
           "dtype": "bfloat16 autocast" if device.type == "cuda" else "float32"}
    for name, loss_of in paths.items():
        times = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        for round_number in range(args.warmup + args.repeats):
            if time.perf_counter() > deadline and times:
                break
            hidden.grad = weight.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            with autocast:
                loss = loss_of()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_number >= args.warmup:
                times.append(1000 * (time.perf_counter() - started))
        timing = summary(times)
        out[name] = {"ms": timing["ms_per_token"], "iqr": timing["iqr"], "rounds": timing["rounds"], "loss": float(loss)}
        if device.type == "cuda":
            out[name]["peak_mib_over_inputs"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    out["unfused_over_fused_ms"] = ratio(out["unfused"]["ms"], out["fused"]["ms"])
    if "fused_compiled" in out:
        out["unfused_over_fused_compiled_ms"] = ratio(out["unfused"]["ms"], out["fused_compiled"]["ms"])
    return out

