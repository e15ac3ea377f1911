"""The ``rdepth`` model of the lm-eval harness: exact scores, a local task per loop budget, the ``hf`` path.

Skipped where lm-eval is not installed (the ``lm-eval`` extra), except the test that
``rdepth lm-eval`` then says so in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_hf_helpers import cli, one_line_error, sentences, tiny_run, tiny_tokenizer  # noqa: E402

from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise

TASK = "rdepth_heldout_endings"


def lm_eval_or_skip():
    return pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("lm_eval") / "run", groups="1|2-3")


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    """A 4-way sentence-ending task written from held-out text (sentences the tokenizer never saw)."""
    from rdepth.interop.lm_eval_task import write_task

    return write_task(" ".join(sentences(80, seed=9)), tmp_path_factory.mktemp("tasks"), TASK, count=24)


def instances(kind: str, arguments: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def hand_scores(model, ids: list[int], first_target: int, loops) -> tuple[float, bool]:
    """Sum of log p(ids[t] | ids[:t]) for t >= first_target, from one forward of the model."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]), loop_counts=loops, noise=StateNoise(0, [0])).logits[0]
    logprobs = F.log_softmax(logits, dim=-1)[first_target - 1 :]
    targets = torch.tensor(ids[first_target:])
    return float(logprobs.gather(1, targets[:, None]).sum()), bool((logprobs.argmax(-1) == targets).all())


def test_loglikelihood_is_the_models_own(run):
    lm_eval_or_skip()
    from rdepth.interop.lm_eval_model import RdepthLM

    folder, model = run
    tokenizer = tiny_tokenizer()
    pairs = [("The old castle", " on the hill"), ("A river runs", " north past the town."), ("", "The king")]
    scores = {}
    for batch_size in (1, 8):
        lm = RdepthLM(str(folder), loops="2:3", batch_size=batch_size)
        scores[batch_size] = lm.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    for (context, continuation), (score, greedy), (score_1, greedy_1) in zip(pairs, scores[8], scores[1], strict=False):
        context_ids = tokenizer.encode(context) if context else [tokenizer.eot_id]
        ids = context_ids + tokenizer.encode(context + continuation)[len(tokenizer.encode(context)) if context else 0:]
        expected, expected_greedy = hand_scores(model, ids, len(context_ids), (2, 3))
        assert score_1 == pytest.approx(expected, abs=1e-5) and greedy_1 == expected_greedy
        assert score == pytest.approx(score_1, abs=1e-4) and greedy == greedy_1  # batching pads, never changes


def test_loglikelihood_rolling_and_generate_until(run):
    lm_eval_or_skip()
    from rdepth.interop.lm_eval_model import RdepthLM

    folder, model = run
    tokenizer = tiny_tokenizer()
    lm = RdepthLM(str(folder), loops=2)
    short = "The small village by the lake has an old market."
    (total,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(short,)]), disable_tqdm=True)
    expected, _ = hand_scores(model, [tokenizer.eot_id] + tokenizer.encode(short), 1, (2, 2))
    assert total == pytest.approx(expected, abs=1e-4)
    long = " ".join(sentences(30, seed=4))  # several windows of the 64-token block
    assert len(tokenizer.encode(long)) > 2 * 64
    (total,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(long,)]), disable_tqdm=True)
    assert torch.isfinite(torch.tensor(total)) and total < 0

    # three requests through the engine's slots (batch size 2): each equals its decode alone
    prompts = ["The old castle", "A river", "In the morning the market"]
    lm.batch_size = 2
    texts = lm.generate_until(instances("generate_until", [(p, {"until": ["."], "max_gen_toks": 6 + 3 * i})
                                                           for i, p in enumerate(prompts)]), disable_tqdm=True)
    for i, (prompt, text) in enumerate(zip(prompts, texts, strict=False)):
        ids = tokenizer.encode(prompt)
        tokens = generate(model, torch.tensor([ids]), 6 + 3 * i, temperature=0, loop_counts=(2, 2),
                          noise=StateNoise(0, [0]))
        new = tokens[0, len(ids):].tolist()
        new = new[: new.index(tokenizer.eot_id)] if tokenizer.eot_id in new else new
        assert text == tokenizer.decode(new).split(".")[0]


