"""Acceptance: lm-eval's ``local-completions`` against a live ``octavo serve`` scores
a local multiple-choice task (tests/data/lm_eval, no download) exactly as lm-eval's
own ``hf`` backend does on the same checkpoint, with prompts sent as token ids
(``tokenized_requests=true``) and as text (``false``), in float32."""
from __future__ import annotations

import pytest

from tests.server.conftest import API_KEY, REPO


TASK_DIR = REPO / "tests" / "data" / "lm_eval"
TASK = "octavo_tiny_choice"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Nothing may reach a hub: the task's dataset is a local JSON file, the tokenizer a local folder."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer key
    monkeypatch.chdir(REPO)  # the task's data_files path is relative to the repository


def _loglikelihoods(model: str, model_args: dict) -> list[float]:
    """Every (document, choice) loglikelihood lm-eval computed, in document order."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # include_defaults=False: indexing lm-eval's thousands of bundled task files takes seconds.
    results = simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        log_samples=True, bootstrap_iters=0, random_seed=0,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == 4
    return [float(loglikelihood) for s in samples for loglikelihood, _is_greedy in s["filtered_resps"]]


@pytest.fixture(scope="module")
def hf_scores(model_path):
    return _loglikelihoods("hf", {"pretrained": str(model_path), "dtype": "float32", "device": "cpu",
                                  "add_bos_token": True, "batch_size": 4})


@pytest.mark.parametrize("tokenized", [True, False])
def test_local_completions_match_the_hf_backend(server, model_path, hf_scores, tokenized):
    # add_bos_token: the model's BOS in front of every request, as Llama
    # models are scored; as text, the server sees it and adds no second one.
    scores = _loglikelihoods("local-completions", {
        "base_url": f"{server.url}/v1/completions", "model": "tiny", "tokenizer": str(model_path),
        "tokenizer_backend": "huggingface", "tokenized_requests": tokenized, "add_bos_token": True,
        "num_concurrent": 4, "max_retries": 1,
    })
    assert len(scores) == len(hf_scores) == 12
    assert scores == pytest.approx(hf_scores, abs=1e-4)
