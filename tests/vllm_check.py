"""Runs exported folders in vLLM through rdepth's plugin and records what vLLM gave (no tests here).

``.vllm-venv/bin/python tests/vllm_check.py JOBS.json OUT.json`` (``tests/test_vllm_plugin.py`` runs it, with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process holds every engine in turn, a few seconds each after the first).
Each job of ``JOBS.json``: ``folder``, ``hf_overrides`` and either ``prompts`` (lists of token ids, sent as one
``generate`` call, greedy, ``max_tokens`` new tokens (past the end token), with each token's log-probability and the prompt's) or
``refused`` true (the launch must raise; its message is recorded). OUT.json: per job, ``tokens``, ``logprobs``
and ``prompt_logprobs`` per prompt (the first prompt token has none: ``null``), or ``error`` (the exception's
class and message).
"""

from __future__ import annotations

import gc
import json
import sys


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=job["folder"], dtype="float32", enforce_eager=True, max_model_len=job.get("max_model_len", 64),
                  max_num_seqs=16, kv_cache_memory_bytes=64 << 20, hf_overrides=job.get("hf_overrides") or {},
                  seed=0, distributed_executor_backend="uni")
    except Exception as exc:  # a refusal: what the launch raised
        return {"error": [type(exc).__name__, str(exc)]}
    if job.get("refused"):
        return {"error": None}
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], logprobs=0, prompt_logprobs=0,
                            ignore_eos=True)  # (rdepth's decode runs to max_tokens)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    result = {"tokens": [], "logprobs": [], "prompt_logprobs": []}
    for ids, output in zip(job["prompts"], outputs, strict=True):
        choice = output.outputs[0]
        result["tokens"].append(list(choice.token_ids))
        result["logprobs"].append([step[token].logprob for step, token in zip(choice.logprobs, choice.token_ids,
                                                                                strict=True)])
        result["prompt_logprobs"].append([None if step is None else step[token].logprob
                                          for step, token in zip(output.prompt_logprobs, ids, strict=True)])
    del llm
    gc.collect()
    return result


if __name__ == "__main__":  # (vLLM may start processes that import this file)
    with open(sys.argv[1]) as handle:
        jobs = json.load(handle)
    results = [run_job(job) for job in jobs]
    with open(sys.argv[2], "w") as handle:
        json.dump(results, handle)
