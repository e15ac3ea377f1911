"""lm-eval's ``local-completions`` model against a real ``rdepth serve`` on 127.0.0.1 (issue 63, item 2): a
loglikelihood task (``echo`` + ``logprobs``, the server's tokenizer through ``/tokenize``) and a generation task
score what ``rdepth lm-eval``'s own model scores on the same run, budget and seed, at ``--batch_size`` 1 and 8.

Skipped where lm-eval or what its API models import (``requests``, ``aiohttp``, ``tenacity``: the
``lm-eval-api`` extra) is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_helpers import serve_process
from test_hf_helpers import sentences, tiny_run

LIKELIHOOD, GENERATION = "rdepth_serve_endings", "rdepth_serve_generate"
GENERATE_YAML = """task: {name}
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
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def harness():
    for name in ("lm_eval", "requests", "aiohttp", "tenacity"):
        pytest.importorskip(name, reason="lm-eval's local-completions needs the lm-eval-api extra")


def generation_task(run: Path, folder: Path) -> None:
    """Six contexts; the answer is ``rdepth lm-eval``'s own continuation for the even ones and a word it does not
    write for the odd ones, so that the exact match is neither 0 nor 1 when the two agree."""
    from lm_eval.api.instance import Instance

    from rdepth.interop.lm_eval_model import RdepthLM

    contexts = [" ".join(s.split()[:4]) for s in sentences(6, seed=21)]
    lm = RdepthLM(str(run), loops="2:3", seed=0, batch_size=8)
    kwargs = {"until": ["."], "max_gen_toks": 6}
    own = lm.generate_until([Instance("generate_until", {}, (c, dict(kwargs)), i) for i, c in enumerate(contexts)],
                            disable_tqdm=True)
    rows = [{"context": c, "answer": own[i] if i % 2 == 0 else " zebra"} for i, c in enumerate(contexts)]
    data = folder / f"{GENERATION}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{GENERATION}.yaml").write_text(GENERATE_YAML.format(
        name=GENERATION, data=json.dumps(str(data)), cache_dir=json.dumps(str(folder / ".cache"))))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(run, task folder, port)``: a random tiny run, the two tasks, and ``rdepth serve`` at the budget 2,3 on
    8 slots in its own process."""
    harness()
    from rdepth.interop.lm_eval_task import write_task

    root = tmp_path_factory.mktemp("serve_lm_eval")
    run, _ = tiny_run(root / "run", groups="1|2-3")
    tasks = write_task(" ".join(sentences(60, seed=9)), root / "tasks", LIKELIHOOD, count=8)
    generation_task(run, tasks)
    with serve_process(run, root, "--loops", "2,3", "--batch-size", "8", "--name", "tiny", "--seed", "0") as port:
        yield run, tasks, port
    text = (root / "server.log").read_text()
    assert "Traceback" not in text and "ERROR" not in text, text


def evaluate(model, tasks: Path, **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return simple_evaluate(model=model, tasks=[LIKELIHOOD, GENERATION], task_manager=manager, log_samples=True,
                           bootstrap_iters=0, **kwargs)


def scores(output: dict) -> tuple[dict, list, list]:
    """The tasks' metrics, each loglikelihood request's (score, greedy) and each generation, in document order."""
    metrics = {task: {k: v for k, v in values.items() if k.split(",")[0] in ("acc", "acc_norm", "exact_match")}
               for task, values in output["results"].items()}
    samples = output["samples"]
    likelihoods = [tuple(r[0]) for s in sorted(samples[LIKELIHOOD], key=lambda s: s["doc_id"]) for r in s["resps"]]
    generations = [s["resps"][0][0] for s in sorted(samples[GENERATION], key=lambda s: s["doc_id"])]
    return metrics, likelihoods, generations


def test_local_completions_against_rdepth_serve_scores_what_rdepth_lm_eval_scores(server):
    from rdepth.interop.lm_eval_model import RdepthLM

    run, tasks, port = server
    own = scores(evaluate(RdepthLM(str(run), loops="2:3", seed=0, batch_size=8), tasks))
    # the server's tokenizer (tokenizer_backend auto: /tokenizer_info and /tokenize answer); max_length 65 is the
    # block's 64 positions as the harness counts them; seed 0: the initial loop states rdepth lm-eval starts from
    arguments = (f"base_url=http://127.0.0.1:{port}/v1/completions,model=tiny,seed=0,max_length=65,max_retries=1,"
                 "timeout=120")
    served = {batch: scores(evaluate("local-completions", tasks, model_args=arguments, batch_size=batch))
              for batch in (1, 8)}
    metrics, likelihoods, generations = own
    assert len(likelihoods) == 32 and len(generations) == 6
    assert 0 < metrics[GENERATION]["exact_match,none"] < 1
    for batch, (served_metrics, served_likelihoods, served_generations) in served.items():
        assert served_metrics == metrics, batch
        assert served_generations == generations, batch
        assert [greedy for _, greedy in served_likelihoods] == [greedy for _, greedy in likelihoods]
        assert [score for score, _ in served_likelihoods] == pytest.approx([score for score, _ in likelihoods],
                                                                           abs=1e-4)
    # however the client batches: the same metrics, generations and greedy flags (above); the scores within
    # float32's rounding of rows batched 1 or 8 wide in the engine's matrix products
    assert [s for s, _ in served[1][1]] == pytest.approx([s for s, _ in served[8][1]], rel=1e-6, abs=1e-5)
