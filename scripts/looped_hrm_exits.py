"""Per-token exits on a tiny HRM-Text trained here: the figures of docs/ecosystem.md ("HRM-Text").

Trains transformers' HrmTextForCausalLM (64 wide, one layer per stack, H_cycles 2, L_cycles 4, tied head)
for 400 AdamW steps on the bytes of README.md, then compares per-token exits of the L loop (and of the H
loop) with the full budget on four 48-byte windows of the same text (rdepth.looped.exits.exit_quality).
Seed 0, one thread, a CPU; about a minute. ``--save FOLDER`` also writes the trained model with a byte tokenizer as
a Hugging Face folder, which rdepth analyze, sweep and generate read in place (docs/results/paper.md's HRM-Text
geometry).
"""

from __future__ import annotations

from pathlib import Path

import torch


def train(data: torch.Tensor, steps: int = 400):
    import transformers

    torch.manual_seed(0)
    config = transformers.HrmTextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, head_dim=16, H_cycles=2, L_cycles=4, L_bp_cycles=[4],
                                        prefix_lm=False, max_position_embeddings=128, embedding_scale=1.0,
                                        tie_word_embeddings=True)
    model = transformers.HrmTextForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        starts = torch.randint(0, len(data) - 65, (16,))
        batch = torch.stack([data[i:i + 64] for i in starts])
        loss = model(batch, labels=batch.clone(), use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    return model.eval()


def main() -> None:
    import argparse

    from rdepth.exits.registry import make_policy
    from rdepth.looped.exits import exit_quality
    from rdepth.looped.hrm_text import HrmTextAdapter
    from rdepth.looped.load import save_byte_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", metavar="FOLDER", help="also save the trained model and a byte tokenizer here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = torch.tensor(list((Path(__file__).resolve().parents[1] / "README.md").read_bytes()[:20000]))
    model = train(data)
    if args.save:
        model.save_pretrained(args.save)
        save_byte_tokenizer(args.save)
    adapter = HrmTextAdapter(model.double())
    windows = torch.stack([data[i:i + 48] for i in (100, len(data) // 4, len(data) // 2, 3 * len(data) // 4)])
    settings = [("step_norm_rel", 0.05, None), ("step_norm_rel", 0.1, None), ("cosine", 0.9, None),
                ("acceleration_rel", 0.05, None), ("step_norm_rel", 0.1, ("kl", 0.01))]
    for rule, tau, high in settings:
        high_policy = None if high is None else make_policy(high[0], tau=high[1], k_max=2, decode=adapter.readout)
        quality = exit_quality(adapter, windows, low=make_policy(rule, tau=tau, k_max=4), high=high_policy)
        print(rule, tau, high, {key: round(value, 4) for key, value in quality.items()})


if __name__ == "__main__":
    main()
