"""Built-in reasoning tasks: generators, checkers, streams, accuracy and the task-data writer."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from rdepth.data.shards import TokenShards
from rdepth.data.task_vocab import EOT_ID, SYMBOL_IDS, TOKENS
from rdepth.errors import RdepthError
from rdepth.tasks import (
    TASKS,
    TaskDataConfig,
    TaskVocab,
    answer_accuracy,
    answer_masks,
    get_task,
    load_heldout,
    load_task_vocab,
    pack_windows,
    parse_mixture,
    prepare_task_data,
    problem_correct,
    render_stream,
)
from rdepth.tasks.assign import AssignTask
from rdepth.tasks.chase import ChaseTask
from rdepth.tasks.modsum import ModSumTask

VOCAB = TaskVocab("task:test")


def ids(text: str) -> list[int]:
    return VOCAB.encode(text)


# ---------------------------------------------------------------- hand-built problems with known answers

KNOWN = [
    # (task, statement with answer slots, answers); the second of each task is its hardest difficulty
    (ChaseTask(nodes=5, queries=2), "c d a b d d b c e e ? a d ? e e", "d e"),
    (ChaseTask(nodes=5, queries=2), "d e b c a b e e c d ? a e ? c e", "e e"),  # 4 hops = nodes - 1
    (ChaseTask(nodes=5, queries=2, ordered=True), "b c d d e ? a d ? e e", "d e"),
    (ChaseTask(nodes=5, queries=2, ordered=True), "b c d e e ? a e ? d e", "e e"),
    (ModSumTask(), "+ 3 9 4 1 = 7", "7"),
    (ModSumTask(max_terms=64), "+ " + "9 " * 64 + "= 6", "6"),  # 64 nines = 576
    (AssignTask(variables=4, queries=2), "c = b a = 7 d = 2 b = a ? c 7 ? d 2", "7 2"),
    (AssignTask(variables=4, queries=2), "b = a d = c a = 5 c = b ? d 5 ? b 5", "5 5"),  # 4 = variables
]


@pytest.mark.parametrize("task, text, answer", KNOWN)
def test_checker_on_known_problems(task, text, answer):
    tokens = ids(text)
    assert task.solve(tokens) == tuple(ids(answer))
    assert task.check(tokens, ids(answer))
    wrong = ids(answer)
    wrong[-1] = ids("0")[0] if wrong[-1] != ids("0")[0] else ids("1")[0]
    assert not task.check(tokens, wrong)
    assert not task.check(tokens, ids(answer)[:-1])  # a missing answer token is wrong too


def test_checker_ignores_the_answer_slots():
    """The checker recomputes from the statement: a corrupted answer slot does not change its verdict."""
    task = ChaseTask(nodes=5, queries=2)
    tokens = ids("c d a b d d b c e e ? a b ? e c")  # the slots hold wrong answers
    assert task.check(tokens, ids("d e")) and not task.check(tokens, ids("b c"))


@pytest.mark.parametrize("task, text", [
    (ChaseTask(nodes=3, queries=1), "a b b a c c ? a c"),  # a cycle without a fixed point
    (ChaseTask(nodes=3, queries=1), "a b a c c c ? a c"),  # two arrows from a
    (ChaseTask(nodes=3, queries=1), "a b b b c c"),  # no query
    (ChaseTask(nodes=3, queries=1, ordered=True), "b c ? a c"),  # two values for three letters
    (ChaseTask(nodes=3, queries=1, ordered=True), "b d c ? a c"),  # d is not among the 3 letters
    (ModSumTask(modulus=5), "+ 3 7 = 0"),  # 7 is not a digit below 5
    (AssignTask(variables=2, queries=1), "a = b b = a ? a 1"),  # a cycle
    (AssignTask(variables=2, queries=1), "a = c b = 1 ? a 1"),  # c never assigned
])
def test_malformed_problems_raise(task, text):
    with pytest.raises(RdepthError):
        task.solve(ids(text))


# ---------------------------------------------------------------- generators


def main_query_depth(task, problem) -> int:
    """Steps the deepest query of ``problem`` needs, counted here independently of the task code."""
    names = [TOKENS[t] for t in problem.tokens]
    statement_end = names.index("?")
    queries = [names[p - 1] for p in problem.answer_positions]
    if isinstance(task, ChaseTask):
        if task.ordered:
            arrows = dict(zip("abcdefghijklmnopqrstuvwxyz", names[:statement_end], strict=False))
        else:
            arrows = dict(zip(names[0:statement_end:2], names[1:statement_end:2], strict=False))

        def hops(symbol):
            return 0 if arrows[symbol] == symbol else 1 + hops(arrows[symbol])
    else:
        sources = dict(zip(names[0:statement_end:3], names[2:statement_end:3], strict=False))
        def hops(symbol):
            return 0 if symbol.isdigit() else 1 + hops(sources[symbol])
    return max(hops(q) for q in queries)


@pytest.mark.parametrize("name, params", [(name, {}) for name in sorted(TASKS)]
                         + [("chase", {"nodes": 16, "queries": 8, "ordered": True}),
                            ("chase", {"nodes": 16, "queries": 8, "max_distractor_hops": 1}),
                            ("chase", {"nodes": 16, "queries": 16, "ordered": True, "min_distractor_hops": 15})])
def test_generated_problems_check_and_have_their_difficulty(name, params):
    task = get_task(name, **params)
    rng = np.random.default_rng(0)
    difficulties = sorted({task.min_difficulty, task.min_difficulty + 1, task.max_difficulty // 2,
                           task.max_difficulty})
    for difficulty in difficulties:
        for _ in range(20):
            problem = task.sample(rng, difficulty)
            assert problem.difficulty == difficulty and len(problem.tokens) == task.length(difficulty)
            assert task.check(problem.tokens, problem.answer)
            assert EOT_ID not in problem.tokens
            if name == "modsum":
                assert len(problem.tokens) - 3 == difficulty
            else:
                assert main_query_depth(task, problem) == difficulty


def test_chase_min_distractor_hops_makes_every_chain_as_long_as_the_main_one():
    task = get_task("chase", nodes=16, queries=16, ordered=True, min_distractor_hops=15)
    plain = get_task("chase", nodes=16, queries=16, ordered=True)
    rng = np.random.default_rng(3)
    for difficulty in (1, 3, 5, 7):
        for _ in range(10):
            problem = task.sample(rng, difficulty)
            successor = dict(zip(SYMBOL_IDS[:16], problem.tokens[:16], strict=False))
            sources = set(successor.values())
            starts = [s for s in successor if s not in sources]  # chain heads (no arrow in)
            lengths = []
            for start in starts:
                hops, current = 0, start
                while successor[current] != current:
                    current, hops = successor[current], hops + 1
                lengths.append(hops)
            full = 16 // (difficulty + 1)  # chains of difficulty + 1 symbols that fit
            assert sorted(lengths, reverse=True)[:full] == [difficulty] * full
            assert max(lengths) == difficulty
    # the default (0) leaves the sampling stream unchanged
    same = get_task("chase", nodes=16, queries=16, ordered=True, min_distractor_hops=0)
    for seed in range(5):
        assert same.sample(np.random.default_rng(seed), 4) == plain.sample(np.random.default_rng(seed), 4)


def test_vocab_round_trip_and_save(tmp_path):
    problem = get_task("chase").sample(np.random.default_rng(1), 5)
    text = VOCAB.decode(problem.tokens)
    assert VOCAB.encode(text) == list(problem.tokens)
    assert VOCAB.encode_batch([text, "? a"]) == [list(problem.tokens), ids("? a")]
    assert VOCAB.decode([VOCAB.eot_id]) == "<eot>" and VOCAB.vocab_size == len(TOKENS)
    VOCAB.save(tmp_path)
    loaded = load_task_vocab(tmp_path)
    assert (loaded.name, loaded.vocab_size, loaded.eot_id) == (VOCAB.name, VOCAB.vocab_size, VOCAB.eot_id)
    with pytest.raises(RdepthError):
        VOCAB.encode("a b hello")
    with pytest.raises(RdepthError):
        VOCAB.decode([len(TOKENS)])
    (tmp_path / "tokenizer_meta.json").write_text(json.dumps({"spec": "bpe:512"}))
    with pytest.raises(RdepthError):
        load_task_vocab(tmp_path)


# ---------------------------------------------------------------- streams


def test_stream_is_deterministic_by_seed_and_aligned():
    mixture = [(get_task("chase"), 2.0), (get_task("modsum"), 1.0)]
    first = render_stream(mixture, np.random.default_rng(7), [1, 3, 5], 3000)
    again = render_stream(mixture, np.random.default_rng(7), [1, 3, 5], 3000)
    other = render_stream(mixture, np.random.default_rng(8), [1, 3, 5], 3000)
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other[0])
    tokens, mask = first
    assert tokens.shape == mask.shape == (3000,) and mask.any() and mask.mean() < 0.25
    # every complete problem of the stream: its masked tokens are exactly the checker's answers
    ends = np.flatnonzero(tokens == EOT_ID)
    starts = np.concatenate([[0], ends[:-1] + 1])
    kinds = set()
    for start, end in zip(starts, ends, strict=False):
        doc = tokens[start:end]
        task = get_task("modsum" if doc[0] == ids("+")[0] else "chase")
        kinds.add(task.name)
        assert tuple(doc[mask[start:end]]) == task.solve(doc)
        assert not mask[end]
    assert kinds == {"chase", "modsum"}


def test_pack_windows_keeps_problems_whole():
    task = get_task("modsum")
    problems = [task.sample(np.random.default_rng(3), d) for d in (2, 9, 4, 12, 1)]
    windows = pack_windows(problems, 20)
    assert windows.tokens.shape[1] == 20
    seen = sorted(set(windows.problem_ids[windows.answer_mask].tolist()))
    assert seen == list(range(len(problems)))
    for problem_id, problem in enumerate(problems):
        row, column = np.argwhere(windows.problem_ids == problem_id)[0]
        assert windows.tokens[row, column] == problem.answer[0]
    with pytest.raises(RdepthError):
        pack_windows([task.sample(np.random.default_rng(0), 30)], 20)


# ---------------------------------------------------------------- accuracy


def test_accuracy_counts_only_answer_positions():
    targets = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = np.array([[0, 1, 1, 0, 0, 1], [0, 0, 1, 0, 1, 0]], dtype=bool)
    problem_ids = np.where(mask, np.array([[-1, 0, 0, -1, -1, 1], [-1, -1, 2, -1, 2, -1]]), -1)
    predictions = np.where(mask, targets, 0)  # every non-answer prediction is wrong
    assert answer_accuracy(predictions, targets, mask, problem_ids) == 1.0
    predictions[1, 4] = 0  # one answer token of problem 2 is wrong: that problem fails
    assert answer_accuracy(predictions, targets, mask, problem_ids) == pytest.approx(2 / 3)
    problems, solved = problem_correct(predictions, targets, mask, problem_ids)
    assert problems.tolist() == [0, 1, 2] and solved.tolist() == [True, True, False]
    logits = torch.nn.functional.one_hot(torch.from_numpy(predictions), 20).float()  # logits, as torch
    assert answer_accuracy(logits, torch.from_numpy(targets), mask, problem_ids) == pytest.approx(2 / 3)
    with pytest.raises(RdepthError):
        answer_accuracy(predictions[:, :5], targets, mask, problem_ids)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("make", [
    lambda: get_task("sudoku"),
    lambda: get_task("chase", depth=3),
    lambda: get_task("chase", nodes=40),
    lambda: get_task("chase", ordered="yes"),
    lambda: get_task("chase", min_distractor_hops=-1),
    lambda: get_task("chase", min_distractor_hops=3, max_distractor_hops=2),
    lambda: get_task("chase").sample(np.random.default_rng(0), 0),
    lambda: get_task("chase").sample(np.random.default_rng(0), 20),
    lambda: get_task("modsum").sample(np.random.default_rng(0), 65),
    lambda: get_task("assign").check_fits(3, 40),  # 60 tokens + separator > 40
    lambda: parse_mixture("chase+sudoku"),
    lambda: parse_mixture("chase*0+modsum"),
    lambda: TaskDataConfig(task="sudoku"),
    lambda: TaskDataConfig(task="chase", train_difficulties=(0, 4)),
    lambda: TaskDataConfig(task="chase", heldout_difficulties=(4, 25)),
    lambda: TaskDataConfig(task="chase", block_size=40),
    lambda: TaskDataConfig(task="chase", task_params={"modsum": {"modulus": 5}}),
    lambda: TaskDataConfig(task="chase", task_params={"chase": {"nodes": 1}}),
])
def test_bad_input_is_a_one_line_error(make):
    with pytest.raises(RdepthError) as error:
        make()
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------- data writer


def test_prepare_task_data_opens_as_shards(tmp_path):
    cfg = TaskDataConfig(task="chase+assign", train_difficulties=(1, 4), train_tokens=20_000,
                         val_tokens=2_000, heldout_problems=12, block_size=160, seed=3, out=tmp_path / "data")
    assert cfg.heldout_difficulties == (1, 2, 3, 4, 6, 8)  # training range, 1.5x and 2x its top
    out = prepare_task_data(cfg)
    shards = TokenShards.open(out, verify=True)
    manifest = shards.manifest
    assert manifest["tokenizer"] == "task:chase+assign" and manifest["vocab_size"] == len(TOKENS)
    assert manifest["task"]["heldout_difficulties"] == [1, 2, 3, 4, 6, 8]
    assert manifest["task"]["problem_period"] is None  # chase and assign problems differ in length
    assert manifest["unigram_baseline"]["cross_entropy_nats"] > 0
    assert load_task_vocab(out).name == "task:chase+assign"
    for split in ("train", "val"):
        tokens, mask = np.asarray(shards.split(split)), answer_masks(shards, split).astype(bool)
        assert tokens.size == mask.size and manifest["masks"][split]["answers"] == mask.sum()
        ends = np.flatnonzero(tokens == EOT_ID)
        assert ends[-1] == tokens.size - 1 and not mask[ends].any()
        for start, end in zip(np.concatenate([[0], ends[:-1] + 1]), ends, strict=False):
            doc = tokens[start:end]
            task = get_task("assign" if TOKENS[doc[1]] == "=" else "chase")
            assert tuple(doc[mask[start:end]]) == task.solve(doc)
    for difficulty in cfg.heldout_difficulties:
        held = load_heldout(out, difficulty)
        assert held.difficulty == difficulty and held.tokens.shape[1] == cfg.block_size + 1
        assert held.problem_ids.max() + 1 == 2 * cfg.heldout_problems
        answers = held.tokens[held.answer_mask]
        assert (answers != EOT_ID).all()
    again = prepare_task_data(dataclasses.replace(cfg, out=tmp_path / "again"))
    for name in ("train.bin", "train_mask.bin", "heldout_d8.npz"):
        assert (again / name).read_bytes() == (out / name).read_bytes()
    with pytest.raises(RdepthError):
        load_heldout(out, 5)


def test_problem_period_and_task_params():
    from rdepth.tasks.data import _problem_period

    cfg = TaskDataConfig(task="task:chase", task_params={"chase": {"nodes": 12, "queries": 4, "ordered": True}},
                         block_size=99, train_difficulties=(1, 4))
    assert cfg.spec == "task:chase" and cfg.tasks[0][0] == ChaseTask(nodes=12, queries=4, ordered=True)
    assert _problem_period(cfg) == 12 + 3 * 4 + 1  # every chase problem has the same length
    assert cfg.heldout_difficulties == (1, 2, 3, 4, 6, 8)
    assert _problem_period(TaskDataConfig(task="modsum", train_difficulties=(2, 5))) is None
