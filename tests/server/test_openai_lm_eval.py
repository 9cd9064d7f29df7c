"""lm-evaluation-harness's loglikelihood (multiple-choice) task against the OpenAI plane, the way
researchers score a checkpoint: `local-completions` sends batches of token-id prompts with echo,
logprobs 1 and max_tokens 1, and tokenizes through the server's /tokenize and /tokenizer_info.
Its loglikelihoods must match lm-eval's own in-process Hugging Face backend on the same weights.

Skipped where lm-eval (`pip install "lm_eval[api]"`) is not installed; it is not a dependency.
"""

from __future__ import annotations

import json

import pytest
from serverutil import serve
from tolerance import SERVED_PATHS, assert_served_paths, gamma

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need it

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("What colour is the sky on a clear day?", ["green", "red", "blue", "yellow"], 2),
    ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Saturn", "Mars"], 3),
    ("What do bees make?", ["milk", "silk", "honey", "wax"], 2),
    ("What is frozen water called?", ["steam", "fog", "rain", "ice"], 3),
]


@pytest.fixture()
def task_dir(tmp_path):
    data = tmp_path / "mc.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in QUESTIONS)
    )
    (tmp_path / "trine_mc.yaml").write_text(
        "task: trine_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tmp_path


def test_lm_eval_loglikelihoods_through_the_server_equal_its_in_process_hf_backend(
    tiny_model_dir, tmp_path, task_dir, monkeypatch
):
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_dir))
    with serve(tiny_model_dir, tmp_path / "home") as srv:
        monkeypatch.setenv("OPENAI_API_KEY", srv.api_key)
        served = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(
                f"model=tiny-llama,base_url={srv.url}/v1/completions,tokenizer_backend=remote,"
                f"auth_token={srv.api_key},num_concurrent=1,max_retries=1,batch_size=8"
            ),
            tasks=["trine_mc"],
            task_manager=tasks,
            log_samples=True,
        )
    local = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tiny_model_dir},dtype=float32,device=cpu",
        tasks=["trine_mc"],
        task_manager=tasks,
        log_samples=True,
        batch_size=8,
    )

    def scores(r):
        return [resp[0] for s in r["samples"]["trine_mc"] for resp in s["resps"]]

    a, b = scores(served), scores(local)
    assert len(a) == len(b) == 4 * len(QUESTIONS)
    # (loglikelihood, is_greedy): trine's engine against transformers' fp32 forward, two paths of the
    # same math (tests/engine/test_model_parity.py bounds transformers against our fp64): each token's
    # logprob within SERVED_PATHS of its log-sum-exp, which on the random tiny model is its own size
    # (every logprob is near -log V), so a continuation's sum within that of its own size, plus
    # lm-eval's fp32 sum of at most 8 of them on the transformers side (gamma_8)
    for x, y in zip(a, b):
        assert_served_paths(x[0], y[0], rel=SERVED_PATHS + gamma(8))
    assert [x[1] for x in a] == [x[1] for x in b]
    assert served["results"]["trine_mc"]["acc,none"] == local["results"]["trine_mc"]["acc,none"]
