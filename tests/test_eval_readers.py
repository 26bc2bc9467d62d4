"""Evaluation data readers: the shared public files (when present) and hand-made bad files."""
from __future__ import annotations

import csv
import json

import pytest

from iprox_lightning.data.eval_readers import (
    EvalDataError,
    list_bbh_tasks,
    list_mmlu_subjects,
    read_bbh,
    read_bbh_cot_prompt,
    read_bbh_task,
    read_mmlu,
    read_mmlu_csv,
    read_tydiqa_goldp,
    read_tydiqa_one_shot,
    sample_per_group,
)


# ----------------------------------------------------------------------------- shared files
def test_mmlu_shared_files(eval_dir):
    root = eval_dir / "mmlu"
    subjects = list_mmlu_subjects(root)
    assert len(subjects) == 57 and subjects == sorted(subjects)
    dev = read_mmlu(root, split="dev")
    assert sum(len(v) for v in dev.values()) == 285 and all(len(v) == 5 for v in dev.values())
    test = read_mmlu(root, ["abstract_algebra", "virology"])
    # compare with a plain csv read of the same file (row count, first row, answer letter)
    with open(root / "test" / "abstract_algebra_test.csv", newline="") as f:
        rows = list(csv.reader(f))
    q0 = test["abstract_algebra"][0]
    assert len(test["abstract_algebra"]) == len(rows)
    assert (q0.question, list(q0.choices), q0.answer_letter) == (rows[0][0], rows[0][1:5], rows[0][5])
    assert q0.id == "mmlu/abstract_algebra/test/0"


def test_mmlu_all_test_rows(eval_dir):
    test = read_mmlu(eval_dir / "mmlu")
    assert sum(len(v) for v in test.values()) == 14042


def test_bbh_shared_files(eval_dir):
    root = eval_dir / "bbh"
    tasks = list_bbh_tasks(root)
    assert len(tasks) == 27
    data = read_bbh(root)
    assert sum(len(ex) for _, ex in data.values()) == 6511
    counts = {t: len(ex) for t, (_, ex) in data.items()}
    assert counts["causal_judgement"] == 187 and counts["penguins_in_a_table"] == 146 and counts["snarks"] == 178
    prompt, examples = data["boolean_expressions"]
    assert prompt.startswith("Evaluate the result of a random Boolean expression.\n\nQ: ")
    assert "canary" not in prompt and prompt.count("So the answer is") == 3
    raw = json.loads((root / "boolean_expressions.json").read_text())["examples"]
    assert (examples[5].input, examples[5].target) == (raw[5]["input"], raw[5]["target"])
    # the TAGCOS bbh-three-shot.json holds the same prompts as cot-prompts/*.txt minus the header
    three_shot = json.loads((root / "bbh-three-shot.json").read_text())
    assert all(three_shot[t] == data[t][0] for t in tasks)


def test_tydiqa_one_shot_shared_file(eval_dir):
    d = read_tydiqa_one_shot(eval_dir / "tydiqa" / "tydiqa-one-shot.json")
    assert sorted(d) == sorted(
        ["finnish", "telugu", "russian", "arabic", "indonesian", "english", "swahili", "korean", "bengali"]
    )
    en = d["english"][0]
    assert en.question == "Who owns HBO?" and en.answers == ("Home Box Office",)
    # answer_start points at the answer inside the gold passage
    for exs in d.values():
        for ex in exs:
            s = ex.answer_starts[0]
            assert ex.context[s: s + len(ex.answers[0])] == ex.answers[0]


# ----------------------------------------------------------------------------- hand-made files
def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_mmlu_bad_rows(tmp_path):
    good = 'What is 1+1?,1,2,3,4,B\n"Comma, in question",a,b,c,d,D\n'
    qs = read_mmlu_csv(_write(tmp_path / "math_test.csv", good))
    assert [q.subject for q in qs] == ["math", "math"] and [q.answer for q in qs] == [1, 3]
    assert qs[1].question == "Comma, in question"
    with pytest.raises(EvalDataError, match=r"bad_test\.csv, row 2: expected 6 columns .* got 5"):
        read_mmlu_csv(_write(tmp_path / "bad_test.csv", "q,1,2,3,4,A\nq,1,2,3,A\n"))
    with pytest.raises(EvalDataError, match=r"ans_test\.csv, row 1: field 'answer' \(column 6\) .* got 'E'"):
        read_mmlu_csv(_write(tmp_path / "ans_test.csv", "q,1,2,3,4,E\n"))
    with pytest.raises(EvalDataError, match=r"empty_test\.csv, row 1: field 'question'"):
        read_mmlu_csv(_write(tmp_path / "empty_test.csv", " ,1,2,3,4,A\n"))
    with pytest.raises(FileNotFoundError, match="missing_test.csv"):
        read_mmlu_csv(tmp_path / "missing_test.csv")
    (tmp_path / "root" / "test").mkdir(parents=True)
    _write(tmp_path / "root" / "test" / "math_test.csv", good)
    with pytest.raises(EvalDataError, match=r"unknown MMLU subject\(s\) \['physics'\]"):
        read_mmlu(tmp_path / "root", ["physics"])


