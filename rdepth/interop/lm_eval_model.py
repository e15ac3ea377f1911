"""rdepth models in EleutherAI's ``lm-eval`` harness: the registered model ``rdepth``.

Importing this module registers :class:`RdepthLM` under the name ``rdepth``. The
harness's own ``lm_eval`` command does not import third-party models, so run it
through this module, which registers the model and then hands its arguments to
the harness unchanged::

    python -m rdepth.interop.lm_eval_model --model rdepth \\
        --model_args checkpoint=RUN,loops=4 --tasks hellaswag

``loops``: N for every group, or per group with ``:`` between counts
(``loops=2:3:1``), since the harness splits ``--model_args`` on commas.
``seed``: the initial loop-state seed (every request starts from the states of
sequence id 0 under it, so a request's score does not depend on its batch).
``speculate=K`` (with ``draft_loops=D``, per group with ``:``, and
``speculate_at_most=M``): ``generate_until`` drafts K tokens at D loop steps and
verifies them at ``loops`` in one pass, for a request while at most M are in flight
(default 1: the batch's tail, or every request at ``batch_size=1``); the texts are
plain decoding's.

``rdepth lm-eval`` (:func:`evaluate_budgets`) runs tasks at several loop budgets
and reports each task's metrics per budget. An exported folder also runs through
the harness's own ``hf`` model: ``--model hf --model_args
pretrained=DIR,trust_remote_code=True,loop_counts=4``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import lm_eval.models  # noqa: F401  (the harness's own models first: it loads them only into an empty registry)
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import load_model
from rdepth.run.device import resolve_device
from rdepth.run.heldout import run_tokenizer

log = logging.getLogger(__name__)


def speculation_options(speculate: Any, draft_loops: Any = None, at_most: Any = None) -> dict:
    """The engine's loop-speculation arguments from the model's ``speculate``, ``draft_loops`` and
    ``speculate_at_most`` (strings from ``--model_args`` or numbers); empty when ``speculate`` is not given.
    One-line errors for a count that is not a positive integer, or drafts without ``speculate``."""
    if speculate is None or speculate == "":
        if draft_loops not in (None, "") or at_most not in (None, ""):
            raise RdepthError("lm-eval: draft_loops and speculate_at_most set the drafts of speculate=K; give "
                              "speculate too")
        return {}
    options = {"speculate": _positive("speculate", speculate)}
    if draft_loops not in (None, ""):
        options["draft_loops"] = str(draft_loops).replace(":", ",")
    if at_most not in (None, ""):
        options["speculate_at_most"] = _positive("speculate_at_most", at_most)
    return options


def _positive(name: str, value: Any) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise RdepthError(f"lm-eval: {name} must be an integer >= 1, got {value!r}")
    return int(text)


def parse_budget(loops: Any, n_groups: int) -> tuple[int, ...] | None:
    """``4``, ``"4"``, ``"2:3:1"`` or ``"2,3,1"`` -> per-group counts (None: the model's eval counts)."""
    if loops is None or loops == "":
        return None
    if isinstance(loops, str):
        loops = loops.replace(":", ",")
    return parse_loop_counts(loops, n_groups)


@register_model("rdepth")
class RdepthLM(TemplateLM):
    """An rdepth checkpoint scored at a fixed loop budget.

    ``loglikelihood`` scores a continuation's tokens given its context in one dense
    forward (the last ``block_size`` tokens when longer); ``loglikelihood_rolling``
    scores a whole text in rolling windows of ``block_size``; ``generate_until`` is
    greedy decoding with rdepth's exact key/value cache.
    """

    def __init__(self, checkpoint: str, loops: Any = None, seed: int = 0, batch_size: Any = 8,
                 device: str | None = None, max_batch_size: int | None = None, speculate: Any = None,
                 draft_loops: Any = None, speculate_at_most: Any = None, **unused: Any) -> None:
        super().__init__()
        self.speculation = speculation_options(speculate, draft_loops, speculate_at_most)
        self.speculation_counts = {"rounds": 0, "drafted": 0, "accepted": 0}  # (generate_until's, summed)
        if unused:
            log.debug("rdepth lm-eval model ignores %s", sorted(unused))
        if (device or "").startswith("cuda") and not torch.cuda.is_available():
            log.warning("no CUDA device: the rdepth model runs on the CPU (the harness defaults to cuda:0)")
            device = "cpu"
        self._device = resolve_device(device or "auto")
        self.model, self.model_config = load_model(checkpoint, self._device)
        self.rdepth_tokenizer = run_tokenizer(checkpoint)
        self.loop_counts = parse_budget(loops, self.model_config.n_groups) or self.model_config.default_eval_loops
        self.seed = int(seed)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" -> 8

    # ------------------------------------------------------------ tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.rdepth_tokenizer.eot_id

    @property
    def max_length(self) -> int:
        return self.model_config.block_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.rdepth_tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.rdepth_tokenizer.decode(list(tokens))

    # -------------------------------------------------------------- scoring
    @torch.no_grad()
    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """For (input, targets) pairs where the targets are the last ``len(targets)`` next tokens
        of ``input + [last target]``: (sum of log-probabilities, all greedy)."""
        inputs = [(context + targets)[:-1] for context, targets in rows]
        width = max(len(x) for x in inputs)
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for row, tokens in enumerate(inputs):
            batch[row, : len(tokens)] = torch.tensor(tokens)  # right padding: causal attention never reads it
        noise = StateNoise(self.seed, [0] * len(rows))
        logits = self.model(batch.to(self._device), loop_counts=self.loop_counts, noise=noise).logits
        logprobs = F.log_softmax(logits.float(), dim=-1)
        results = []
        for row, ((_context, targets), tokens) in enumerate(zip(rows, inputs, strict=False)):
            end = len(tokens)
            span = logprobs[row, end - len(targets) : end]  # (len(targets), vocab)
            wanted = torch.tensor(targets, device=span.device)
            score = float(span.gather(1, wanted[:, None]).sum())
            greedy = bool((span.argmax(dim=-1) == wanted).all())
            results.append((score, greedy))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        # As the harness's own models: the context is cut from the left to fit the block; a continuation
        # longer than the block cannot be scored whole, so it is refused (the harness's hf model asserts).
        limit = self.max_length + 1  # inputs of block_size tokens predict block_size targets
        rows = []
        for key, context_enc, continuation_enc in requests:
            if not continuation_enc:
                raise RdepthError("lm-eval request with an empty continuation")
            if len(continuation_enc) > self.max_length:
                context, continuation = key if isinstance(key, tuple) and len(key) == 2 else ("?", "?")
                raise RdepthError(f"lm-eval: a continuation of {len(continuation_enc)} tokens is longer than the "
                                  f"model's block size {self.max_length} (request: context "
                                  f"{_shorten(context)!r}, continuation {_shorten(continuation)!r}); "
                                  "the harness cannot score it whole")
            whole = (context_enc + continuation_enc)[-limit:]
            split = max(len(whole) - len(continuation_enc), 0)
            rows.append((whole[:split], whole[split:]))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]) - len(rows[i][1]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="rdepth loglikelihood"):
            chunk = order[start : start + self.batch_size]
            for index, result in zip(chunk, self._score([rows[i] for i in chunk]), strict=False):
                results[index] = result
                self.cache_hook.add_partial("loglikelihood", requests[index][0], result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        totals = []
        for request in tqdm(requests, disable=disable_tqdm, desc="rdepth rolling"):
            (text,) = request.args
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, 1)]
            total = 0.0
            for start in range(0, len(windows), self.batch_size):
                total += sum(score for score, _ in self._score(windows[start : start + self.batch_size]))
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, ``batch_size`` requests at a time through the continuous depth batching
        engine (each row at its own position and loop step; every request's tokens equal its decode alone,
        with the initial loop states of sequence 0), cut at the end-of-text token and the first stop string.
        With ``speculate``, the engine's loop speculation (the same texts; :attr:`speculation_counts` sums the
        rounds run and the drafts made and kept)."""
        from rdepth.engine import Engine, Request

        settings, made = [], []
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = min(int(gen_kwargs.get("max_gen_toks", 64)), self.max_length - 1)
            # the context cut from the left to leave room for the new tokens, as the harness's own models do
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.eot_token_id]
            made.append(Request(ids, max_tokens=max_new, stop=[self.eot_token_id], noise_seed=self.seed,
                                sequence_id=0, tag=index))
            settings.append((context, gen_kwargs, until))
        # each slot holds the longest request, not the whole context (Ouro's is 65,536 positions)
        capacity = min(self.max_length, max((len(r.prompt) + r.max_tokens for r in made), default=1))
        engine = Engine(self.model, self.batch_size, loop_counts=self.loop_counts, capacity=capacity,
                        **self.speculation)
        for request in made:
            engine.add_request(request)
        texts: dict[int, str] = {}
        stats = engine.stats
        with tqdm(total=len(settings), disable=disable_tqdm, desc="rdepth generate") as bar:
            for done in engine.run():
                if done.error is not None:
                    raise RdepthError(f"lm-eval generate_until: request {done.request.tag}: {done.error}")
                new = done.tokens[:-1] if done.finish_reason == "stop" else done.tokens
                text = self.tok_decode(new)
                for stop in settings[done.request.tag][2]:
                    if stop and stop in text:
                        text = text[: text.index(stop)]
                texts[done.request.tag] = text
                bar.update(1)
        for name in self.speculation_counts:
            self.speculation_counts[name] += getattr(stats, name)
        outputs = []
        for index, (context, gen_kwargs, _) in enumerate(settings):
            outputs.append(texts[index])
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), texts[index])
        return outputs


def _shorten(text: str, keep: int = 40) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"


def evaluate_budgets(checkpoint: str, tasks: list[str], budgets: list[str | None], include_path: str | None = None,
                     limit: int | None = None, batch_size: int = 8, seed: int = 0, device: str = "cpu",
                     bootstrap_iters: int = 1000, speculation: dict | None = None) -> dict:
    """Run ``tasks`` at each loop budget: ``{"budgets": [{"loops": [...], "results": {task: {metric: value}}}]}``.

    Each metric comes with its standard error, ``METRIC_stderr``, as the harness computes it: for a
    mean over examples (``acc``, ``acc_norm``, ``exact_match``) the standard error of the mean,
    ``sample std / sqrt(n)``; for other aggregations (perplexities, corpus scores) a bootstrap of
    ``bootstrap_iters`` resamples (0: no standard errors)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    lm = RdepthLM(checkpoint, seed=seed, batch_size=batch_size, device=device, **(speculation or {}))
    summary = {"checkpoint": str(checkpoint), "tasks": list(tasks), "limit": limit, "seed": seed,
               "bootstrap_iters": bootstrap_iters, "budgets": []}
    for budget in budgets or [None]:
        lm.loop_counts = parse_budget(budget, lm.model_config.n_groups) or lm.model_config.default_eval_loops
        lm.speculation_counts = dict.fromkeys(lm.speculation_counts, 0)
        try:
            output = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                     log_samples=False, bootstrap_iters=bootstrap_iters)
        except KeyError as exc:
            raise RdepthError(f"lm-eval: unknown task {exc} (is --include-path set?)") from None
        results = {task: {key.removesuffix(",none"): value for key, value in metrics.items()
                          if isinstance(value, (int, float)) and not isinstance(value, bool)}
                   for task, metrics in output["results"].items()}
        summary["budgets"].append({"loops": list(lm.loop_counts), "results": results})
        if speculation:
            summary["budgets"][-1]["speculation"] = dict(lm.speculation_counts)
    return summary


def main(argv: list[str] | None = None) -> None:
    """The harness's own command line, with the ``rdepth`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
