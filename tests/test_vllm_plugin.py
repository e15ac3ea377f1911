"""rdepth's vLLM plugin (rdepth/vllm): exported folders served by vLLM give rdepth's fixed-budget decode.

vLLM runs in its own venv, ``.vllm-venv`` (``python tests/vllm_venv.py`` builds it; ``.ci/run`` does): each
test module starts one Python there (``tests/vllm_check.py``), which holds one vLLM engine after another, one
per (folder, loop budget). Without the venv every test here is skipped. The tiny models have head_dim 32, the
smallest vLLM's CPU attention takes.

The families: every block (sandwich, gpt2, peri), loop state (sandwich, residual, looplm), position kind
(learned, rotary over adjacent pairs and over halves), head (tied, untied), random and zero initial states, the
hand-off norm, and
single-pass layers before, between and after several looped groups; each at two budgets, mixed-length prompts
in one ``generate`` call: greedy tokens identical to rdepth's own batch-1 decode, and log-probabilities (the
prompt's and the generated tokens') within 1e-5 of rdepth's at the same budget and initial states.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import vllm_venv

from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise

pytest.importorskip("transformers")

from test_hf_helpers import tiny_run  # noqa: E402

HERE = Path(__file__).resolve().parent
VENV = vllm_venv.venv_dir()
PYTHON = vllm_venv.python_of(VENV)
NEW = 8  # tokens generated per prompt
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [12, 200, 7, 99, 3], [300] * 17]
TOLERANCE = 1e-5  # log-probabilities, float32 (vLLM's attention sums in another order than torch's SDPA)

# name -> (ModelConfig fields, two budgets, the export's state seed)
FAMILIES = {
    # sandwich blocks and loop state, learned positions, tied head, random initial state, the final norm on each
    # hand-off (Huginn-0125's); single-pass layers 0 (before), 2 (between) and 5 (after) around two groups
    "sandwich": (dict(block="sandwich", loop_state="sandwich", groups="1|3-4", n_layer=6, handoff_norm=True),
                 ((2, 3), (4, 1)), 0),
    # GPT-2 blocks, residual loop state, rotary over adjacent pairs, query/key bias, an untied head; three groups;
    # the state seed 7
    "gpt2_residual": (dict(block="gpt2", loop_state="residual", positions="rotary", qk_bias=True, tie_head=False,
                           groups="1|2-3|4", n_layer=6, init_state_scale=0.5), ((1, 2, 3), (3, 1, 2)), 7),
    # Ouro's: peri blocks, looplm (zero state, the loop reading its input), rotate-half, SwiGLU, untied head
    "peri_looplm": (dict(block="peri", loop_state="looplm", positions="rotary", rope_pairs="half", mlp="swiglu",
                         tie_head=False, init_state_scale=0.0, groups="1-3", n_layer=4), ((2,), (4,)), 0),
}


def _ready() -> bool:
    return vllm_venv.ready(VENV)


def skip_without_venv():
    if not _ready():
        pytest.skip(f"no vLLM venv at {VENV} (python tests/vllm_venv.py builds it; .ci/run does)")


def _family_run(root: Path, name: str):
    return tiny_run(root / f"run-{name}", n_head=2, d_model=64, **FAMILIES[name][0])


def _export(run: Path, out: Path, state_seed: int = 0) -> Path:
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run

    return export_run(ExportConfig(checkpoint=str(run), out=str(out), state_seed=state_seed))


def expected_decode(model, counts, seed: int = 0) -> dict:
    """rdepth's fixed-budget decode of each prompt alone (sequence 0's initial states, ``seed``): greedy tokens,
    their log-probabilities, and the prompt tokens' (teacher-forced: what the cached decode computes)."""
    tokens, logprobs, prompt_logprobs = [], [], []
    with torch.no_grad():
        for ids in PROMPTS:
            full = generate(model, torch.tensor([ids]), NEW, temperature=0, loop_counts=counts,
                            noise=StateNoise(seed, [0]))
            scores = model(full, loop_counts=counts, noise=StateNoise(seed, [0])).logits[0].log_softmax(-1)
            picked = scores[:-1].gather(1, full[0, 1:, None])[:, 0].tolist()  # position t predicts token t + 1
            tokens.append(full[0, len(ids):].tolist())
            prompt_logprobs.append([None] + picked[:len(ids) - 1])
            logprobs.append(picked[len(ids) - 1:])
    return {"tokens": tokens, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}