def test_bbh_bad_files(tmp_path):
    with pytest.raises(EvalDataError, match=r"t1\.json, examples\[1\]: missing field 'target'"):
        read_bbh_task(_write(tmp_path / "t1.json", json.dumps({"examples": [{"input": "a", "target": "b"}, {"input": "c"}]})))
    with pytest.raises(EvalDataError, match=r"t2\.json, examples\[0\]: field 'input' must be a non-empty string"):
        read_bbh_task(_write(tmp_path / "t2.json", json.dumps({"examples": [{"input": 3, "target": "b"}]})))
    with pytest.raises(EvalDataError, match=r"t3\.json: invalid JSON at line 1"):
        read_bbh_task(_write(tmp_path / "t3.json", "{examples: ["))
    with pytest.raises(EvalDataError, match=r"t4\.json: expected a JSON object with an 'examples' list"):
        read_bbh_task(_write(tmp_path / "t4.json", "[]"))
    with pytest.raises(EvalDataError, match=r"p\.txt: a CoT prompt must contain 'So the answer is'"):
        read_bbh_cot_prompt(_write(tmp_path / "p.txt", "canary line\n-----\nQ: x\nA: y.\n"))
    text = "BENCHMARK canary GUID\n-----\nDo it.\n\nQ: x\nA: y. So the answer is z.\n"
    assert read_bbh_cot_prompt(_write(tmp_path / "ok.txt", text)) == "Do it.\n\nQ: x\nA: y. So the answer is z.\n"


def _squad(qas, context="Kigali is the capital."):
    return {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}


def test_tydiqa_goldp_reader(tmp_path):
    qas = [
        {"id": "english-1-0", "question": "What is the capital?", "answers": [{"answer_start": 0, "text": "Kigali"}]},
        {"id": "finnish-2-0", "question": "Mikä?", "answers": [{"answer_start": 0, "text": "Kigali"}, {"answer_start": 0, "text": "Kigali city"}]},
    ]
    exs = read_tydiqa_goldp(_write(tmp_path / "dev.json", json.dumps(_squad(qas))))
    assert [(e.id, e.lang, e.answers) for e in exs] == [
        ("english-1-0", "english", ("Kigali",)),
        ("finnish-2-0", "finnish", ("Kigali", "Kigali city")),
    ]
    assert exs[0].context == "Kigali is the capital."

    bad = [{"id": "english-1-0", "question": "q", "answers": []}]
    with pytest.raises(EvalDataError, match=r"bad\.json, data\[0\]\.paragraphs\[0\]\.qas\[0\]: field 'answers'"):
        read_tydiqa_goldp(_write(tmp_path / "bad.json", json.dumps(_squad(bad))))
    bad = [{"id": "english-1-0", "answers": [{"text": "x", "answer_start": 0}]}]
    with pytest.raises(EvalDataError, match=r"qas\[0\]: missing field 'question'"):
        read_tydiqa_goldp(_write(tmp_path / "bad2.json", json.dumps(_squad(bad))))
    bad = [{"id": "english-1-0", "question": "q", "answers": [{"text": "x", "answer_start": "0"}]}]
    with pytest.raises(EvalDataError, match=r"answers\[0\]\.answer_start must be an integer"):
        read_tydiqa_goldp(_write(tmp_path / "bad3.json", json.dumps(_squad(bad))))
    with pytest.raises(EvalDataError, match=r"paragraphs\[0\]: field 'context' must be a non-empty string"):
        read_tydiqa_goldp(_write(tmp_path / "bad4.json", json.dumps(_squad(qas, context=""))))
    with pytest.raises(EvalDataError, match=r"duplicate question id 'english-1-0'"):
        read_tydiqa_goldp(_write(tmp_path / "dup.json", json.dumps(_squad([qas[0], qas[0]]))))
    with pytest.raises(EvalDataError, match=r"nodata\.json: expected a SQuAD-format object with a 'data' list"):
        read_tydiqa_goldp(_write(tmp_path / "nodata.json", json.dumps({"english": []})))


def test_tydiqa_one_shot_bad(tmp_path):
    ex = {"id": "english-1", "lang": "finnish", "context": "c", "question": "q", "answers": [{"text": "a", "answer_start": 0}]}
    with pytest.raises(EvalDataError, match=r"os\.json, \['english'\]\[0\]: field 'lang' is 'finnish'"):
        read_tydiqa_one_shot(_write(tmp_path / "os.json", json.dumps({"english": [ex]})))
    ex = {"id": "english-1", "context": "c", "question": "q", "answers": [{"answer_start": 0}]}
    with pytest.raises(EvalDataError, match=r"\['english'\]\[0\]: answers\[0\] must be an object with a 'text' field"):
        read_tydiqa_one_shot(_write(tmp_path / "os2.json", json.dumps({"english": [ex]})))


def test_sample_per_group_reproducible():
    items = list(range(100))
    a = sample_per_group(items, 10, 42, "math")
    assert a == sample_per_group(items, 10, 42, "math")  # same seed and group -> same sample
    assert a == sorted(a) and len(set(a)) == 10  # original order, no duplicates
    assert a != sample_per_group(items, 10, 42, "physics")  # groups draw independently
    assert sample_per_group(items, None, 0, "x") == items and sample_per_group(items, 500, 0, "x") == items
