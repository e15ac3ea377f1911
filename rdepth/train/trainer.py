"""The training loop: AdamW, warmup + cosine, clipping, accumulation, DDP or FSDP, validation, checkpoints.

Every random choice of a step (its batch, each group's loop count, the initial
loop states) is a function of ``(seed, step)`` alone, so resuming from a
checkpoint continues exactly, and every data-parallel rank draws the same loop
counts. On the CPU, N steps straight and N/2 + resume + N/2 give identical
losses and weights.

Beside the loop, in modules of their own: the step machinery the trainer holds and the run's set-up
(``step``: :class:`~rdepth.train.step.TrainStep`, also usable alone, and ``start_run``), the optimizer and
its schedule (``optim``), what a resume must share with its run (``resume``), the run folder's checks and
files (``rundir``), the memory check (``memory``), the time limit's schedule fits (``timefit``), sharding and its
checkpoints (``fsdp``, ``dcp``) and the process group (``distributed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rdepth.config import ModelConfig
from rdepth.data.loader import BatchSampler
from rdepth.data.shards import TokenShards
from rdepth.errors import RdepthError
from rdepth.io import append_jsonl, exclusive, write_json
from rdepth.run import checkpoint as ckpt
from rdepth.run.evaluate import evaluate
from rdepth.run.heldout import held_out_problem_windows, held_out_windows
from rdepth.train.config import TrainConfig
from rdepth.train.distributed import all_reduce_mean, shutdown_distributed
from rdepth.train.memory import check_fits
from rdepth.train.optim import check_optimizer_state, lr_at
from rdepth.train.resume import check_resume_config, check_same_data, config_mismatch, data_model_config, data_record
from rdepth.train.rundir import check_run_folder, write_run_files
from rdepth.train.step import TrainStep, start_run
from rdepth.train.timefit import ScheduleTimer, fitted_max_steps, refit

log = logging.getLogger(__name__)



@dataclass
class TrainResult:
    run_dir: Path
    step: int
    final_val: dict | None
    tokens_per_second: float
    wall_seconds: float


class Trainer:
    """One training run in ``config.out``: the step machinery (:attr:`stepper`, a
    :class:`~rdepth.train.step.TrainStep`) on the run's data, with its folder, validation, checkpoints and
    resume. The main rank holds the folder's write lock from here until :meth:`run` returns (or this
    constructor fails): a second trainer on the same folder stops at once with a one-line error."""

    def __init__(self, model_config: ModelConfig, config: TrainConfig, resume: bool = False,
                 preset: str | None = None):
        self.requested_config = config  # config.json keeps the settings asked for
        self.preset = preset
        self.start_step = 0
        self.tokens_seen = 0
        self.resumed_from: Path | None = None  # never rotated away during this run
        self.resumes: list[dict] = []
        self.schedule_fits: list[dict] = []  # the time limit's changes to the schedule (_fit_schedule)
        self._lock = contextlib.ExitStack()
        # before the lock and the data: the device, float8, threads, the process group, the batch split
        self.device, self.dist = start_run(config, distributed=True)
        self.run_dir = Path(config.out)
        if self.dist.is_main:
            self._lock.enter_context(exclusive(self.run_dir, "train"))
        try:
            self._build(model_config, resume)
        except BaseException:
            self._lock.close()
            raise

    @property
    def config(self) -> TrainConfig:
        """The settings in force, the step's own: a time limit or a resume may end the schedule sooner
        (:meth:`_fit_schedule`, :meth:`_resume`), and the step's learning rate follows."""
        return self.stepper.config

    @config.setter
    def config(self, config: TrainConfig) -> None:
        self.stepper.config = config

    def _build(self, model_config: ModelConfig, resume: bool) -> None:
        config = self.requested_config
        # Hashes and id range once per run: corrupt shards never train silently.
        self.shards = TokenShards.open(config.data, verify=True)
        self.shards.check_token_ids()
        self.shards.verify_tokenizer()
        self.model_config = data_model_config(model_config, self.shards)
        micro_rows = config.batch_size // (config.grad_accum * self.dist.world_size)
        check_fits(self.model_config, micro_rows, self.device, "a training micro-step")
        check_fits(self.model_config, config.eval_batch_size, self.device, "a validation batch")
        self.stepper = TrainStep(self.model_config, config, self.device, self.dist)  # the model, seeded
        self._setup_run_dir(resume)
        self.stepper.place_model(self.resumed_from)
        # Data with loss masks (a task's answers) trains and validates on the masked targets only.
        # Task data (a problem index) also starts every window at a problem, with an optional curriculum.
        starts, levels = self.shards.problem_index("train") or (None, None)
        self.stepper.sampler = BatchSampler(self.shards.train, config.batch_size, self.model_config.block_size, config.seed,
                                    mask=self.shards.loss_mask("train"), starts=starts, levels=levels,
                                    curriculum_steps=config.curriculum_steps)
        val_len = min(self.model_config.block_size, len(self.shards.val) - 1)
        val_count = config.eval_batches * config.eval_batch_size
        val_index = self.shards.problem_index("val")
        if val_index is None:
            self.val_windows = held_out_windows(self.shards.val, val_len, val_count)
        else:
            self.val_windows = held_out_problem_windows(self.shards.val, val_index[0], val_len, val_count)
        val_mask = self.shards.loss_mask("val")
        if val_mask is None:
            self.val_masks = None
        elif val_index is None:
            self.val_masks = held_out_windows(val_mask, val_len, val_count).bool()
        else:
            self.val_masks = held_out_problem_windows(val_mask, val_index[0], val_len, val_count).bool()
        if self.dist.enabled and not self.stepper.fsdp:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.stepper.ddp = DistributedDataParallel(self.stepper.model, device_ids=ids)
        self.stepper.compile_layers()
        self._write_run_files()

    # ---------------------------------------------------------------- set-up
    def _data_record(self) -> dict:
        return data_record(self.shards, self.model_config)

    def _setup_run_dir(self, resume: bool) -> None:
        saved_run = check_run_folder(self.run_dir, resume, self.dist.is_main)
        if resume:
            self._resume(saved_run)
        elif self.config.init_from:
            self._init_from(self.config.init_from)
        self._saved_run = saved_run

    def _write_run_files(self) -> None:
        """config.json, environment.json and the tokenizer (:func:`write_run_files`), on the main rank."""
        if not self.dist.is_main:
            return
        saved_run = self._saved_run
        extra = {"data": self._data_record()}
        if self.preset is not None or "preset" in saved_run:
            extra["preset"] = saved_run.get("preset", self.preset)
        if self.resumes:
            extra["resumes"] = self.resumes
        write_run_files(self.run_dir, self.model_config, self.requested_config.to_dict(), extra,
                        {"seed": self.config.seed, "world_size": self.dist.world_size}, self.shards.tokenizer,
                        self.start_step)

    def _init_from(self, source: str) -> None:
        """A new run (step 0, fresh optimizer) from another run's weights, e.g. ``rdepth retrofit``'s."""
        from rdepth.data.tokenizers import tokenizer_fingerprint
        from rdepth.run.heldout import run_tokenizer

        checkpoint = ckpt.resolve_checkpoint(source)
        saved = ckpt.load_model_config(checkpoint)
        if (saved.tokenizer, saved.vocab_size) != (self.model_config.tokenizer, self.model_config.vocab_size) or \
                tokenizer_fingerprint(run_tokenizer(checkpoint)) != self.shards.tokenizer_fingerprint:
            raise RdepthError(f"--init-from {source}: its tokenizer ({saved.tokenizer!r}, {saved.vocab_size} tokens) "
                              f"is not the one the data in {self.config.data} was prepared with")
        ckpt.load_weights(checkpoint, self.stepper.model)
        log.info("starting from the weights of %s", checkpoint)

    def _resume(self, saved_run: dict) -> None:
        checkpoint = ckpt.resolve_checkpoint(self.run_dir)
        saved = ckpt.load_model_config(checkpoint)
        mismatch = config_mismatch(saved, self.model_config)
        if mismatch:
            raise RdepthError(f"model config does not match checkpoint {checkpoint}: {'; '.join(mismatch[:4])}")
        if self.stepper.fsdp:  # the weights and optimizer state load once sharded (place_model)
            from rdepth.train.dcp import read_state

            trainer_state, state = None, read_state(checkpoint)
        else:
            trainer_state, state = ckpt.load_trainer_state(checkpoint)
        step = int(state["step"])
        saved_train = state.get("train_config") or saved_run.get("train")
        if saved_train is not None and self.config.time_limit is not None and state.get("schedule_fits"):
            # The run's time limit ended its schedule sooner: go on with that schedule.
            fitted = TrainConfig.from_dict(saved_train)
            self.config = dataclasses.replace(
                self.config, max_steps=fitted.max_steps, eval_every=fitted.eval_every,
                checkpoint_every=fitted.checkpoint_every, milestone_every=fitted.milestone_every)
            self.schedule_fits = list(state["schedule_fits"])
        if saved_train is not None:
            self.resumes = list(saved_run.get("resumes", [])) if isinstance(saved_run.get("resumes"), list) else []
            changed = check_resume_config(TrainConfig.from_dict(saved_train), self.config, step)
            if changed:
                self.resumes.append({"step": step, "changed": changed})
        else:
            log.warning("%s records no training config: resuming with the flags given", self.run_dir)
        check_same_data(saved_run.get("data"), self._data_record(), self.run_dir, self.config.data)
        if trainer_state is not None:
            ckpt.load_weights(checkpoint, self.stepper.model)
            try:
                self.stepper.optimizer.load_state_dict(trainer_state["optimizer"])
                check_optimizer_state(self.stepper.optimizer)
            except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
                raise RdepthError(f"optimizer state in {checkpoint} does not match the model ({exc})") from None
        self.start_step = step
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.resumed_from = checkpoint
        log.info("resuming from %s at step %d", checkpoint, self.start_step)
        if self.start_step >= self.config.end_step:
            raise RdepthError(
                f"checkpoint is at step {self.start_step}; nothing to do up to step {self.config.end_step}"
            )

    # ------------------------------------------------------------------- run
    def check_finite(self, done: int) -> None:
        """Stop (one-line error, no checkpoint written) if any step so far had a non-finite
        loss or gradient norm; the last checkpoint saved is the last finite one."""
        if bool(self.stepper.nonfinite):
            finite = ckpt.list_checkpoints(self.run_dir)
            kept = f"the last finite checkpoint is {finite[-1]}" if finite else "no checkpoint was written"
            raise RdepthError(
                f"training diverged by step {done}: the loss or gradient norm is not finite; {kept}. "
                "Lower --lr (or raise --warmup-steps) and start again"
            )

    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            self._lock.close()

    def _run(self) -> TrainResult:
        tokens_per_step = self.config.batch_size * self.model_config.block_size
        metrics_path = self.run_dir / "metrics.jsonl"
        final_val = None
        train_seconds = 0.0
        started = time.perf_counter()
        self._fit = ScheduleTimer(self.config, self.start_step, started)
        bar = tqdm(desc="train", disable=not self.dist.is_main, dynamic_ncols=True,
                   initial=self.start_step, total=self.config.end_step)
        window_start, window_tokens = time.perf_counter(), 0
        try:
            step = self.start_step
            while step < self.config.end_step:
                config = self.config  # a time limit may end the schedule sooner (_fit_schedule)
                loss, counts = self.stepper.train_step(step)
                self.tokens_seen += tokens_per_step
                window_tokens += tokens_per_step
                done = step + 1
                if done % config.log_every == 0 or done == config.end_step:
                    self.check_finite(done)
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
                            "grad_norm": float(self.stepper.last_grad_norm),
                            "tokens": self.tokens_seen, "tokens_per_s": rate, "loop_counts": counts,
                            **self._difficulty(step),
                        })
                    window_start, window_tokens = time.perf_counter(), 0
                if done % config.eval_every == 0 or done == config.end_step:
                    self.check_finite(done)
                    final_val = self._validate(done)
                if done % config.checkpoint_every == 0 or done == config.end_step:
                    self.check_finite(done)
                    self._checkpoint(done, final_val)
                if done == self._fit.mark_at:
                    self._fit.mark_step, self._fit.mark_time = done, self._synchronized_now()
                elif done in self._fit.fit_at and done < config.end_step:
                    self._fit_schedule(done, bar)
                window_start = time.perf_counter() if window_tokens == 0 else window_start
                bar.update(1)
                step = done
        finally:  # on an error too: the message then starts on a line of its own
            bar.close()
        wall = time.perf_counter() - started
        config = self.config
        trained = (config.end_step - self.start_step) * tokens_per_step
        result = TrainResult(self.run_dir, config.end_step, final_val, trained / max(train_seconds, 1e-9), wall)
        if self.dist.is_main:
            baseline = self.shards.manifest.get("unigram_baseline", {})
            write_json(self.run_dir / "summary.json", {
                "step": result.step, "max_steps": config.max_steps, "final_val": final_val,
                "tokens_per_second": result.tokens_per_second, "tokens": self.tokens_seen,
                "wall_seconds": wall, "unigram_baseline": baseline,
                "parameters": self.stepper.model.num_parameters(), "device": str(self.device),
                **({"schedule_fits": self.schedule_fits} if self.schedule_fits else {}),
            })
        shutdown_distributed()
        return result

    def _difficulty(self, step: int) -> dict:
        """The curriculum's highest difficulty at ``step`` for the metrics line (task data with levels)."""
        sampler = self.stepper.sampler
        return {} if sampler.levels is None else {"max_difficulty": sampler.level(step)}

    def _synchronized_now(self) -> float:
        """The clock once the device has finished the work queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _fit_schedule(self, done: int, bar) -> None:
        """At a fit point of a run with a time limit: time the steps since the last mark and end
        the schedule sooner if the rest would overrun (:mod:`rdepth.train.timefit`). Every rank
        applies the mean of the ranks' answers, so all keep one schedule."""
        now = self._synchronized_now()
        fit = self._fit
        step_seconds = (now - fit.mark_time) / max(1, done - fit.mark_step)
        wanted = fitted_max_steps(done, now - fit.started, step_seconds, self.config.time_limit,
                                  self.config.max_steps)
        if self.dist.enabled:
            wanted = int(all_reduce_mean(torch.tensor(float(wanted), device=self.device), self.dist).item())
        fit.mark_step, fit.mark_time = done, now
        if wanted >= self.config.max_steps:
            return
        first = not self.schedule_fits and done < self.config.checkpoint_every
        old = self.config
        self.config = refit(old, wanted, scale_cadences=first)
        record = {"step": done, "max_steps": [old.max_steps, wanted], "step_seconds": step_seconds,
                  "elapsed": now - fit.started, "time_limit": old.time_limit}
        if first:
            record["checkpoint_every"] = [old.checkpoint_every, self.config.checkpoint_every]
        self.schedule_fits.append(record)
        bar.total = self.config.end_step
        bar.refresh()
        log.info("time limit %.0f s: %.3f s per step at step %d, so the schedule ends at step %d, not %d",
                 old.time_limit, step_seconds, done, wanted, old.max_steps)
        if self.dist.is_main:
            append_jsonl(self.run_dir / "metrics.jsonl", {"step": done, "schedule_fit": record})

    def _validate(self, done: int) -> dict | None:
        if not self.dist.is_main and not self.stepper.fsdp:  # a sharded model evaluates on every rank together
            return None
        result = evaluate(
            self.stepper.model, self.val_windows, batch_size=self.config.eval_batch_size, device=self.device,
            seed=self.config.seed, autocast_dtype=self.stepper.autocast_dtype, masks=self.val_masks,
        )
        if not self.dist.is_main:
            return None
        log.info("step %d: val ce %.4f ppl %.2f (loops %s)", done, result["ce"], result["ppl"], result["loop_counts"])
        append_jsonl(self.run_dir / "metrics.jsonl", {"step": done, "val_ce": result["ce"], "val_ppl": result["ppl"],
                                                      "val_loop_counts": result["loop_counts"]})
        return result

    def _checkpoint(self, done: int, val: dict | None) -> None:
        model, optimizer = self.stepper.model, self.stepper.optimizer
        if not self.dist.is_main and not self.stepper.fsdp:  # every rank writes its shards of a sharded model
            return
        config = self.config
        milestone = done % config.milestone_interval == 0 or done == config.max_steps
        state = {"tokens_seen": self.tokens_seen, "data": {"seed": config.seed, "next_step": done},
                 "train_config": config.to_dict(),
                 "scheduler": {"kind": "warmup_cosine", "step": done, "lr": lr_at(done - 1, config)},
                 "val": val, "milestone": milestone,
                 **({"schedule_fits": self.schedule_fits} if self.schedule_fits else {})}
        if self.stepper.fsdp:
            from rdepth.train import dcp

            path = dcp.save(self.run_dir, done, model, optimizer, self.model_config,
                            {**state, "world_size": self.dist.world_size}, self.dist.is_main)
            if path is None:
                return
        else:
            trainer_state = {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
            path = ckpt.save_checkpoint(self.run_dir, done, model, self.model_config, trainer_state, state)
        log.debug("checkpoint %s", path)
        protect = (path,) if self.resumed_from is None else (path, self.resumed_from)
        removed = ckpt.rotate_checkpoints(self.run_dir, config.keep_last, config.milestone_interval, protect)
        if removed:
            log.info("--keep-last %d: removed %s", config.keep_last, ", ".join(removed))


def train(model_config: ModelConfig, config: TrainConfig, resume: bool = False,
          preset: str | None = None) -> TrainResult:
    return Trainer(model_config, config, resume, preset).run()


