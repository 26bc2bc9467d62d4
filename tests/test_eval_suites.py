"""The three suites end to end (prompt formats, Lightning test/validate loops, logging, JSON) on
tiny models with hand-made data in the public formats, plus a small run on the shared files."""
from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer

from iprox_lightning.models.builtin import builtin_tokenizer
from iprox_lightning.evaluation import (
    EvalDataModule,
    EvaluationModule,
    MMLUConfig,
    TyDiQAConfig,
    squad_exact_match,
    squad_f1,
)
from iprox_lightning.evaluation import bbh as bbh_suite
from iprox_lightning.evaluation import mmlu as mmlu_suite
from iprox_lightning.evaluation import tydiqa as tydiqa_suite
from iprox_lightning.evaluation.common import continuation_tokens
from iprox_lightning.models.tiny import tiny_causal_lm


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def tiny(tok, seed=0, **kw):
    return tiny_causal_lm("llama", vocab_size=len(tok), seed=seed, max_position_embeddings=2048, **kw)


def trainer(tmp_path, **kw):
    base = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
                enable_progress_bar=False, default_root_dir=str(tmp_path))
    base.update(kw)
    return Trainer(**base)


# ----------------------------------------------------------------------------- hand-made data
MMLU_DEV = {"s_one": "Dev one?,a,b,c,d,B\nDev two?,e,f,g,h,D\n", "s_two": "Dev three?,1,2,3,4,A\nDev four?,5,6,7,8,C\n"}
MMLU_TEST = {"s_one": "T1?,a,b,c,d,C\nT2?,a,b,c,d,A\nT3?,a,b,c,d,C\n", "s_two": "T4?,1,2,3,4,B\nT5?,1,2,3,4,C\n"}
BBH = {
    "t1": [{"input": "q one", "target": "(A)"}, {"input": "q two", "target": "(B)"}, {"input": "q three", "target": "True"}],
    "t2": [{"input": "q four", "target": "No"}],
}
COT = "BENCHMARK DATA canary GUID x\n-----\nSolve {t}.\n\nQ: e1\nA: think. So the answer is (A).\n\nQ: e2\nA: think. So the answer is (B).\n\nQ: e3\nA: think. So the answer is (C).\n"
TYDI_EVAL = [
    ("english-1-0", "HBO is owned by Home Box Office, a unit of WarnerMedia.", "Who owns HBO?", ["Home Box Office"]),
    ("english-2-0", "The sky is blue on a clear day.", "What colour is the sky?", ["blue", "light blue"]),
    ("finnish-3-0", "Ruandan paakaupunki on Kigali.", "Mika on Ruandan paakaupunki?", ["Kigali"]),
]
TYDI_SHOTS = {
    "english": [{"id": "english-9-0", "lang": "english", "context": "Paris is in France.", "question": "Where is Paris?",
                 "answers": [{"text": "France", "answer_start": 12}]}],
    "finnish": [{"id": "finnish-9-0", "lang": "finnish", "context": "Helsinki on kaupunki.", "question": "Mika on Helsinki?",
                 "answers": [{"text": "kaupunki", "answer_start": 12}]}],
}


@pytest.fixture()
def data_dir(tmp_path):
    root = tmp_path / "eval"
    for split, files in (("dev", MMLU_DEV), ("test", MMLU_TEST)):
        (root / "mmlu" / split).mkdir(parents=True)
        for s, text in files.items():
            (root / "mmlu" / split / f"{s}_{split}.csv").write_text(text)
    (root / "bbh" / "cot-prompts").mkdir(parents=True)
    for t, exs in BBH.items():
        (root / "bbh" / f"{t}.json").write_text(json.dumps({"examples": exs}))
        (root / "bbh" / "cot-prompts" / f"{t}.txt").write_text(COT.format(t=t))
    (root / "tydiqa").mkdir()
    squad = {"data": [{"paragraphs": [{"context": c, "qas": [{"id": i, "question": q, "answers": [{"text": a, "answer_start": 0} for a in golds]}]}]}
                      for i, c, q, golds in TYDI_EVAL]}
    (root / "tydiqa" / "tydiqa-goldp-v1.1-dev.json").write_text(json.dumps(squad))
    (root / "tydiqa" / "tydiqa-one-shot.json").write_text(json.dumps(TYDI_SHOTS))
    return root


