"""The training loop: AdamW, warmup + cosine, clipping, accumulation, DDP, checkpoints.

Every random choice of a step (its batch, each group's loop count, the initial
loop states) is a function of ``(seed, step)`` alone, so resuming from a
checkpoint continues exactly, and every data-parallel rank draws the same loop
counts. On the CPU, N steps straight and N/2 + resume + N/2 give identical
losses and weights.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rdepth.config import ModelConfig
from rdepth.data.loader import BatchSampler
from rdepth.data.shards import TokenShards
from rdepth.errors import RdepthError
from rdepth.io import append_jsonl, environment_info, write_json
from rdepth.model import RecurrentLM, sample_loop_counts, step_generator
from rdepth.model.noise import StateNoise
from rdepth.run import checkpoint as ckpt
from rdepth.run.device import resolve_device
from rdepth.run.evaluate import evaluate
from rdepth.run.heldout import held_out_windows
from rdepth.train.config import TrainConfig
from rdepth.train.distributed import DistInfo, all_reduce_mean, init_distributed, shutdown_distributed

log = logging.getLogger(__name__)


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    min_lr = config.lr * config.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - min_lr)


def make_optimizer(model: RecurrentLM, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms); fused kernels on CUDA."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=device.type == "cuda"
    )


def data_model_config(model_config: ModelConfig, shards: TokenShards) -> ModelConfig:
    """The data decides the vocabulary: take its size and tokenizer spec."""
    manifest = shards.manifest
    changes = {"vocab_size": int(manifest["vocab_size"]), "tokenizer": str(manifest["tokenizer"])}
    if any(getattr(model_config, k) != v for k, v in changes.items()):
        log.info("vocabulary from the data: %s (%d tokens)", changes["tokenizer"], changes["vocab_size"])
    return model_config.replace(**changes)


def data_model_config_for(model_config: ModelConfig, data: str | Path) -> ModelConfig:
    """:func:`data_model_config` for the prepared folder ``data``."""
    return data_model_config(model_config, TokenShards.open(data))


def _config_mismatch(saved: ModelConfig, wanted: ModelConfig) -> list[str]:
    a, b = saved.to_dict(), wanted.to_dict()
    return [f"{k}={a[k]!r} (checkpoint) vs {b[k]!r}" for k in a if a[k] != b[k]]


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    final_val: dict | None
    tokens_per_second: float
    wall_seconds: float


class Trainer:
    def __init__(self, model_config: ModelConfig, config: TrainConfig, resume: bool = False):
        self.config = config
        self.device = resolve_device(config.device)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.dist: DistInfo = init_distributed(self.device.type)
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        per_step = config.grad_accum * self.dist.world_size
        if config.batch_size % per_step:
            raise RdepthError(
                f"batch_size {config.batch_size} is not divisible by grad_accum x world size = {per_step}"
            )
        self.shards = TokenShards.open(config.data)
        self.model_config = data_model_config(model_config, self.shards)
        self.run_dir = Path(config.out)
        self.start_step = 0
        self.tokens_seen = 0
        torch.manual_seed(config.seed)  # the initial weights depend on the seed alone
        self.model = RecurrentLM(self.model_config)
        self.optimizer = make_optimizer(self.model, config, self.device)
        self._setup_run_dir(resume)
        self.model.to(self.device)
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        # Data with loss masks (a task's answers) trains and validates on the masked targets only.
        self.sampler = BatchSampler(self.shards.train, config.batch_size, self.model_config.block_size, config.seed,
                                    mask=self.shards.loss_mask("train"))
        val_len = min(self.model_config.block_size, len(self.shards.val) - 1)
        val_count = config.eval_batches * config.eval_batch_size
        self.val_windows = held_out_windows(self.shards.val, val_len, val_count)
        val_mask = self.shards.loss_mask("val")
        self.val_masks = None if val_mask is None else held_out_windows(val_mask, val_len, val_count).bool()
        self.ddp = None
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=ids)
        if config.compile:
            for layer in self.model.layers:  # per block: loop counts vary, shapes do not
                layer.compile()

    # ---------------------------------------------------------------- set-up
    def _setup_run_dir(self, resume: bool) -> None:
        existing = ckpt.list_checkpoints(self.run_dir)
        if resume:
            if not existing:
                raise RdepthError(f"--resume: no checkpoint in {self.run_dir}")
            checkpoint = ckpt.resolve_checkpoint(self.run_dir)
            saved = ckpt.load_model_config(checkpoint)
            mismatch = _config_mismatch(saved, self.model_config)
            if mismatch:
                raise RdepthError(f"model config does not match checkpoint {checkpoint}: {'; '.join(mismatch[:4])}")
            ckpt.load_weights(checkpoint, self.model)
            trainer_state, state = ckpt.load_trainer_state(checkpoint)
            try:
                self.optimizer.load_state_dict(trainer_state["optimizer"])
            except (KeyError, ValueError) as exc:
                raise RdepthError(f"optimizer state in {checkpoint} does not match the model ({exc})") from None
            self.start_step = int(state["step"])
            self.tokens_seen = int(state.get("tokens_seen", 0))
            log.info("resuming from %s at step %d", checkpoint, self.start_step)
            if self.start_step >= self.config.end_step:
                raise RdepthError(
                    f"checkpoint is at step {self.start_step}; nothing to do up to step {self.config.end_step}"
                )
        elif existing:
            raise RdepthError(
                f"{self.run_dir} already holds checkpoints; pass --resume or choose another --out"
            )
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_run_config(self.run_dir, self.model_config, self.config.to_dict())
            write_json(self.run_dir / "environment.json", {**environment_info(), "seed": self.config.seed,
                                                            "world_size": self.dist.world_size})
            tokenizer_dir = self.run_dir / "tokenizer"
            if not tokenizer_dir.exists():
                self.shards.tokenizer.save(tokenizer_dir)

    # ------------------------------------------------------------------ step
    def _micro_batches(self, step: int):
        """This rank's micro-batches of the global batch at ``step``:
        (x, y, loop counts, initial-state noise). The noise of a row is keyed by its
        place in the global batch of ``step``, so ranks draw only their own rows and
        together reproduce the single-process run."""
        config, dist = self.config, self.dist
        x_all, y_all = self.sampler.batch(step)
        micro = config.batch_size // config.grad_accum
        per_rank = micro // dist.world_size
        for index in range(config.grad_accum):
            lo = index * micro + dist.rank * per_rank
            counts = sample_loop_counts(self.model_config, step_generator(config.seed, step, 1 + index))
            noise = StateNoise.consecutive(config.seed, step * config.batch_size + lo, per_rank)
            yield (
                x_all[lo : lo + per_rank].to(self.device),
                y_all[lo : lo + per_rank].to(self.device),
                counts,
                noise,
            )

    def train_step(self, step: int) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """One optimizer step; returns the mean loss (a device tensor, no host sync)."""
        config = self.config
        model = self.ddp or self.model
        model.train()
        lr = lr_at(step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        used_counts = []
        batches = list(self._micro_batches(step))
        for index, (x, y, counts, noise) in enumerate(batches):
            last = index == len(batches) - 1
            sync = self.ddp.no_sync() if (self.ddp is not None and not last) else _null()
            with sync, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_dtype is not None):
                out = model(x, y, counts, generator=noise)
                loss = out.loss / config.grad_accum
            loss.backward()
            total += loss.detach()
            used_counts.append(counts)
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, used_counts

    # ------------------------------------------------------------------- run
    def run(self) -> TrainResult:
        config = self.config
        tokens_per_step = config.batch_size * self.model_config.block_size
        metrics_path = self.run_dir / "metrics.jsonl"
        final_val = None
        train_seconds = 0.0
        started = time.perf_counter()
        steps = range(self.start_step, config.end_step)
        bar = tqdm(steps, desc="train", disable=not self.dist.is_main, dynamic_ncols=True,
                   initial=self.start_step, total=config.end_step)
        window_start, window_tokens = time.perf_counter(), 0
        for step in bar:
            loss, counts = self.train_step(step)
            self.tokens_seen += tokens_per_step
            window_tokens += tokens_per_step
            done = step + 1
            if done % config.log_every == 0 or done == config.end_step:
                loss_value = all_reduce_mean(loss, self.dist).item()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - window_start
                train_seconds += elapsed
                rate = window_tokens / max(elapsed, 1e-9)
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{rate:,.0f}")
                if self.dist.is_main:
                    append_jsonl(metrics_path, {
                        "step": done, "loss": loss_value, "lr": lr_at(step, config),
                        "tokens": self.tokens_seen, "tokens_per_s": rate, "loop_counts": counts,
                    })
                window_start, window_tokens = time.perf_counter(), 0
            if done % config.eval_every == 0 or done == config.end_step:
                final_val = self._validate(done)
            if done % config.checkpoint_every == 0 or done == config.end_step:
                self._checkpoint(done, final_val)
            window_start = time.perf_counter() if window_tokens == 0 else window_start
        bar.close()
        wall = time.perf_counter() - started
        trained = (config.end_step - self.start_step) * tokens_per_step
        result = TrainResult(self.run_dir, config.end_step, final_val, trained / max(train_seconds, 1e-9), wall)
        if self.dist.is_main:
            baseline = self.shards.manifest.get("unigram_baseline", {})
            write_json(self.run_dir / "summary.json", {
                "step": result.step, "final_val": final_val, "tokens_per_second": result.tokens_per_second,
                "wall_seconds": wall, "unigram_baseline": baseline,
                "parameters": self.model.num_parameters(), "device": str(self.device),
            })
        shutdown_distributed()
        return result

    def _validate(self, done: int) -> dict | None:
        if not self.dist.is_main:
            return None
        result = evaluate(
            self.model, self.val_windows, batch_size=self.config.eval_batch_size, device=self.device,
            seed=self.config.seed, autocast_dtype=self.autocast_dtype, masks=self.val_masks,
        )
        log.info("step %d: val ce %.4f ppl %.2f (loops %s)", done, result["ce"], result["ppl"], result["loop_counts"])
        append_jsonl(self.run_dir / "metrics.jsonl", {"step": done, "val_ce": result["ce"], "val_ppl": result["ppl"],
                                                      "val_loop_counts": result["loop_counts"]})
        return result

    def _checkpoint(self, done: int, val: dict | None) -> None:
        if not self.dist.is_main:
            return
        trainer_state = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
        state = {"tokens_seen": self.tokens_seen, "data": {"seed": self.config.seed, "next_step": done},
                 "scheduler": {"kind": "warmup_cosine", "step": done, "lr": lr_at(done - 1, self.config)},
                 "val": val}
        path = ckpt.save_checkpoint(self.run_dir, done, self.model, self.model_config, trainer_state, state)
        log.debug("checkpoint %s", path)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def train(model_config: ModelConfig, config: TrainConfig, resume: bool = False) -> TrainResult:
    return Trainer(model_config, config, resume).run()
