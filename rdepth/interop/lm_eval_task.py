"""A local ``lm-eval`` task from held-out text: pick the true ending of a sentence.

No hub access is needed: the task is a JSON-lines file plus a task YAML that the
harness reads with ``--include_path DIR`` (``TaskManager(include_path=DIR)``).
Each example is a sentence of the held-out text cut in two: the first half is the
context, the true second half is one choice and the second halves of other
sentences are the rest. Accuracy at chance is ``1 / choices``.
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
  cache_dir: {cache}
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


def sentence_endings(text: str, count: int, choices: int = 4, seed: int = 0, min_words: int = 6) -> list[dict]:
    """Up to ``count`` examples ``{"context", "choices", "label"}`` from the sentences of ``text``."""
    sentences = [s.strip() for s in SENTENCE_END.split(text) if len(s.split()) >= min_words]
    if len(sentences) < choices:
        raise RdepthError(f"held-out text has {len(sentences)} sentences of >= {min_words} words; "
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
                                                         cache=json.dumps(str(folder / ".cache"))))
    return folder