class ScriptedAnswers:
    """Forward hook making a tiny HF model "answer" scripted text: at the prefill call it finds,
    for each row, the question key occurring last in the prompt, then forces that key's response
    token by token (then EOS). Generation runs one forward per new token (KV cache)."""

    def __init__(self, model, tok, responses: dict[str, str]):
        self.tok, self.responses = tok, responses
        self.scripts: list[list[int]] = []
        self.step = 0
        self.handle = model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:  # prefill: the whole (left-padded) prompt
            self.step = 0
            self.scripts = []
            for row in ids.tolist():
                text = self.tok.decode(row, skip_special_tokens=True)
                key = max(self.responses, key=lambda k: text.rfind(k))
                assert text.rfind(key) >= 0, f"no scripted question in prompt ...{text[-80:]!r}"
                self.scripts.append(self.tok(self.responses[key], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
        logits = output.logits.clone()
        for r, script in enumerate(self.scripts):
            logits[r, -1] = -1e4
            logits[r, -1, script[min(self.step, len(script) - 1)]] = 1e4
        self.step += 1  # one forward per generated token after the prefill
        output.logits = logits
        return output


# ----------------------------------------------------------------------------- prompt formats
def test_mmlu_prompt_format_and_shot_reduction(data_dir, tok):
    from iprox_lightning.data.eval_readers import read_mmlu_csv

    dev = read_mmlu_csv(data_dir / "mmlu" / "dev" / "s_one_dev.csv")
    q = read_mmlu_csv(data_dir / "mmlu" / "test" / "s_one_test.csv")[0]
    assert mmlu_suite.mmlu_prompt("s_one", dev[:1], q) == (
        "The following are multiple choice questions (with answers) about  s one.\n\n"
        "Dev one?\nA. a\nB. b\nC. c\nD. d\nAnswer: B\n\n"
        "T1?\nA. a\nB. b\nC. c\nD. d\nAnswer:"
    )
    full = mmlu_suite.build(MMLUConfig(shots=2), tok, str(data_dir))
    space = tok.convert_tokens_to_ids(" ")
    r = next(r for r in full.records if r["id"] == "mmlu/s_one/test/0")
    # plain prompt: BOS + prompt + the shared " " token (letters are separate tokens here)
    assert r["input_ids"] == tok(mmlu_suite.mmlu_prompt("s_one", dev, q))["input_ids"] + [space]
    assert r["shots"] == 2 and r["answer"] == 2 and full.constants["choice_ids"] == tok.convert_tokens_to_ids(list("ABCD"))
    # a budget between the 1-shot and 2-shot lengths drops one shot (open-instruct's rule)
    one = len(tok(mmlu_suite.mmlu_prompt("s_one", dev[:1], q))["input_ids"]) + 1
    cut = mmlu_suite.build(MMLUConfig(shots=2, subjects=["s_one"], max_prompt_tokens=one), tok, str(data_dir))
    r = next(r for r in cut.records if r["id"] == "mmlu/s_one/test/0")
    assert r["shots"] == 1 and len(r["input_ids"]) == one


def test_bbh_and_tydiqa_prompt_formats(data_dir, tok):
    data = bbh_suite.build(bbh_suite.BBHConfig(tasks=["t2"]), tok, str(data_dir))
    expected = COT.format(t="t2").split("-----\n", 1)[1].strip() + "\n\nQ: q four\nA:"
    assert tok.decode(data.records[0]["input_ids"], skip_special_tokens=True) == expected
    no_cot = bbh_suite.strip_cot(COT.format(t="t2").split("-----\n", 1)[1])
    assert no_cot.startswith("Solve t2.\n\nQ: e1\nA: (A).\n\nQ: e2\nA: (B).")

    ty = tydiqa_suite.build(TyDiQAConfig(languages=["english"], chat_template=False), tok, str(data_dir))
    assert [r["shots"] for r in ty.records] == [1, 1]
    text = tok.decode(ty.records[0]["input_ids"], skip_special_tokens=True)
    assert text == (
        "Answer the following question based on the information in the given passage.\n\n"
        "Passage: Paris is in France.\nQuestion: Where is Paris?\nAnswer: France\n\n"
        "Passage: HBO is owned by Home Box Office, a unit of WarnerMedia.\nQuestion: Who owns HBO?\nAnswer:"
    )
    # chat template: the prompt is the user turn, the assistant turn starts with the answer label
    chat = tydiqa_suite.build(TyDiQAConfig(languages=["finnish"], chat_template=True), tok, str(data_dir))
    user, label = tydiqa_suite.tydiqa_prompt(
        tydiqa_suite.read_eval_file(data_dir / "tydiqa" / "tydiqa-goldp-v1.1-dev.json")[2],
        tydiqa_suite.read_tydiqa_one_shot(data_dir / "tydiqa" / "tydiqa-one-shot.json")["finnish"],
    )
    assert label == "Vastaus:"
    assert chat.records[0]["input_ids"] == tok(f"<s><|user|>\n{user}</s>\n<|assistant|>\nVastaus:", add_special_tokens=False)["input_ids"]
    # context cut to max_context_tokens (characters here), and the one-shot file as eval set: no self-demo
    short = tydiqa_suite.build(
        TyDiQAConfig(eval_file=str(data_dir / "tydiqa" / "tydiqa-one-shot.json"), max_context_tokens=5, chat_template=False), tok, str(data_dir)
    )
    assert [r["shots"] for r in short.records] == [0, 0]
    assert "Passage: Paris\nQuestion: Where is Paris?\nAnswer:" in tok.decode(short.records[0]["input_ids"])


def test_tydiqa_missing_goldp_file_message(tmp_path, tok):
    (tmp_path / "tydiqa").mkdir()
    with pytest.raises(FileNotFoundError, match="tydiqa-goldp-v1.1-dev.json is not shipped"):
        tydiqa_suite.build(TyDiQAConfig(), tok, str(tmp_path))


# ----------------------------------------------------------------------------- end to end
def test_mmlu_end_to_end_forced_letter(data_dir, tok, tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    model = tiny(tok)
    c_id = tok.convert_tokens_to_ids("C")
    model.lm_head.register_forward_hook(lambda m, i, o: o + 50.0 * torch.nn.functional.one_hot(torch.tensor(c_id), o.shape[-1]))
    module = EvaluationModule(model, tok)
    dm = EvalDataModule(data_dir=str(data_dir), suites=["mmlu"], batch_size=2, mmlu={"shots": 2})
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer(tmp_path, logger=logger).test(module, datamodule=dm)
    # expected: the share of questions whose answer is C (from the hand-made files)
    share = {s: 100 * [line.rsplit(",", 1)[1] for line in t.splitlines()].count("C") / len(t.splitlines()) for s, t in MMLU_TEST.items()}
    res = module.results["test"]
    assert res["mmlu/acc/s_one"] == pytest.approx(share["s_one"]) == pytest.approx(200 / 3)
    assert res["mmlu/acc/s_two"] == pytest.approx(share["s_two"]) == 50.0
    assert res["mmlu/acc"] == pytest.approx((200 / 3 + 50) / 2) and res["mmlu/acc_micro"] == pytest.approx(60.0)
    # JSON results and predictions next to the logger's files; TensorBoard got the scalars
    out = tmp_path / "tb" / "version_0" / "eval"
    summary = json.loads((out / "test_metrics.json").read_text())
    assert summary["metrics"] == pytest.approx(res) and summary["n_questions"] == {"mmlu": 5}
    preds = [json.loads(l) for l in (out / "test_predictions" / "mmlu.jsonl").read_text().splitlines()]
    assert {p["prediction"] for p in preds} == {"C"} and all(p["choice_probs"][2] > 0.999 for p in preds)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    ea.Reload()
    assert ea.Scalars("test/mmlu/acc")[0].value == pytest.approx(res["mmlu/acc"])


def test_mmlu_bpe_tokenizer_letter_with_leading_space(data_dir, tmp_path):
    """Byte-level BPE: " C" is one token; forcing it gives the same accuracies as above."""
    from test_eval_metrics import bpe_tokenizer

    bpe = bpe_tokenizer()
    prefix, letters = continuation_tokens(bpe, "Answer:", [" A", " B", " C", " D"])
    assert prefix == []
    model = tiny_causal_lm("gpt2", vocab_size=len(bpe), seed=0, max_position_embeddings=2048)
    model.lm_head.register_forward_hook(lambda m, i, o: o + 50.0 * torch.nn.functional.one_hot(torch.tensor(letters[2]), o.shape[-1]))
    module = EvaluationModule(model, bpe, output_dir=str(tmp_path / "out"))
    dm = EvalDataModule(data_dir=str(data_dir), suites=["mmlu"], batch_size=3, mmlu={"shots": 2})
    trainer(tmp_path).test(module, datamodule=dm)
    assert module.results["test"]["mmlu/acc_micro"] == pytest.approx(60.0)


def test_bbh_end_to_end_scripted(data_dir, tok, tmp_path):
    model = tiny(tok)
    ScriptedAnswers(model, tok, {
        "Q: q one": "Step. So the answer is (A).\n\nQ: junk after the blank line",
        "Q: q two": "So the answer is (C).",
        "Q: q three": "true\n\nmore",          # no cue: up to the blank line, case-insensitive match
        "Q: q four": "So the answer is No.",
    })
    module = EvaluationModule(model, tok, output_dir=str(tmp_path / "out"))
    dm = EvalDataModule(data_dir=str(data_dir), suites=["bbh"], batch_size=3, bbh={"max_new_tokens": 64})
    trainer(tmp_path).test(module, datamodule=dm)
    res = module.results["test"]
    assert res["bbh/em/t1"] == pytest.approx(200 / 3) and res["bbh/em/t2"] == 100.0
    assert res["bbh/em"] == pytest.approx((200 / 3 + 100) / 2) and res["bbh/em_micro"] == pytest.approx(75.0)
    preds = {p["id"]: p for p in map(json.loads, (tmp_path / "out" / "test_predictions" / "bbh.jsonl").read_text().splitlines())}
    assert preds["bbh/t1/0"]["output"] == "Step. So the answer is (A)."  # generation stopped at "\n\n"
    assert preds["bbh/t1/2"]["prediction"] == "true" and preds["bbh/t1/1"]["prediction"] == "(C)"


def test_bbh_max_new_tokens_cap(data_dir, tok, tmp_path):
    model = tiny(tok)
    ScriptedAnswers(model, tok, {f"Q: q {w}": "So the answer is (A)." for w in ("one", "two", "three", "four")})
    module = EvaluationModule(model, tok, output_dir=str(tmp_path / "out"))
    dm = EvalDataModule(data_dir=str(data_dir), suites=["bbh"], batch_size=4, bbh={"max_new_tokens": 6, "tasks": ["t1"]})
    trainer(tmp_path).test(module, datamodule=dm)
    preds = [json.loads(l) for l in (tmp_path / "out" / "test_predictions" / "bbh.jsonl").read_text().splitlines()]
    assert {p["output"] for p in preds} == {"So the"}  # 6 character tokens
    assert module.results["test"]["bbh/em"] == 0.0


def test_tydiqa_end_to_end_scripted_and_validate(data_dir, tok, tmp_path):
    model = tiny(tok)
    responses = {
        "Who owns HBO?": " Home Box Office Inc\nmore text",
        "What colour is the sky?": " Blue.",
        "Mika on Ruandan paakaupunki?": "Kigali",
    }
    ScriptedAnswers(model, tok, responses)
    module = EvaluationModule(model, tok, output_dir=str(tmp_path / "out"))
    dm = EvalDataModule(data_dir=str(data_dir), suites=["tydiqa"], batch_size=2)
    trainer(tmp_path).validate(module, datamodule=dm)
    res = module.results["val"]
    # brute-force expectation from the scripted answers and the gold answers
    exp = {}
    for (qid, _, q, golds) in TYDI_EVAL:
        pred = responses[q].split("\n")[0].strip()
        exp.setdefault(qid.split("-")[0], []).append((squad_exact_match(pred, golds), squad_f1(pred, golds)))
    for lang, scores in exp.items():
        assert res[f"tydiqa/em/{lang}"] == pytest.approx(sum(s[0] for s in scores) / len(scores))
        assert res[f"tydiqa/f1/{lang}"] == pytest.approx(sum(s[1] for s in scores) / len(scores))
    assert res["tydiqa/em/english"] == 50.0 and res["tydiqa/f1/english"] == pytest.approx((100 * 1.5 / 1.75 + 100) / 2)
    assert res["tydiqa/em"] == pytest.approx(75.0) and res["tydiqa/f1"] == pytest.approx(((100 * 1.5 / 1.75 + 100) / 2 + 100) / 2)
    summary = json.loads((tmp_path / "out" / "val_metrics.json").read_text())
    assert summary["stage"] == "val" and summary["suites"]["tydiqa"]["n_questions"] == 3


def test_all_suites_on_shared_files_tiny_model(eval_dir, tok, tmp_path):
    """The real public files flow through all three suites (tiny random model, small caps); the
    logged metrics equal the means recomputed from the written predictions."""
    module = EvaluationModule(tiny(tok, seed=5), tok, output_dir=str(tmp_path / "out"))
    dm = EvalDataModule(
        data_dir=str(eval_dir), batch_size=2,
        mmlu={"subjects": ["anatomy", "virology"], "max_per_subject": 2, "max_prompt_tokens": 400},
        bbh={"tasks": ["navigate"], "max_per_task": 2, "max_new_tokens": 4, "max_prompt_tokens": 400},
        tydiqa={"eval_file": str(eval_dir / "tydiqa" / "tydiqa-one-shot.json"), "languages": ["english", "swahili"],
                "max_new_tokens": 4, "max_context_tokens": 64},
    )
    trainer(tmp_path).test(module, datamodule=dm)
    res = module.results["test"]
    preds = {s: [json.loads(l) for l in (tmp_path / "out" / "test_predictions" / f"{s}.jsonl").read_text().splitlines()]
             for s in ("mmlu", "bbh", "tydiqa")}
    assert [len(preds[s]) for s in ("mmlu", "bbh", "tydiqa")] == [4, 2, 2]
    assert all(max(len(r["input_ids"]) for r in d.records) <= 400 for s, d in dm.suite_data.items() if s != "tydiqa")
    for subj in ("anatomy", "virology"):
        rows = [p for p in preds["mmlu"] if p["task"] == subj]
        assert res[f"mmlu/acc/{subj}"] == pytest.approx(100 * sum(p["correct"] for p in rows) / len(rows))
    assert res["bbh/em/navigate"] == pytest.approx(100 * sum(p["correct"] for p in preds["bbh"]) / 2)
    for p in preds["tydiqa"]:
        assert res[f"tydiqa/f1/{p['task']}"] == pytest.approx(squad_f1(p["prediction"], p["answers"]))


# ----------------------------------------------------------------------------- config plumbing
def test_jsonargparse_builds_the_data_module_and_module(data_dir):
    from jsonargparse import ArgumentParser

    p = ArgumentParser()
    p.add_class_arguments(EvalDataModule, "data")
    p.add_class_arguments(EvaluationModule, "model")
    cfg = p.parse_object({
        "data": {"data_dir": str(data_dir), "suites": ["mmlu", "tydiqa"], "batch_size": 2,
                 "mmlu": {"max_per_subject": 1, "shots": 1}, "tydiqa": {"shots": 0, "max_new_tokens": 8}},
        "model": {"model": "builtin", "dtype": "float32"},
    })
    init = p.instantiate_classes(cfg)
    dm, module = init.data, init.model
    assert isinstance(dm.configs["mmlu"], MMLUConfig) and dm.configs["mmlu"].max_per_subject == 1
    assert dm.configs["tydiqa"].shots == 0 and dm.configs["bbh"].max_per_task == 40  # defaults kept
    assert module.tokenizer is not None and module.model_name == "builtin"
    with pytest.raises(ValueError, match=r"unknown mmlu option\(s\) \['shot'\]"):
        EvalDataModule(mmlu={"shot": 1})
    with pytest.raises(ValueError, match=r"unknown suite\(s\) \['gsm'\]"):
        EvalDataModule(suites=["gsm"])