def test_local_task_per_loop_budget(run, task_folder, tmp_path, monkeypatch, capsys):
    lm_eval_or_skip()
    folder, _ = run
    out = tmp_path / "results.json"
    assert cli(monkeypatch, "lm-eval", "--checkpoint", folder, "--tasks", TASK, "--include-path", task_folder,
               "--loops", "1", "--loops", "3,1", "--json", out) == 0
    summary = json.loads(out.read_text())
    assert [b["loops"] for b in summary["budgets"]] == [[1, 1], [3, 1]]
    for budget in summary["budgets"]:
        metrics = budget["results"][TASK]
        assert metrics["sample_len"] == 24 and 0 <= metrics["acc"] <= 1 and 0 <= metrics["acc_norm"] <= 1
        # the harness's standard error of a mean of 0/1 scores: sample std / sqrt(n) = sqrt(p(1-p)/(n-1))
        for name in ("acc", "acc_norm"):
            p = metrics[name]
            assert metrics[f"{name}_stderr"] == pytest.approx((p * (1 - p) / 23) ** 0.5, rel=1e-9)
    printed = capsys.readouterr().out
    assert "loops        1,1" in printed and "loops        3,1" in printed and "acc " in printed
    first = summary["budgets"][0]["results"][TASK]
    assert f"acc {first['acc']:.4f} ± {first['acc_stderr']:.4f}" in printed


def test_over_long_requests_are_cut_from_the_left_or_refused_by_name(run):
    lm_eval_or_skip()
    from rdepth.errors import RdepthError
    from rdepth.interop.lm_eval_model import RdepthLM

    folder, model = run
    tokenizer = tiny_tokenizer()
    lm = RdepthLM(str(folder), loops="2:3")
    context, continuation = " ".join(sentences(20, seed=5)), " The old castle on the hill."
    ids = tokenizer.encode(context + continuation)
    assert len(ids) > 64 + 1
    ((score, _),) = lm.loglikelihood(instances("loglikelihood", [(context, continuation)]), disable_tqdm=True)
    kept = ids[-(64 + 1):]  # the harness's cut: the last block_size + 1 tokens
    expected, _ = hand_scores(model, kept, len(kept) - (len(ids) - len(tokenizer.encode(context))), (2, 3))
    assert score == pytest.approx(expected, abs=1e-5)
    too_long = " " + " ".join(sentences(20, seed=6))
    with pytest.raises(RdepthError, match=r"continuation of \d+ tokens is longer than the model's block size 64 "
                                          r"\(request: context 'A river'"):
        lm.loglikelihood(instances("loglikelihood", [("A river", too_long)]), disable_tqdm=True)


def test_unknown_task_is_a_one_line_error(run, task_folder, monkeypatch, capsys):
    lm_eval_or_skip()
    folder, _ = run
    code = cli(monkeypatch, "lm-eval", "--checkpoint", folder, "--tasks", "no_such_task_anywhere",
               "--include-path", task_folder)
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the harness's own log lines
    assert code == 2 and last.startswith("rdepth lm-eval: error:") and "unknown task" in last


def test_missing_lm_eval_is_a_one_line_error(run, monkeypatch, capsys):
    folder, _ = run
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")
                 or m == "rdepth.interop.lm_eval_model"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails
    err = one_line_error(capsys, cli(monkeypatch, "lm-eval", "--checkpoint", folder, "--tasks", TASK))
    assert "pip install 'rdepth[lm-eval]'" in err


def test_harness_command_line_with_the_rdepth_model(run, task_folder):
    lm_eval_or_skip()
    folder, _ = run
    done = subprocess.run(
        [sys.executable, "-m", "rdepth.interop.lm_eval_model", "--model", "rdepth", "--model_args",
         f"checkpoint={folder},loops=2:1", "--tasks", TASK, "--include_path", str(task_folder), "--limit", "6"],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert TASK in done.stdout and "acc" in done.stdout


def test_exported_folder_scores_the_same_through_the_hf_model(run, task_folder, tmp_path):
    lm_eval_or_skip()
    pytest.importorskip("accelerate")  # lm-eval's hf model needs it
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run
    from rdepth.interop.lm_eval_model import RdepthLM

    folder, _ = run
    exported = export_run(ExportConfig(checkpoint=str(folder), out=str(tmp_path / "hf")))
    manager = TaskManager(include_path=str(task_folder))
    common = dict(tasks=[TASK], task_manager=manager, log_samples=True, bootstrap_iters=0, limit=12)
    ours = simple_evaluate(model=RdepthLM(str(folder), loops="3:2", batch_size=4), **common)
    theirs = simple_evaluate(model="hf", model_args=f"pretrained={exported},trust_remote_code=True,"
                             "loop_counts=3:2,dtype=float32", batch_size=4, device="cpu", **common)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][TASK][metric] == theirs["results"][TASK][metric]
    for a, b in zip(ours["samples"][TASK], theirs["samples"][TASK], strict=False):
        for (score_a, _), (score_b, _) in zip(a["filtered_resps"], b["filtered_resps"], strict=False):
            assert score_a == pytest.approx(score_b, abs=1e-4)