def _venv_env(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_MODULES_CACHE": str(root / "modules"), "VLLM_CACHE_ROOT": str(root / "vllm-cache")}


def _with_config(folder: Path, out: Path, **changes) -> Path:
    """A copy of an exported ``folder`` whose ``config.json`` has ``changes``."""
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every family exported and run in vLLM at both budgets, and the refused folders launched, in one Python of
    the venv; with rdepth's own decode of the same prompts."""
    skip_without_venv()
    root = tmp_path_factory.mktemp("vllm")
    jobs, expected, folders = [], [], {}
    for name, (_, budgets, seed) in FAMILIES.items():
        run, model = _family_run(root, name)
        folders[name] = _export(run, root / f"hf-{name}", state_seed=seed)
        for counts in budgets:
            jobs.append({"folder": str(folders[name]), "hf_overrides": {"loop_counts": list(counts)},
                         "prompts": PROMPTS, "max_tokens": NEW})
            expected.append((name, counts, expected_decode(model.eval(), counts, seed)))
    base = folders["sandwich"]
    refused = {
        "exit_policy": _with_config(base, root / "hf-exit", exit_policy={"name": "acceleration", "tau": 1e-3,
                                                                           "k_max": 8}),
        "block": _with_config(base, root / "hf-block", block="mamba"),
        "head_dim": _export(tiny_run(root / "run-narrow", n_head=2, d_model=32, groups="1", n_layer=2)[0],
                            root / "hf-narrow"),
        "loop_counts": base,
    }
    for key, folder in refused.items():
        overrides = {"loop_counts": [1, 2, 3]} if key == "loop_counts" else {}
        jobs.append({"folder": str(folder), "hf_overrides": overrides, "refused": True})
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([str(PYTHON), str(HERE / "vllm_check.py"), str(root / "jobs.json"), str(root / "out.json")],
                          env=_venv_env(root), capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((root / "out.json").read_text())
    return {"root": root, "folders": folders, "refused": refused, "expected": expected,
            "results": results[:len(expected)], "refusals": dict(zip(refused, results[len(expected):], strict=True))}


def check_close(got: list, want: list, what: str) -> float:
    """Per prompt, every value within :data:`TOLERANCE` (``None`` where rdepth has none); returns the largest gap."""
    worst = 0.0
    for row, (a, b) in enumerate(zip(got, want, strict=True)):
        assert len(a) == len(b), (what, row)
        for x, y in zip(a, b, strict=True):
            if y is None:
                assert x is None, (what, row)
                continue
            worst = max(worst, abs(x - y))
    assert worst <= TOLERANCE, f"{what}: largest gap {worst:.2e}"
    return worst


@pytest.mark.parametrize("index", range(sum(len(family[1]) for family in FAMILIES.values())))
@pytest.mark.vllm
def test_family_equals_rdepths_fixed_budget_decode(served, index):
    name, counts, want = served["expected"][index]
    got = served["results"][index]
    assert "error" not in got, got
    assert got["tokens"] == want["tokens"], (name, counts)
    gaps = (check_close(got["logprobs"], want["logprobs"], f"{name} {counts} generated"),
            check_close(got["prompt_logprobs"], want["prompt_logprobs"], f"{name} {counts} prompt"))
    print(f"{name} at {counts}: largest log-probability gap {max(gaps):.1e}")


@pytest.mark.vllm
def test_budgets_differ(served):
    """The launch's loop_counts reach the model: the two budgets of a family give different log-probabilities."""
    results = served["results"]
    start = 0
    for _, budgets, _ in FAMILIES.values():
        assert results[start]["prompt_logprobs"] != results[start + 1]["prompt_logprobs"]
        start += len(budgets)


@pytest.mark.vllm
@pytest.mark.parametrize(("key", "names"), [
    ("exit_policy", ["exit policy 'acceleration'", "exit_policy"]),
    ("block", ["block must be one of", "'mamba'"]),
    ("head_dim", ["head_dim 16", "32"]),
    ("loop_counts", ["3 values for 2 recurrence groups"]),
])
def test_refusals_name_the_problem(served, key, names):
    kind, message = served["refusals"][key]["error"]
    assert kind == "RdepthError" and "\n" not in message and message.startswith("rdepth vllm plugin: ")
    for text in names:
        assert text in message


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server(folder: Path, root: Path, overrides: dict, port: int) -> subprocess.Popen:
    command = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
               "--kv-cache-memory-bytes", str(64 << 20), "--hf-overrides", json.dumps(overrides)]
    env = {**_venv_env(root), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)


@pytest.mark.vllm
def test_openai_server_answers_with_the_same_tokens(served):
    """vLLM's OpenAI server with the plugin: the ``openai`` client's completion of the mixed-length prompts (one
    request) has rdepth's greedy tokens and log-probabilities."""
    openai = pytest.importorskip("openai")
    name, counts, want = served["expected"][0]
    port = _free_port()
    server = _server(served["folders"][name], served["root"], {"loop_counts": list(counts)}, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stdout.read()[-4000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not start in 240 s"
                time.sleep(1)
        answer = client.completions.create(model=str(served["folders"][name]), prompt=PROMPTS, max_tokens=NEW,
                                           temperature=0, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    choices = sorted(answer.choices, key=lambda choice: choice.index)
    tokens = [[int(text.split(":")[1]) for text in choice.logprobs.tokens] for choice in choices]
    assert tokens == want["tokens"]
    check_close([choice.logprobs.token_logprobs for choice in choices], want["logprobs"], "server")


@pytest.mark.vllm
def test_refused_launch_prints_one_line(served):
    """The server launched on an export that names an exit policy stops before any engine starts, with the
    refusal's one line on stderr and no traceback."""
    root = served["root"]
    command = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(served["refused"]["exit_policy"]),
               "--dtype", "float32", "--port", str(_free_port())]
    done = subprocess.run(command, env=_venv_env(root), capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rdepth vllm plugin: this export names the exit policy 'acceleration'"), last


def _exported_config(**changes):
    """An exported folder's config (the tiny preset with two groups and head_dim 32), with ``changes``."""
    from rdepth.config import get_preset
    from rdepth.interop.export import export_config_dict
    from rdepth.interop.hf_config import RdepthConfig

    model_config = get_preset("tiny", n_head=2, d_model=64, groups="1|3-4", n_layer=6)
    return RdepthConfig(**{**export_config_dict(model_config, None, 0, eot_id=0), **changes})


def test_refusal_reads_the_exported_config():
    """Without vLLM: what the plugin serves (a fixed budget, the export's or the launch's) and each refusal's line,
    before any engine starts (the plugin's launch check runs this)."""
    from rdepth.vllm.support import model_config_of, refusal, served_loop_counts

    config = _exported_config()
    assert refusal(config, [32, 64]) is None and refusal(config) is None
    model_config = model_config_of(config)
    assert served_loop_counts(config, model_config) == (4, 4)  # the tiny preset's round(mean_loops)
    assert served_loop_counts(_exported_config(loop_counts="2:5"), model_config) == (2, 5)
    assert served_loop_counts(_exported_config(loop_counts=3), model_config) == (3, 3)
    assert "head_dim 32" in refusal(config, [64, 128])
    assert "'mamba'" in refusal(_exported_config(block="mamba"))
    assert "3 values for 2 recurrence groups" in refusal(_exported_config(loop_counts=[1, 2, 3]))
    line = refusal(_exported_config(exit_policy={"name": "step_norm", "tau": 1.0, "k_max": 4}))
    assert line.startswith("rdepth vllm plugin: this export names the exit policy 'step_norm'") and "\n" not in line
