"""Task data on disk: token shards like any prepared corpus, plus answer masks and held-out sets.

``prepare_task_data(TaskDataConfig(...))`` writes, atomically (through
:class:`rdepth.data.shards.ShardWriter`)::

    manifest.json            the shard manifest (tokenizer "task:NAME", vocab_size, dtype, splits,
                             unigram_baseline, ...) plus "task": names, parameters, difficulty
                             ranges, held-out difficulties, seeds, and "masks"
    train.bin, val.bin       uint16 token ids, each problem followed by <eot> (as documents)
    train_mask.bin, val_mask.bin
                             uint8, one byte per token of the shard: 1 at answer tokens
    train_problems.npy, val_problems.npy
                             int64 [P, 2]: each problem's start offset in the shard and its
                             difficulty (training windows start at problems; the curriculum)
    heldout_d{D}.npz         per held-out difficulty D: ``tokens`` int64 [W, block_size + 1] of whole
                             problems padded with <eot>, ``answer_mask`` bool and ``problem_ids`` int64
                             (-1 off answers) of the same shape, ``difficulty``
    tokenizer_meta.json      the task vocabulary (rdepth.data.task_vocab)

Held-out windows hold ``block_size + 1`` tokens so that ``x = tokens[:, :-1]``
and ``y = tokens[:, 1:]`` are ``block_size`` long, as the batch sampler's; the
mask and ids of the targets are ``answer_mask[:, 1:]`` and ``problem_ids[:, 1:]``.
(Held-out files lie beside the shards, not in a subfolder, because the
writer's commit flushes every entry of the folder as a file.)

The training split draws difficulties uniformly from the training range, the
validation split likewise from an independent seed; held-out sets are drawn
from further independent seeds, so none repeats a training stream.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from rdepth.data.prepare import UNIGRAM_FILE, unigram_baseline, unigram_log_probs
from rdepth.data.shards import ShardWriter, TokenShards, check_output_folder
from rdepth.data.task_vocab import TaskVocab
from rdepth.errors import RdepthError
from rdepth.fields import check_fields, option
from rdepth.io import environment_info, read_json_object
from rdepth.tasks.base import Problem, check_int
from rdepth.tasks.registry import get_task, parse_mixture, task_spec
from rdepth.tasks.stream import check_difficulties, pack_windows, sample_problems

log = logging.getLogger(__name__)

SPLIT_STREAMS = {"train": 0, "val": 1}  # seed streams; held-out difficulty D uses stream 1000 + D


def mask_file(split: str) -> str:
    return f"{split}_mask.bin"


def problems_file(split: str) -> str:
    return f"{split}_problems.npy"  # read by rdepth.data.shards.TokenShards.problem_index


def heldout_file(difficulty: int) -> str:
    return f"heldout_d{difficulty}.npz"


# Tokens per generated split: about 4 bytes each on disk (ids, answer mask, problem index) and read whole
# once for the unigram baseline; 2^30 is ~4 GiB per split and an hour or more of generation.
MAX_TASK_TOKENS = 1 << 30
BYTES_PER_TASK_TOKEN = 4


@dataclass
class TaskDataConfig:
    """What ``prepare_task_data`` builds. ``out`` defaults to ``data/task-<names>``.

    ``heldout_difficulties`` defaults to every training difficulty plus
    ceil(1.5 x) and 2 x the largest, keeping those every task accepts and the
    context holds.
    """

    task: str = option("chase", "a task name, or a mixture such as chase*2+assign (optionally prefixed task:)")
    train_difficulties: tuple[int, ...] = option((1, 6), "training difficulty range LOW,HIGH (inclusive)")
    heldout_difficulties: tuple[int, ...] | None = option(
        None, "held-out difficulties", default_text="the training range plus 1.5x and 2x its top")
    train_tokens: int = option(2_000_000, f"training tokens to generate (at most {MAX_TASK_TOKENS:,})")
    val_tokens: int = option(100_000, f"validation tokens to generate (at most {MAX_TASK_TOKENS:,})")
    heldout_problems: int = option(256, "problems per held-out difficulty", bounds=f"[1, {1 << 30}]")
    block_size: int = option(128, "the model's context length (problems never straddle a held-out window)",
                             bounds=f"[2, {1 << 20}]")
    seed: int = option(0, "seed of every generated problem", bounds=f"[0, {(1 << 63) - 1}]")
    out: Path | None = option(None, "output folder", default_text="data/task-<names>")
    task_params: dict | str = option(
        "", "JSON object of per-task parameters, e.g. '{\"chase\": {\"nodes\": 16, \"ordered\": true}}'")

    def __post_init__(self) -> None:
        self.mixture = parse_mixture(self.task)
        if isinstance(self.task_params, str):
            try:
                self.task_params = json.loads(self.task_params) if self.task_params.strip() else {}
            except json.JSONDecodeError:
                raise RdepthError("task_params: not valid JSON") from None
        if not isinstance(self.task_params, dict) or not all(isinstance(v, dict) for v in self.task_params.values()):
            raise RdepthError("task_params: expected {task name: {parameter: value}}")
        unknown = sorted(set(self.task_params) - {name for name, _ in self.mixture})
        if unknown:
            raise RdepthError(f"task_params: {', '.join(unknown)} not in the mixture {self.task!r}")
        self.tasks = [(get_task(name, **self.task_params.get(name, {})), weight) for name, weight in self.mixture]
        check_fields(self, "task data")
        check_int("task data", "train_tokens", self.train_tokens, self.block_size + 1, MAX_TASK_TOKENS)
        check_int("task data", "val_tokens", self.val_tokens, self.block_size + 1, MAX_TASK_TOKENS)
        if len(tuple(self.train_difficulties)) != 2:
            raise RdepthError(f"train_difficulties: expected (low, high), got {self.train_difficulties!r}")
        low, high = (int(d) if isinstance(d, (int, np.integer)) else d for d in self.train_difficulties)
        if not (isinstance(low, int) and isinstance(high, int) and low <= high):
            raise RdepthError(f"train_difficulties: expected integers low <= high, got {self.train_difficulties!r}")
        self.train_difficulties = (low, high)
        check_difficulties(self.tasks, self.train_range, self.block_size + 1)
        if self.heldout_difficulties is None:
            self.heldout_difficulties = self._default_heldout()
        else:
            self.heldout_difficulties = tuple(sorted(set(self.heldout_difficulties)))
            check_difficulties(self.tasks, self.heldout_difficulties, self.block_size + 1)
        if self.out is None:
            self.out = Path("data") / ("task-" + "+".join(name for name, _ in self.mixture))
        self.out = Path(self.out).expanduser()

    @property
    def train_range(self) -> list[int]:
        return list(range(self.train_difficulties[0], self.train_difficulties[1] + 1))

    @property
    def spec(self) -> str:
        return task_spec([name for name, _ in self.mixture])

    def _default_heldout(self) -> tuple[int, ...]:
        high = self.train_difficulties[1]
        wanted = sorted(set(self.train_range) | {math.ceil(1.5 * high), 2 * high})
        kept = []
        for difficulty in wanted:
            try:
                check_difficulties(self.tasks, [difficulty], self.block_size + 1)
                kept.append(difficulty)
            except RdepthError as error:
                log.info("held-out difficulty %d left out: %s", difficulty, error)  # a default, not asked for
        return tuple(kept)


def _split_documents(cfg: TaskDataConfig, split: str, tokens: int, masks,
                     index: list[tuple[int, int]]) -> Iterator[tuple[int, ...]]:
    """Problems of ``split`` until ``tokens`` tokens (with separators) are out; writes each mask to
    ``masks`` and appends (start offset, difficulty) of each problem to ``index``."""
    rng = np.random.default_rng([cfg.seed, SPLIT_STREAMS[split]])
    written = 0
    for problem in sample_problems(cfg.tasks, rng, cfg.train_range):
        masks.write(np.append(problem.answer_mask, False).astype(np.uint8).tobytes())
        index.append((written, problem.difficulty))
        yield problem.tokens
        written += len(problem.tokens) + 1
        if written >= tokens:
            return


def heldout_problems(cfg: TaskDataConfig, difficulty: int) -> list[Problem]:
    """The held-out problems of ``difficulty``: ``heldout_problems`` per task of the mixture, in turn."""
    rng = np.random.default_rng([cfg.seed, 1000 + difficulty])
    tasks = [task for task, _ in cfg.tasks]
    return [tasks[i % len(tasks)].sample(rng, difficulty) for i in range(cfg.heldout_problems * len(tasks))]


def check_free_space(out: Path, need: int) -> None:
    """A one-line error, before anything is generated, when the disk holding ``out`` has less than
    ``need`` bytes free."""
    import shutil

    probe = Path(out).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise RdepthError(f"task data: the splits need about {need / 2**30:,.1f} GiB, more than the "
                          f"{free / 2**30:,.1f} GiB free on the disk of {out}: ask for fewer tokens")


def prepare_task_data(cfg: TaskDataConfig) -> Path:
    """Build the task-data folder ``cfg.out`` (layout in the module docstring); return its path."""
    started = time.perf_counter()
    check_output_folder(cfg.out)
    check_free_space(cfg.out, (cfg.train_tokens + cfg.val_tokens) * BYTES_PER_TASK_TOKEN)
    vocab = TaskVocab(cfg.spec)
    masks_info = {}
    with ShardWriter(cfg.out, vocab.vocab_size, vocab.eot_id) as writer:
        vocab.save(writer.directory)
        for split, budget in (("train", cfg.train_tokens), ("val", cfg.val_tokens)):
            mask_path = writer.directory / mask_file(split)
            index: list[tuple[int, int]] = []
            with open(mask_path, "wb") as masks:
                stats = writer.write_split(split, _split_documents(cfg, split, budget, masks, index))
            np.save(writer.directory / problems_file(split), np.asarray(index, dtype=np.int64))
            answer_bytes = np.fromfile(mask_path, dtype=np.uint8)
            assert answer_bytes.size == stats.tokens, "mask and shard lengths differ"
            masks_info[split] = {"file": mask_file(split), "tokens": stats.tokens,
                                 "answers": int(answer_bytes.sum())}
            log.info("%s: %d tokens, %d problems, %d answer tokens", split, stats.tokens,
                     stats.documents, masks_info[split]["answers"])
        heldout = {}
        for difficulty in cfg.heldout_difficulties:
            windows = pack_windows(heldout_problems(cfg, difficulty), cfg.block_size + 1)
            np.savez(writer.directory / heldout_file(difficulty), tokens=windows.tokens,
                     answer_mask=windows.answer_mask, problem_ids=windows.problem_ids,
                     difficulty=np.int64(difficulty))
            heldout[str(difficulty)] = {"file": heldout_file(difficulty), "windows": len(windows.tokens),
                                        "problems": int(windows.problem_ids.max()) + 1}
        train_tokens = np.fromfile(writer.path("train"), dtype=writer.dtype)
        baseline = unigram_baseline(train_tokens, np.fromfile(writer.path("val"), dtype=writer.dtype),
                                    vocab.vocab_size)
        np.save(writer.directory / UNIGRAM_FILE, unigram_log_probs(train_tokens, vocab.vocab_size))
        manifest = {
            "corpus": {"spec": cfg.spec, "name": cfg.spec, "sources": [],
                       "documents_total": sum(s.documents for s in writer.stats.values())},
            "tokenizer": vocab.name,
            "vocab_size": vocab.vocab_size,
            "seed": cfg.seed,
            "unigram_baseline": baseline,
            "task": {
                "spec": cfg.spec,
                "tasks": [{**task.describe(), "weight": weight} for task, weight in cfg.tasks],
                "train_difficulties": list(cfg.train_difficulties),
                "heldout_difficulties": list(cfg.heldout_difficulties),
                "block_size": cfg.block_size,
                # problem + separator length when every problem has the same (else None): windows
                # drawn at multiples of it start at a problem, as positional tasks (chase ordered) need
                "problem_period": _problem_period(cfg),
                "seeds": {"seed": cfg.seed, "streams": {**SPLIT_STREAMS, "heldout": "1000 + difficulty"}},
                "heldout": heldout,
            },
            "masks": masks_info,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "environment": environment_info(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - started, 2),
        }
        out = writer.commit(manifest)
    log.info("prepared task data %s in %.1f s", out, time.perf_counter() - started)
    return out


def _problem_period(cfg: TaskDataConfig) -> int | None:
    lengths = {task.length(d) + 1 for task, _ in cfg.tasks for d in cfg.train_range}
    return lengths.pop() if len(lengths) == 1 else None


# ------------------------------------------------------------------ reading it back


@dataclass
class HeldOut:
    """One held-out set: arrays [W, block_size + 1] (see the module docstring) and its difficulty."""

    difficulty: int
    tokens: np.ndarray
    answer_mask: np.ndarray
    problem_ids: np.ndarray

    def windows(self, start: int = 0, stop: int | None = None) -> HeldOut:
        """The windows ``start:stop`` (problem ids unchanged)."""
        part = slice(start, stop)
        return HeldOut(self.difficulty, self.tokens[part], self.answer_mask[part], self.problem_ids[part])

    def first_problems(self, count: int | None) -> HeldOut:
        """The first windows holding about ``count`` problems (all of them for None; at least one window)."""
        if count is None:
            return self
        last_id = self.problem_ids.max(axis=1)  # [W]: the largest problem id in each window
        return self.windows(0, int(np.searchsorted(last_id, count - 1, side="right")) or 1)


def task_manifest(directory: str | os.PathLike) -> dict:
    """The ``task`` section of a prepared folder's manifest; RdepthError for text data."""
    manifest = read_json_object(Path(directory) / "manifest.json", "manifest")
    if "task" not in manifest:
        raise RdepthError(f"{directory} holds text data, not task data (no 'task' in its manifest)")
    return manifest["task"]