def test_help(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(monkeypatch, "lm-eval", "--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--tasks" in text and "--include-path" in text and "--loops" in text and "--threads" in text


def test_negative_threads_is_a_one_line_error(monkeypatch, capsys):
    code = cli(monkeypatch, "lm-eval", "--checkpoint", "x", "--tasks", "t", "--threads", "-1")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "threads must be >= 0" in err and "\n" not in err


def test_chase_generation_task_scores_a_task_model(tmp_path, monkeypatch, capsys):
    """The local chase task: fresh problems with the data's parameters, answers the task's own; the
    harness's exact_match equals the model's greedy answers counted by hand."""
    lm_eval_or_skip()
    from rdepth.data.task_vocab import TaskVocab
    from rdepth.interop.lm_eval_task import write_chase_task
    from rdepth.tasks.data import TaskDataConfig, prepare_task_data
    from rdepth.tasks.registry import get_task

    params = {"chase": {"nodes": 8, "queries": 4, "ordered": True}}
    data = prepare_task_data(TaskDataConfig(task="chase", train_difficulties=(1, 3), train_tokens=4000,
                                            val_tokens=1000, heldout_difficulties=(2, 4), heldout_problems=4,
                                            block_size=24, task_params=json.dumps(params), out=tmp_path / "data"))
    names = write_chase_task(data, tmp_path / "tasks", count=6)
    assert names == ["rdepth_chase_d2", "rdepth_chase_d4"]
    vocab = TaskVocab("task:chase")
    task = get_task("chase", **params["chase"])
    rows = [json.loads(line) for line in (tmp_path / "tasks" / "rdepth_chase_d4.jsonl").read_text().splitlines()]
    assert len(rows) == 6 * 4 and {row["difficulty"] for row in rows} == {4}
    for row in rows[3::4]:  # the last query of each problem: its answer is the task's own
        ids = vocab.encode(row["context"] + " " + row["answer"])
        assert task.solve(ids)[-1] == ids[-1]
    folder, model = tiny_run(tmp_path / "run", groups="1", n_layer=3, tokenizer=vocab, block_size=24)
    out = tmp_path / "chase.json"
    assert cli(monkeypatch, "lm-eval", "--checkpoint", folder, "--tasks", "rdepth_chase_d4", "--include-path",
               tmp_path / "tasks", "--loops", "2", "--json", out, "--threads", "1") == 0
    metrics = json.loads(out.read_text())["budgets"][0]["results"]["rdepth_chase_d4"]
    with torch.no_grad():
        right = 0
        for row in rows:
            ids = torch.tensor([vocab.encode(row["context"])])
            logits = model(ids, loop_counts=(2,), noise=StateNoise(0, [0])).logits[0, -1]
            right += vocab.decode([int(logits.argmax())]) == row["answer"]
    p = right / len(rows)
    assert metrics["exact_match"] == pytest.approx(p)
    assert metrics["exact_match_stderr"] == pytest.approx((p * (1 - p) / (len(rows) - 1)) ** 0.5)
    assert "exact_match" in capsys.readouterr().out


def test_sentence_endings_leave_out_sentences_too_long_for_a_small_block():
    from rdepth.interop.lm_eval_task import sentence_endings

    short = sentences(12, seed=2)
    long = "The " + " ".join(["old river"] * 40) + "."
    examples = sentence_endings(" ".join(short + [long]), count=50, min_words=5, max_words=48)
    assert len(examples) == 12 and all("old river old river old river" not in c for e in examples
                                       for c in e["choices"] + [e["context"]])


GEN_TASK = "rdepth_batched_continuations"
GEN_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache_dir}
test_split: test
output_type: generate_until
doc_to_text: context
doc_to_target: target
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


def test_batched_generation_through_lm_evals_own_hf_model_equals_each_prompt_alone(run, tmp_path):
    """EleutherAI lm-eval's own ``--model hf`` on a generation task with prompts of different lengths at
    batch size 8 (issue 43: it failed on padding when lm-eval's stopping criteria sent generate() into
    transformers' loop): every continuation equals rdepth's greedy decoding of that prompt alone, cut at
    the first stop string as the harness cuts."""
    lm_eval_or_skip()
    pytest.importorskip("accelerate")
    import json

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run
    from rdepth.model.generation import generate

    folder, model = run
    contexts = [" ".join(sentence.split()[: 2 + index % 7]) for index, sentence in enumerate(sentences(12, seed=4))]
    assert len({len(tiny_tokenizer().encode(c)) for c in contexts}) > 3  # prompts of different lengths
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "target": "x"}) + "\n" for c in contexts))
    (tasks / f"{GEN_TASK}.yaml").write_text(GEN_YAML.format(name=GEN_TASK, data=data, cache_dir=tmp_path / "cache"))
    exported = export_run(ExportConfig(checkpoint=str(folder), out=str(tmp_path / "hf")))
    result = simple_evaluate(model="hf", model_args=f"pretrained={exported},trust_remote_code=True,"
                             "loop_counts=3:2,dtype=float32", batch_size=8, device="cpu",
                             tasks=[GEN_TASK], task_manager=TaskManager(include_path=str(tasks)),
                             log_samples=True, bootstrap_iters=0)
    samples = sorted(result["samples"][GEN_TASK], key=lambda sample: sample["doc_id"])
    assert len(samples) == len(contexts)
    tokenizer = tiny_tokenizer()
    for sample, context in zip(samples, contexts, strict=False):
        ids = torch.tensor([tokenizer.encode(context)])
        with torch.no_grad():
            tokens = generate(model, ids, 6, loop_counts=(3, 2), noise=StateNoise(0, [0]))[0, ids.shape[1]:]
        alone = tokenizer.decode(tokens.tolist()).split(".")[0]
        assert sample["resps"][0][0] == alone, context
    assert sum(bool(sample["resps"][0][0].strip()) for sample in samples) >= len(samples) // 2  # text was made


