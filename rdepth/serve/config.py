"""Settings of ``rdepth serve`` (torch-free, so ``rdepth --help`` stays fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rdepth.config import MAX_LOOPS
from rdepth.errors import RdepthError
from rdepth.fields import check_fields, option
from rdepth.run.config import DEVICE_HELP, check_device_name, policy_options
from rdepth.threads import THREADS_HELP


@dataclass
class ServeConfig:
    """One ``rdepth serve``: a checkpoint behind the OpenAI-compatible API, through the engine."""

    checkpoint: str = option("", "checkpoint folder, or a run folder (its latest checkpoint)", required=True)
    name: str | None = option(None, "the model name clients pass as 'model'", default_text="the run folder's name")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", bounds="[1, 65535]")
    batch_size: int = option(16, "requests decoded together (the engine's slots)", bounds="[1, 4096]")
    loops: str | None = option(None, "a fixed budget: loop counts N or N,N,... per group",
                               default_text="the model's eval loop counts")
    exit: str | None = option(None, "per-token exits by this exit policy at --tau, in every group, instead of --loops",
                              default_text="none", metavar="POLICY")
    tau: float | None = option(None, "with --exit: the policy's threshold", default_text="the policy's own",
                               bounds="(0, inf)")
    k_max: tuple[int, ...] | None = option(None, "with --exit: loop-step cap N or N,N,... per group",
                                           default_text="twice the model's eval loops", bounds=f"[1, {MAX_LOOPS}]")
    exit_options: str | None = option(None, "with --exit: the policy's options as KEY=VALUE,...",
                                      default_text="the policy's own", metavar="KEY=VALUE,...")
    max_loops: int | None = option(None, "the most loop steps a request's own depth may ask for ('rdepth': "
                                   "loops or k_max) in every group: the engine's caps, at least the server's own "
                                   "budget or k-max", default_text="the server's own --loops or --k-max (its "
                                   "smallest group's)", bounds=f"[1, {MAX_LOOPS}]")
    allow_exits: str | None = option(None, "the exit rules a request may ask for by name ('rdepth': {\"exit\": "
                                     "RULE, \"tau\": X}), each with the threshold a request gets without one; "
                                     "'none' for none", default_text="the server's --exit rule, if any",
                                     metavar="RULE[:TAU],...")
    kv_layout: str = option("exact", "the engine's key/value layout: exact or shared", choices=("exact", "shared"))
    tick: str = option("eager", "the engine's tick: eager (what each row needs), token (eager, every loop to its exit "
                       "within the tick: rows stay in step; several groups under an exit rule), static or compiled "
                       "(every slot through one device function a tick, compiled; any looped groups: docs/engine.md), "
                       "graph or compiled-graph (that function replayed as a CUDA graph: a card only)",
                       choices=("eager", "token", "static", "compiled", "graph", "compiled-graph"))
    ahead: int = option(1, "with --tick static, compiled or a graph: ticks one call runs before the host reads the device (the "
                        "device enters each row's greedy token itself: while every request in a slot decodes greedily "
                        "and no rule keeps per-row memory; 4 is a good start)", bounds="[1, 64]")
    speculate: int | None = option(
        None, "loop speculation at low load (the eager tick): K drafts at --draft-loops loop steps per group, verified "
        "in one pass, for a request at the server's own depth while at most --speculate-at-most slots are in use "
        "(a greedy one's tokens are plain decoding's; a sampled one speculates only with --speculate-at-most at least "
        "--batch-size, by rejection sampling)", default_text="off", bounds="[1, 64]", metavar="K")
    draft_loops: str | None = option(None, "with --speculate: the drafts' loop steps D per group (N or N,N,...), below "
                                     "the server's budget", default_text="1", metavar="D")
    speculate_at_most: int = option(1, "with --speculate: the most slots in use at which a round runs",
                                    bounds="[1, 4096]")
    max_tokens: int = option(256, "the most new tokens a request may ask for", bounds="[1, 1000000]")
    context: int | None = option(None, "positions each slot holds (prompt and new tokens): the engine's capacity; "
                                 "below the block size for models with a long context (an Ouro's 65,536)",
                                 default_text="the model's block size", bounds="[1, 16777216]")
    max_n: int = option(16, "the most choices (n) a request may ask for per prompt", bounds="[1, 1024]")
    max_choices: int = option(64, "the most choices a request may ask for in all (its prompts x n)",
                              bounds="[1, 65536]")
    max_logprobs: int = option(20, "the most likely tokens a request may ask for per position ('logprobs', "
                               "'top_logprobs')", bounds="[0, 1000]")
    max_body_bytes: int = option(4 * 1024 * 1024, "the largest request body taken (413 above it, before it is "
                                 "parsed)", bounds="[1024, 1073741824]")
    seed: int = option(0, "seed of the initial loop-state noise (a choice of seed S draws StateNoise(seed, [S]))",
                       bounds=f"[0, {2**62})")
    device: str = option("auto", DEVICE_HELP)
    threads: int = option(0, THREADS_HELP + "; with --replicas, each replica's, and the CPUs Ray holds for it "
                          "(0: one)", bounds="[0, inf)")
    replicas: int | None = option(None, "serve N copies of the server under Ray Serve (docs/serve.md: scaling out), "
                                  "each a whole engine; Ray's proxy listens on --host and --port", bounds="[1, 1024]",
                                  default_text="one process, no Ray")
    ray_address: str | None = option(None, "with --replicas: the Ray cluster to join ('auto', or its HOST:PORT)",
                                     default_text="a Ray cluster of its own on this machine", metavar="ADDRESS")
    replica_gpus: float = option(0.0, "with --replicas: the GPUs Ray holds for each replica (1: a card each)",
                                 bounds="[0, 64]")

    def __post_init__(self) -> None:
        if self.k_max is not None:
            self.k_max = tuple(self.k_max)
        check_fields(self, "serve")
        if self.exit is None and (self.tau is not None or self.k_max is not None or self.exit_options is not None):
            raise RdepthError("serve: --tau, --k-max and --exit-options set the policy of --exit; give --exit too")
        if self.exit is not None and self.loops:
            raise RdepthError("serve: --exit replaces --loops; give one")
        if (self.draft_loops is not None or self.speculate_at_most != 1) and self.speculate is None:
            raise RdepthError("serve: --draft-loops and --speculate-at-most set --speculate's rounds; give --speculate "
                              "too")
        if self.speculate is not None and self.tick != "eager":
            raise RdepthError(f"serve: --speculate runs on the eager tick, not --tick {self.tick}")
        if self.ahead != 1 and self.tick in ("eager", "token"):
            raise RdepthError("serve: --ahead runs several ticks a call of the static or compiled tick; give --tick "
                              "static or compiled")
        check_device_name("serve", self.device)
        if self.replicas is None and (self.ray_address is not None or self.replica_gpus):
            raise RdepthError("serve: --ray-address and --replica-gpus place the replicas of --replicas; give "
                              "--replicas too")
        self.allowed_exits()  # its syntax, before anything loads (the names: when the server builds its rules)
        if self.max_n > self.max_choices:
            raise RdepthError(f"serve: --max-n {self.max_n} exceeds --max-choices {self.max_choices} (the choices "
                              "of a whole request); raise --max-choices too")

    def allowed_exits(self) -> list[tuple[str, float | None]]:
        """``--allow-exits`` as ``(rule, tau)`` pairs (tau None: the server's --tau for its own --exit rule, else
        none, and a request must give one); by default the server's own --exit rule, or none."""
        if self.allow_exits is None:
            return [(self.exit, None)] if self.exit else []
        if self.allow_exits.strip() == "none":
            return []
        allowed: list[tuple[str, float | None]] = []
        for item in self.allow_exits.split(","):
            name, sep, text = (part.strip() for part in item.partition(":"))
            tau = None
            if sep:
                try:
                    tau = float(text)
                except ValueError:
                    tau = math.nan
                if not (math.isfinite(tau) and tau > 0):
                    raise RdepthError(f"serve: --allow-exits wants RULE[:TAU],... with TAU a positive number, "
                                      f"got {item.strip()!r}")
            if not name or name == "none":
                raise RdepthError(f"serve: --allow-exits wants RULE[:TAU],... (or 'none' alone), got {item.strip()!r}")
            if name in (rule for rule, _ in allowed):
                raise RdepthError(f"serve: --allow-exits names {name} twice; name each rule once")
            if name == self.exit and tau is not None:
                raise RdepthError(f"serve: --allow-exits {item.strip()}: the server's own rule {name} runs at --tau; "
                                  f"name it without a threshold")
            allowed.append((name, tau))
        return allowed

    def policy_options(self) -> dict:
        """``--exit-options`` as a dict (the learned rule's gate is the run's), as ``rdepth generate`` reads it."""
        return policy_options("serve", self.exit, self.exit_options, self.checkpoint)
