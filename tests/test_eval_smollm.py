"""The three suites on the real SmolLM2-135M-Instruct (GGUF) with small caps (slow: --runslow)."""
from __future__ import annotations

import json
import time

import pytest
from lightning.pytorch import Trainer

import torch

from iprox_lightning.evaluation import EvalDataModule, EvaluationModule, squad_f1


@pytest.fixture()
def one_thread():
    """On a shared 2-core machine, one intra-op thread avoids OpenMP spin-waiting against other jobs
    (measured here: 2 threads made this run > 5x slower under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
def test_smollm_three_suites_small_caps(smollm_gguf, eval_dir, tmp_path, one_thread):
    module = EvaluationModule(str(smollm_gguf), output_dir=str(tmp_path / "out"))
    dm = EvalDataModule(
        data_dir=str(eval_dir),
        batch_size=4,
        mmlu={"subjects": ["high_school_geography", "marketing"], "max_per_subject": 5},
        bbh={"tasks": ["boolean_expressions", "sports_understanding"], "max_per_task": 3, "max_new_tokens": 64},
        # the 9 one-shot exemplars as a tiny eval set (each is then evaluated without a demo)
        tydiqa={"eval_file": str(eval_dir / "tydiqa" / "tydiqa-one-shot.json")},
    )
    t0 = time.time()
    Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False).test(
        module, datamodule=dm
    )
    res = module.results["test"]
    print(f"\nSmolLM2-135M eval ({time.time() - t0:.0f} s):", json.dumps({k: round(v, 2) for k, v in res.items()}))
    preds = {s: [json.loads(l) for l in (tmp_path / "out" / "test_predictions" / f"{s}.jsonl").read_text().splitlines()]
             for s in ("mmlu", "bbh", "tydiqa")}
    assert [len(preds[s]) for s in ("mmlu", "bbh", "tydiqa")] == [10, 6, 9]

    # MMLU: the letter tokens are the ones the model expects after "Answer:" — they carry most of
    # the next-token probability mass (a wrong letter-token mapping would put ~0 there)
    mass = sum(p["letter_mass"] for p in preds["mmlu"]) / 10
    assert mass > 0.5, f"mean probability mass on ' A'..' D' is only {mass:.3f}"
    assert 0.0 <= res["mmlu/acc"] <= 100.0 and all(p["shots"] == 5 for p in preds["mmlu"])

    # BBH: greedy CoT generations that follow the 3-shot format
    assert all(p["output"].strip() for p in preds["bbh"])
    assert sum("So the answer is" in p["output"] for p in preds["bbh"]) >= 2

    # TyDiQA: the English passage states the answer; the model extracts (part of) it
    en = next(p for p in preds["tydiqa"] if p["task"] == "english")
    assert squad_f1(en["prediction"], en["answers"]) > 0.0
    assert res["tydiqa/f1"] >= res["tydiqa/em"]