def test_generate_until_with_loop_speculation_gives_plain_decodings_texts(run):
    """speculate=K (drafts at draft_loops, verified at the budget in one pass): the same texts as plain decoding,
    at batch size 1 (every request speculates) and 2 (the batch's tail does), and the rounds are counted."""
    lm_eval_or_skip()
    from rdepth.interop.lm_eval_model import RdepthLM

    folder, _ = run
    prompts = ["The old castle", "A river", "In the morning the market", "The king"]
    asked = instances("generate_until", [(p, {"until": ["\n\n"], "max_gen_toks": 10 + 2 * i})
                                         for i, p in enumerate(prompts)])
    plain = RdepthLM(str(folder), loops="3:2").generate_until(asked, disable_tqdm=True)
    for batch_size in (1, 2):
        lm = RdepthLM(str(folder), loops="3:2", batch_size=batch_size, speculate="3", draft_loops="1:1")
        assert lm.generate_until(asked, disable_tqdm=True) == plain
        counts = lm.speculation_counts
        assert counts["rounds"] > 0 and 0 <= counts["accepted"] <= counts["drafted"]


@pytest.mark.parametrize("options, why", [
    ({"speculate": "0"}, "speculate must be an integer >= 1"),
    ({"speculate": "two"}, "speculate must be an integer >= 1"),
    ({"draft_loops": "1"}, "give speculate too"),
    ({"speculate": "2", "speculate_at_most": "-1"}, "speculate_at_most must be an integer >= 1"),
])
def test_speculation_arguments_that_cannot_run_are_one_line_errors(run, options, why):
    lm_eval_or_skip()
    from rdepth.errors import RdepthError
    from rdepth.interop.lm_eval_model import RdepthLM

    with pytest.raises(RdepthError, match=why):
        RdepthLM(str(run[0]), loops=2, **options)


def test_lm_eval_refuses_drafts_without_speculate_and_a_draft_at_the_budget_in_one_line(run, task_folder, monkeypatch,
                                                                                         capsys):
    lm_eval_or_skip()
    folder, _ = run
    err = one_line_error(capsys, cli(monkeypatch, "lm-eval", "--checkpoint", folder, "--tasks", TASK,
                                     "--include-path", task_folder, "--draft-loops", "1"))
    assert "--speculate" in err
    from rdepth.errors import RdepthError
    from rdepth.interop.lm_eval_model import RdepthLM

    lm = RdepthLM(str(folder), loops=1, speculate=2, draft_loops=1)  # a draft at the budget: the engine says so
    with pytest.raises(RdepthError, match="draft"):
        lm.generate_until(instances("generate_until", [("The old castle", {"until": ["."], "max_gen_toks": 4})]),
                          disable_tqdm=True)


def test_lm_eval_with_speculate_reports_its_rounds_per_budget(run, task_folder, tmp_path, monkeypatch, capsys):
    """A scoring task generates nothing: zero rounds, said per budget in the JSON and the printout."""
    lm_eval_or_skip()
    folder, _ = run
    out = tmp_path / "spec.json"
    assert cli(monkeypatch, "lm-eval", "--checkpoint", folder, "--tasks", TASK, "--include-path", task_folder,
               "--loops", "2", "--limit", "4", "--speculate", "2", "--draft-loops", "1", "--json", out) == 0
    (budget,) = json.loads(out.read_text())["budgets"]
    assert budget["speculation"] == {"rounds": 0, "drafted": 0, "accepted": 0}
    assert "speculation: 0 rounds, 0 drafts" in capsys.readouterr().out
