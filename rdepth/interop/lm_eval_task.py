"""Local ``lm-eval`` tasks: no hub access, a JSON-lines file plus a task YAML per task, which the
harness reads with ``--include_path DIR`` (``TaskManager(include_path=DIR)``).

- :func:`write_task`, for text models: pick the true ending of a held-out sentence (multiple
  choice, scored by log-likelihood). Each example is a sentence cut in two: the first half is the
  context, the true second half is one choice and the second halves of other sentences are the
  rest. Accuracy at chance is ``1 / choices``. Sentences longer than ``max_words`` are left out, so
  an ending fits a small model's block.
- :func:`write_chase_task`, for task models (trained on ``task:chase`` data): fresh pointer-chasing
  problems drawn with the training data's own task parameters, one task per difficulty; the model
  generates each query's answer (``generate_until``, one token) and ``exact_match`` scores it.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.io import write_text

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache_dir}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def sentence_endings(text: str, count: int, choices: int = 4, seed: int = 0, min_words: int = 6,
                     max_words: int = 48) -> list[dict]:
    """Up to ``count`` examples ``{"context", "choices", "label"}`` from the sentences of ``text`` of
    ``min_words`` to ``max_words`` words."""
    sentences = [s.strip() for s in SENTENCE_END.split(text) if min_words <= len(s.split()) <= max_words]
    if len(sentences) < choices:
        raise RdepthError(f"held-out text has {len(sentences)} sentences of {min_words} to {max_words} words; "
                          f"a {choices}-way task needs at least {choices}")
    rng = random.Random(seed)
    halves = []
    for sentence in sentences:
        words = sentence.split()
        cut = len(words) // 2
        halves.append((" ".join(words[:cut]), " ".join(words[cut:])))
    examples = []
    for index in rng.sample(range(len(halves)), min(count, len(halves))):
        context, ending = halves[index]
        others = rng.sample([i for i in range(len(halves)) if halves[i][1] != ending], choices - 1)
        options = [ending] + [halves[i][1] for i in others]
        rng.shuffle(options)
        examples.append({"context": context, "choices": options, "label": options.index(ending)})
    return examples


def write_task(text: str, folder: str | Path, name: str = "rdepth_heldout_endings", count: int = 100,
               choices: int = 4, seed: int = 0) -> Path:
    """Write ``folder/NAME.jsonl`` and ``folder/NAME.yaml``; returns the folder (an lm-eval include path)."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise RdepthError(f"task name {name!r}: use letters, digits and _")
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    examples = sentence_endings(text, count, choices, seed)
    data = folder / f"{name}.jsonl"
    write_text(data, "".join(json.dumps(example) + "\n" for example in examples))
    write_text(folder / f"{name}.yaml", TASK_YAML.format(name=name, data=json.dumps(str(data)),
                                                         cache_dir=json.dumps(str(folder / ".cache"))))
    return folder


CHASE_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache_dir}
test_split: test
output_type: generate_until
doc_to_text: context
doc_to_target: answer
generation_kwargs:
  until: ["?"]
  max_gen_toks: 1
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def chase_examples(task, difficulty: int, count: int, seed: int) -> list[dict]:
    """``count`` problems of ``difficulty``, one example per answer: ``{"context", "answer", "difficulty"}``,
    the context being the problem up to that answer (the earlier answers included, as teacher-forced
    accuracy reads them), starting where training and held-out windows start a problem."""
    import numpy as np

    from rdepth.data.task_vocab import TaskVocab

    vocab = TaskVocab("task:chase")
    rng = np.random.default_rng([seed, difficulty])
    examples = []
    for _ in range(count):
        problem = task.sample(rng, difficulty)
        for position in problem.answer_positions:
            examples.append({"context": vocab.decode(problem.tokens[:position]),
                             "answer": vocab.decode([problem.tokens[position]]), "difficulty": difficulty})
    return examples


def write_chase_task(data: str | Path, folder: str | Path, name: str = "rdepth_chase",
                     difficulties: tuple[int, ...] | None = None, count: int = 100, seed: int = 1234) -> list[str]:
    """Write one chase task per difficulty (``NAME_dD.yaml`` + ``.jsonl``) into ``folder`` from the
    task data folder ``data`` (its manifest gives the chase parameters; default difficulties: its
    held-out ones); returns the task names. ``seed`` draws problems apart from the data's own seed."""
    from rdepth.tasks.data import task_manifest
    from rdepth.tasks.registry import get_task

    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise RdepthError(f"task name {name!r}: use letters, digits and _")
    manifest = task_manifest(data)
    chase = [entry for entry in manifest.get("tasks", []) if entry.get("name") == "chase"]
    if not chase:
        raise RdepthError(f"{data} holds no chase task (its tasks: "
                          f"{', '.join(e.get('name', '?') for e in manifest.get('tasks', []))})")
    task = get_task("chase", **chase[0]["params"])
    if difficulties is None:
        difficulties = tuple(int(d) for d in manifest.get("heldout", {}))
    if not difficulties:
        raise RdepthError("write_chase_task: no difficulties given and none recorded in the data")
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for difficulty in difficulties:
        task_name = f"{name}_d{difficulty}"
        rows = chase_examples(task, int(difficulty), count, seed)
        path = folder / f"{task_name}.jsonl"
        write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
        write_text(folder / f"{task_name}.yaml", CHASE_YAML.format(
            name=task_name, data=json.dumps(str(path)), cache_dir=json.dumps(str(folder / ".cache"))))
        names.append(task_name)
    return names
