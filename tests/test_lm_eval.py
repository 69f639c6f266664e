"""lm-eval's ``local-completions`` model against ``nb serve`` scores a small loglikelihood task as
lm-eval's own ``hf`` model does on the same random-weight checkpoint.

The task is made here: a few dozen multiple-choice questions of words the tiny tokenizer knows,
a JSONL file and a task YAML in the test's folder; nothing is downloaded. Each choice is one
loglikelihood request: through nb serve an ``echo`` + ``logprobs`` completion of the context and
the choice's tokens, whose prompt logprobs lm-eval sums over the choice.
"""

from __future__ import annotations

import importlib.util
import json
import random
import textwrap
from pathlib import Path

import pytest

from neuron_buckets.engine.llm_engine import LLMEngine
from tests.test_serve import MODEL, serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("serve"),
    pytest.mark.skipif(
        importlib.util.find_spec("lm_eval") is None,
        reason="lm-eval is not installed (pip install 'neuron-buckets[eval]'; make install has it)",
    ),
]
TASK = "nb_tiny_choice"
WORDS = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
EXAMPLES = 30


def write_task(folder: Path) -> Path:
    """A multiple-choice task of ``EXAMPLES`` seeded random questions, three choices each."""
    rng = random.Random(0)

    def phrase(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = [{"context": phrase(3, 8), "choices": [phrase(1, 4) for _ in range(3)], "label": rng.randrange(3)}
            for _ in range(EXAMPLES)]
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{TASK}.yaml").write_text(textwrap.dedent(f"""\
        task: {TASK}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data.as_posix()}
        test_split: test
        output_type: multiple_choice
        doc_to_text: context
        doc_to_choice: choices
        doc_to_target: label
        metric_list:
          - metric: acc
          - metric: acc_norm
        """))
    return folder


def evaluate(model: str, model_args: dict[str, object], tasks: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    return simple_evaluate(
        model=model, model_args=args, tasks=[TASK], task_manager=TaskManager(include_path=str(tasks)),
        batch_size=1, log_samples=True,
    )


def loglikelihoods(result: dict) -> list[list[float]]:
    """Each question's choices' loglikelihoods, in question order."""
    samples = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(ll) for ll, _ in s["filtered_resps"]] for s in samples]


def test_local_completions_against_nb_serve_scores_the_task_as_the_hf_model(
    text_model, text_artifact, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
               "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    for name, value in offline.items():
        monkeypatch.setenv(name, value)
    model_dir, tasks = text_model[0], write_task(tmp_path)
    # Both prepend the tokenizer's BOS, so the first scored token always has a context.
    hf_args = {"pretrained": model_dir, "dtype": "float32", "device": "cpu", "add_bos_token": True}
    hf = evaluate("hf", hf_args, tasks)
    with serving(LLMEngine.open(text_artifact)) as base:
        served = evaluate("local-completions", {
            "model": MODEL, "base_url": f"{base}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": model_dir, "tokenized_requests": True, "add_bos_token": True, "num_concurrent": 1,
            "max_retries": 1,
        }, tasks)
    ours, theirs = loglikelihoods(served), loglikelihoods(hf)
    assert len(ours) == EXAMPLES and all(len(choices) == 3 for choices in ours)
    for got, want in zip(ours, theirs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    scores, expected = served["results"][TASK], hf["results"][TASK]
    for metric in ("acc,none", "acc_norm,none"):
        assert scores[metric] == pytest.approx(expected[metric], abs=1e-4)
