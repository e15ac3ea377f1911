"""``rdepth generate``: sample text from a checkpoint with a KV cache."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build, overrides
from rdepth.errors import RdepthError


def register(subparsers) -> None:
    from rdepth.run.config import GenerateConfig

    parser = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate text with a key/value cache (exact under recurrence); loop counts per group selectable. "
        "--checkpoint may instead name a Hugging Face folder of a looped model transformers ships (model_type "
        "hrm_text, inkling2_loop_text), decoded in place at its own budget, --loops (its loops in order: H,L or "
        "passes) or, for HRM-Text, --exit RULE in every loop the rule can read.",
    )
    add_dataclass_flags(parser, GenerateConfig, title="generation")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.run.config import GenerateConfig
    from rdepth.run.generate_text import generate_text

    config = build(GenerateConfig, {}, args)
    if looped_folder(config.checkpoint):  # a looped transformers model's folder, driven in place
        return _looped(config, overrides(args, GenerateConfig, check=False))
    check_ignored_flags(overrides(args, GenerateConfig, check=False))

    def profile_controllers(model):
        from rdepth.exitrun.profile import load_profile, profile_controller_factory

        profile = load_profile(config.exit_profile, model.n_groups, config.checkpoint, config.force_profile)
        return profile_controller_factory(profile, lambda: model.readout)

    controllers = None
    if config.exit_profile is not None:
        controllers = profile_controllers
    elif config.exit is not None:
        controllers = policy_controllers(config)
    if config.prompts_file is not None:
        return _many(config, controllers)
    for text in generate_text(config, controllers):
        print(text)
        print("---")
    return 0


def looped_folder(path: str) -> bool:
    from rdepth.looped.load import looped_source

    return looped_source([path], "generate")


def _looped(config, given: dict) -> int:
    """``--checkpoint`` a Hugging Face folder of HRM-Text or Inkling-2: its texts (rdepth.looped.generate), and
    with --exit the steps the rule ran."""
    from rdepth.looped.generate import generate_folder

    made = generate_folder(config, given)
    for text in made.texts:
        print(text)
        print("---")
    if made.steps is not None:
        steps = made.steps
        print(f"--exit {config.exit}: mean L steps per L loop {steps['mean_low_steps']:.2f} of {steps['full_low_steps']}, "
              f"mean H steps {steps['mean_high_steps']:.2f} of {steps['full_high_steps']} ({steps['positions']} "
              "positions, the prompt's included)")
    return 0


def check_ignored_flags(given: dict) -> None:
    """Flags that would be ignored: ``--batch-size`` sizes the engine (``--prompts-file`` only), and
    ``--prompts-file`` replaces ``--prompt``. Judged on what was typed, since both have defaults."""
    if "batch_size" in given and given.get("prompts_file") is None:
        raise RdepthError("generate: --batch-size is the engine's (with --prompts-file); one --prompt decodes "
                          "its --samples together")
    if "prompt" in given and given.get("prompts_file") is not None:
        raise RdepthError("generate: give --prompt or --prompts-file, not both")


def _many(config, controllers) -> int:
    """Every prompt of the file through the engine: each continuation, then a line with its loop steps,
    written (and flushed) as soon as it and every one before it are done, so that an interrupted run keeps
    what finished; exit 1 when a request failed (its error printed; the others stand)."""
    import sys

    from tqdm import tqdm

    from rdepth.run.generate_many import generate_many

    failed = 0

    def write(item) -> None:
        nonlocal failed
        steps = ", ".join(f"{s:.2f}" for s in item.mean_steps)
        tqdm.write(f"{item.text}\n--- prompt {item.index + 1}, sample {item.sample + 1}: {len(item.tokens)} tokens, "
                   f"mean loop steps per group [{steps}], {item.finish_reason}")  # (clears the bar, then redraws it)
        sys.stdout.flush()
        if item.error:
            failed += 1
            tqdm.write(f"error: prompt {item.index + 1}: {item.error}", file=sys.stderr)

    generate_many(config, controllers, on_result=write)
    return 1 if failed else 0


def policy_controllers(config):
    """``model -> factory of loop controllers`` for ``--exit POLICY --tau X [--k-max N]``: the policy in
    every group, decoded rules reading the model's head. A bad name, tau or k_max fails here, before
    the checkpoint is loaded."""
    from rdepth.exitrun.gate_file import check_gate_option
    from rdepth.exits.config import resolve_k_max
    from rdepth.exits.controller import controller_factory

    options = config.policy_options()  # a bad option fails in the next line, before the checkpoint is loaded
    check_gate_option(config.exit, options, config.checkpoint)  # a gate named for another model
    controller_factory(config.exit, config.tau, config.k_max or (1,), options=options)

    def controllers(model):
        k_max = resolve_k_max("generate", config.k_max, model.n_groups, model.config.default_eval_loops)
        return controller_factory(config.exit, config.tau, k_max, lambda: model.readout, options)

    return controllers