def answer_masks(shards: TokenShards, split: str) -> np.ndarray:
    """uint8 memmap [len(split)]: 1 where the split's token is an answer; checked against the shard."""
    task_manifest(shards.directory)
    path = shards.directory / mask_file(split)
    if not path.is_file():
        raise RdepthError(f"missing answer mask {path}")
    mask = np.memmap(path, dtype=np.uint8, mode="r")
    if mask.size != shards.split(split).size:
        raise RdepthError(f"answer mask {path} has {mask.size} entries for {shards.split(split).size} tokens")
    return mask


def load_heldout(directory: str | os.PathLike, difficulty: int) -> HeldOut:
    """The held-out set of ``difficulty``; RdepthError naming the recorded ones when absent, and one naming
    the folder and the difficulty when the set's file holds no problem or its arrays disagree in shape
    (every caller, evaluation, sweeps and the bench scripts, would otherwise fail deep in its loop)."""
    recorded = task_manifest(directory)["heldout"]
    if str(difficulty) not in recorded:
        raise RdepthError(f"no held-out set of difficulty {difficulty} in {directory} "
                          f"(recorded: {', '.join(recorded)})")
    path = Path(directory) / recorded[str(difficulty)]["file"]
    with np.load(path) as data:
        missing = sorted({"difficulty", "tokens", "answer_mask", "problem_ids"} - set(data.files))
        if missing:
            raise RdepthError(f"{directory}: the held-out set of difficulty {difficulty} ({path.name}) lacks "
                              f"{', '.join(missing)}: prepare the data again")
        heldout = HeldOut(int(data["difficulty"]), data["tokens"], data["answer_mask"], data["problem_ids"])
    shapes = {heldout.tokens.shape, heldout.answer_mask.shape, heldout.problem_ids.shape}
    if len(shapes) != 1 or heldout.tokens.ndim != 2:
        raise RdepthError(f"{directory}: the held-out set of difficulty {difficulty} ({path.name}) has arrays of "
                          f"shapes {', '.join(map(str, sorted(shapes)))}, not one [windows, tokens]: prepare the "
                          "data again")
    if heldout.tokens.shape[0] == 0 or not (heldout.problem_ids >= 0).any():
        raise RdepthError(f"{directory}: the held-out set of difficulty {difficulty} ({path.name}) holds no "
                          "problem: prepare the data again, or choose another difficulty")
    return heldout


def describe_task_data(out: Path) -> list[str]:
    """Lines that describe a prepared task folder (for ``rdepth prepare``)."""
    manifest = read_json_object(Path(out) / "manifest.json", "manifest")
    task, splits = manifest["task"], manifest["splits"]
    lines = [str(out)]
    for split in ("train", "val"):
        lines.append(f"  {split}: {splits[split]['tokens']:,} tokens")
    lines.append(f"  tokenizer {manifest['tokenizer']} (vocab {manifest['vocab_size']}); training difficulties "
                 f"{task.get('train_difficulties')}; held-out difficulties {', '.join(task['heldout'])}")
    return lines
