"""SFT formatting (label masks, truncation), collation, splits and SFTDataModule."""
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from iprox_lightning.engine.batch import IGNORE_INDEX, check_batch, per_example_loss
from iprox_lightning.data.formatting import render_plain, tokenize_records, truncate
from iprox_lightning.data.sft import SFTCollator, SFTDataModule, read_validation_sets
from iprox_lightning.data.sources import write_records_jsonl
from iprox_lightning.data.splits import make_splits, sample_per_task, split_sizes
from iprox_lightning.data.synthetic import BUILTIN_VALIDATION_FAMILIES, oracle_share
from iprox_lightning.models.builtin import builtin_model, builtin_tokenizer

REC = {"id": "r1", "category": "sort", "instruction": "Sort.", "context": "b a", "response": "a b"}


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def chars(tok, text):
    """Reference tokenization of the character-level tokenizer: one id per character."""
    return tok.convert_tokens_to_ids(list(text))


def nl(tok):
    return tok.convert_tokens_to_ids("\n")


# ----------------------------------------------------------------------------- label masks
def test_chat_template_label_mask(tok):
    (ex,), dropped = tokenize_records([REC], tok, max_length=512)
    prompt = [1, 5, nl(tok)] + chars(tok, "Sort.\n\nb a") + [2, nl(tok), 6, nl(tok)]
    response = chars(tok, "a b") + [2, nl(tok)]
    assert dropped == []
    assert ex.input_ids.tolist() == prompt + response
    assert ex.prompt_len == len(prompt) == 17
    assert ex.labels.tolist() == [IGNORE_INDEX] * 17 + response
    assert ex.n_scored == 5 and (ex.id, ex.task) == ("r1", "sort")


def test_plain_template_label_mask(tok):
    prompt_text, response_text = render_plain(REC)
    assert prompt_text == "### Instruction:\nSort.\n\n### Input:\nb a\n\n### Response:\n"
    assert response_text == "a b"
    assert render_plain(dict(REC, context=""))[0] == "### Instruction:\nSort.\n\n### Response:\n"
    (ex,), _ = tokenize_records([REC], tok, prompt_template="plain")
    prompt = [1] + chars(tok, prompt_text)
    assert ex.input_ids.tolist() == prompt + chars(tok, "a b") + [2]
    assert ex.labels.tolist() == [IGNORE_INDEX] * len(prompt) + chars(tok, "a b") + [2]
    # 'auto' without a chat template falls back to the plain template
    tok2 = builtin_tokenizer()
    tok2.chat_template = None
    (ex2,), _ = tokenize_records([REC], tok2)
    assert torch.equal(ex2.input_ids, ex.input_ids) and ex2.prompt_len == ex.prompt_len
    with pytest.raises(ValueError, match="prompt_template='chat' but the tokenizer has no chat template"):
        tokenize_records([REC], tok2, prompt_template="chat")


def test_chat_messages_label_mask(tok):
    rec = {"id": "c", "category": "chat", "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "V"},
        {"role": "assistant", "content": "A2"}, {"role": "assistant", "content": "A3"}]}
    (ex,), _ = tokenize_records([rec], tok)
    n = nl(tok)
    prompt = [1, 4, n] + chars(tok, "S") + [2, n, 5, n] + chars(tok, "U") + [2, n, 6, n] + chars(tok, "A1") + [2, n] \
        + [5, n] + chars(tok, "V") + [2, n, 6, n]
    response = chars(tok, "A2") + [2, n, 6, n] + chars(tok, "A3") + [2, n]
    assert ex.input_ids.tolist() == prompt + response
    assert ex.labels.tolist() == [IGNORE_INDEX] * len(prompt) + response
    # plain rendering of the same conversation
    p, r = render_plain(rec)
    assert p == "### System:\nS\n\n### Instruction:\nU\n\n### Response:\nA1\n\n### Instruction:\nV\n\n### Response:\n"
    assert r == "A2\n\nA3"


def test_chatml_template_with_default_system_prompt(tok):
    """A ChatML-style template (like SmolLM2's) that injects a system turn: the boundary is still exact."""
    t = builtin_tokenizer()
    t.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ '<|system|>\nBe nice.</s>\n' }}{% endif %}"
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '</s>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
    (ex,), _ = tokenize_records([REC], t)
    n = nl(t)
    prompt = [4, n] + chars(t, "Be nice.") + [2, n, 5, n] + chars(t, "Sort.\n\nb a") + [2, n, 6, n]
    assert ex.input_ids.tolist() == prompt + chars(t, "a b") + [2, n]
    assert ex.prompt_len == len(prompt)

    t.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    with pytest.raises(ValueError, match="example 'r1': the chat template does not render the prompt"):
        tokenize_records([REC], t)


# ----------------------------------------------------------------------------- truncation
def test_truncate_rules():
    P, R = [1, 10, 11, 12, 13], [20, 21, 22]
    assert truncate(P, R, 8) == (P, R)
    assert truncate(P, R, 6) == ([11, 12, 13], R)  # prompt cut from the left
    assert truncate(P, R, 6, bos_id=1) == ([1, 12, 13], R)  # ... keeping a leading BOS
    assert truncate(P, R, 4, bos_id=1) == ([13], R)  # one prompt token left: BOS not kept
    assert truncate(P, R, 3, bos_id=1) == ([13], [20, 21])  # response cut from the right, >=1 prompt token
    assert truncate(P, R, 6, "right") == (P, [20])
    assert truncate(P, R, 4, "right") == ([1, 10, 11, 12], [])
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        truncate(P, R, 1)


def test_truncation_in_tokenize_and_drop_count(tok, caplog):
    (ex,), _ = tokenize_records([REC], tok, max_length=10)
    response = chars(tok, "a b") + [2, nl(tok)]
    assert ex.input_ids.tolist() == [1] + [2, nl(tok), 6, nl(tok)] + response  # BOS + prompt tail + response
    assert ex.labels.tolist() == [IGNORE_INDEX] * 5 + response

    long_prompt = dict(REC, id="long", context="x " * 30)
    kept, dropped = tokenize_records([REC, long_prompt], tok, max_length=30, truncation="right")
    assert [e.id for e in kept] == ["r1"] and dropped == ["long"]

    caplog.set_level(logging.INFO, logger="iprox_lightning.data.sft")
    dm = SFTDataModule(pool="builtin", validation=None, max_length=40, truncation="right", builtin_size=60)
    ds = dm.dataset("pool")
    untruncated, _ = tokenize_records(dm.pool_records, tok, max_length=10_000)
    n_drop = sum(e.prompt_len >= 40 for e in untruncated)  # right truncation leaves them no response token
    assert n_drop > 0
    assert dm.stats["pool"] == {"read": 60, "dropped": n_drop, "kept": 60 - n_drop, "tokens": sum(len(e.input_ids) for e in ds.examples)}
    assert f"split pool: read 60, dropped {n_drop} (no response token left after truncation to 40 tokens), kept {60 - n_drop}" in caplog.text
    with pytest.raises(ValueError, match="split 'pool': all 60 examples were dropped"):
        SFTDataModule(pool="builtin", validation=None, max_length=3, truncation="right", builtin_size=60).dataset("pool")


# ----------------------------------------------------------------------------- collation
def test_collator_padding_and_loss_matches_unpadded(tok):
    recs = [REC, dict(REC, id="r2", category="add", instruction="Add the numbers.", context="12+30", response="42"),
            dict(REC, id="r3", context="")]
    exs, _ = tokenize_records(recs, tok)
    items = [{"input_ids": e.input_ids, "prompt_len": e.prompt_len, "id": e.id, "task": e.task} for e in exs]
    batch = SFTCollator(pad_token_id=0, pad_to_multiple_of=8)(items)
    check_batch(batch)
    T = max(len(e.input_ids) for e in exs)
    assert batch["input_ids"].shape[1] == (T + 7) // 8 * 8
    assert batch["id"] == ["r1", "r2", "r3"] and batch["task"] == ["sort", "add", "sort"]
    for b, e in enumerate(exs):
        n = len(e.input_ids)
        assert batch["input_ids"][b, :n].tolist() == e.input_ids.tolist()
        assert (batch["input_ids"][b, n:] == 0).all() and (batch["labels"][b, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        assert batch["labels"][b, :n].tolist() == e.labels.tolist()
    # the padded batch gives every example the same loss as running it alone (brute force)
    model = builtin_model(0)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss, n_tok = per_example_loss(out.logits, batch["labels"])
        for b, e in enumerate(exs):
            single = model(input_ids=e.input_ids.long()[None]).logits
            ref, ref_n = per_example_loss(single, e.labels[None])
            assert n_tok[b] == ref_n[0] == e.n_scored
            torch.testing.assert_close(loss[b], ref[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(loss).all() and (loss > 0).all()


# ----------------------------------------------------------------------------- splits
def test_split_sizes_rounding():
    assert split_sizes(2000) == split_sizes(2000, 0.05, 0.01, 0.1)
    s = split_sizes(2000)
    assert (s.warmup, s.probe, s.align, s.construction) == (100, 2, 18, 20)
    s = split_sizes(16574)  # the shared pool: 828.7 -> 829, 165.74 -> 166, 16.6 -> 17
    assert (s.warmup, s.probe, s.align) == (829, 17, 149)
    s = split_sizes(10)  # minimum sizes: 1 warm-up, 2 construction (1 probe + 1 align)
    assert (s.warmup, s.probe, s.align) == (1, 1, 1)
    assert split_sizes(50, 0.0, 0.5, 0.5) == split_sizes(50, 0, 0.5, 0.5)
    s = split_sizes(50, 0.0, 0.5, 0.5)
    assert (s.warmup, s.probe, s.align) == (0, 13, 12)  # 12.5 rounds half up
    with pytest.raises(ValueError, match="pool of 2 examples is too small"):
        split_sizes(2)
    with pytest.raises(ValueError, match=r"probe_fraction must be in \(0, 1\]"):
        split_sizes(100, probe_fraction=0)


def test_splits_reproducible_and_disjoint():
    ids = [f"x-{i:04d}" for i in range(2000)]
    a, b = make_splits(ids, seed=3), make_splits(list(reversed(ids)), seed=3)
    assert a == b  # same seed -> same ids, whatever the read order
    c = make_splits(ids, seed=4)
    assert a.warmup != c.warmup and a.probe + a.align != c.probe + c.align
    assert (len(a.warmup), len(a.probe), len(a.align)) == (100, 2, 18)
    assert len(set(a.warmup) | set(a.probe) | set(a.align)) == 120  # pairwise disjoint
    assert set(a.warmup + a.construction) <= set(ids) and a.pool == ids
    with pytest.raises(ValueError, match="duplicate id 'x-0001'"):
        make_splits(ids[:3] + ["x-0001"])


def test_align_examples_sizes_the_alignment_split_and_keeps_the_probes():
    """``align_examples``: the alignment split has that many ids, the probe ids (so Stage 1) are unchanged, a smaller
    request's alignment ids come first in a larger one's, and the warm-up ids never move."""
    ids = [f"x-{i:05d}" for i in range(16574)]
    s = split_sizes(16574, align_examples=600)
    assert (s.warmup, s.probe, s.align, s.construction) == (829, 17, 600, 617)
    base, big = make_splits(ids, seed=0), make_splits(ids, seed=0, align_examples=600)
    assert big.warmup == base.warmup and big.probe == base.probe
    assert len(big.align) == 600 and big.align[:149] == base.align  # the default's 149 first
    assert len(set(big.warmup) | set(big.probe) | set(big.align)) == 829 + 17 + 600
    perm = np.random.default_rng(0).permutation(len(ids))  # brute force: the slice after warm-up and probes
    assert big.align == [sorted(ids)[i] for i in perm[829 + 17: 829 + 17 + 600]]
    fid = make_splits(ids, seed=0, align_examples=600, fidelity_examples=5)
    assert fid.align == big.align and fid.fidelity == [sorted(ids)[i] for i in perm[1446:1451]]
    assert split_sizes(16574, align_examples=149) == split_sizes(16574)
    with pytest.raises(ValueError, match="align_examples must be an int >= 1"):
        split_sizes(100, align_examples=0)
    with pytest.raises(ValueError, match=r"construction subset of 100 \(probe 1 \+ align 99\).*align_examples"):
        split_sizes(100, align_examples=99)
    dm = SFTDataModule(builtin_size=600, seed=5, construction_fraction=0.05, align_examples=40)
    plain = SFTDataModule(builtin_size=600, seed=5, construction_fraction=0.05)
    assert dm.splits.probe == plain.splits.probe and dm.splits.align[:27] == plain.splits.align
    assert len(dm.align_dataloader().dataset) == 40


def test_sample_per_task():
    ids = [f"{t}-{i}" for t in "abc" for i in range(10)]
    tasks = [i[0] for i in ids]
    s = sample_per_task(ids, tasks, 3, seed=0)
    assert list(s) == ["a", "b", "c"] and all(len(v) == 3 for v in s.values())
    assert all(all(i.startswith(t) for i in v) and v == sorted(v) for t, v in s.items())
    assert s == sample_per_task(ids[::-1], tasks[::-1], 3, seed=0)
    # a task's sample does not depend on the other tasks
    assert sample_per_task(ids[10:], tasks[10:], 3, seed=0)["b"] == s["b"]
    assert sample_per_task(ids, tasks, None) == {t: sorted(i for i in ids if i[0] == t) for t in "abc"}


# ----------------------------------------------------------------------------- data module
def _ids_and_rows(loader):
    out = {}
    for batch in loader:
        check_batch(batch)
        for b, i in enumerate(batch["id"]):
            n = int(batch["attention_mask"][b].sum())
            assert i not in out
            out[i] = (batch["input_ids"][b, :n].tolist(), batch["labels"][b, :n].tolist(), batch["task"][b])
    return out


def test_ids_survive_shuffle_and_workers():
    dm = SFTDataModule(pool="builtin", validation=None, builtin_size=120, batch_size=7, seed=1)
    ds = dm.dataset("pool")
    ref = {e.id: (e.input_ids.tolist(), e.labels.tolist(), e.task) for e in ds.examples}
    order1 = [i for b in dm.dataloader("pool", shuffle=True) for i in b["id"]]
    order2 = [i for b in dm.dataloader("pool", shuffle=True) for i in b["id"]]
    assert order1 == order2 != sorted(order1) and sorted(order1) == sorted(ref)
    assert _ids_and_rows(dm.dataloader("pool", shuffle=True)) == ref
    dm.num_workers = 2
    loader = dm.dataloader("pool", shuffle=True)
    assert loader.num_workers == 2
    assert _ids_and_rows(loader) == ref
    epoch2 = [i for b in loader for i in b["id"]]  # the same loader reshuffles every epoch
    assert epoch2 != order1 and sorted(epoch2) == sorted(order1)
    # a fresh loader with workers reproduces the seeded order of the single-process loader
    assert [i for b in dm.dataloader("pool", shuffle=True) for i in b["id"]] == order1


def test_datamodule_splits_and_oracle():
    dm = SFTDataModule(builtin_size=600, seed=5, val_per_task=3, construction_fraction=0.05)
    sp = dm.splits
    assert (len(sp.warmup), len(sp.probe), len(sp.align)) == (30, 3, 27)
    assert dm.ids("warmup") == sp.warmup and dm.ids("probe") == sp.probe and dm.ids("align") == sp.align
    assert dm.ids("construction") == sp.probe + sp.align
    assert set(dm.ids("pool")) == {r["id"] for r in dm.pool_records} and len(dm.ids("pool")) == 600
    again = SFTDataModule(builtin_size=600, seed=5, construction_fraction=0.05)
    assert again.splits == sp
    # validation: 3 per validation family, each with its task name
    assert dm.validation_tasks == list(BUILTIN_VALIDATION_FAMILIES)
    val = next(iter(dm.val_dataloader()))
    assert val["task"] == [f for f in BUILTIN_VALIDATION_FAMILIES for _ in range(3)]
    # oracle on the splits equals the brute-force share of validation-family categories
    cat = {r["id"]: r["category"] for r in dm.pool_records}
    for split in ("warmup", "pool"):
        ids = dm.ids(split)
        assert oracle_share(ids) == sum(cat[i] in BUILTIN_VALIDATION_FAMILIES for i in ids) / len(ids)
    assert oracle_share(dm.ids("pool")) == 200 / 600
    assert dm.train_dataloader().batch_size == 8 and len(dm.predict_dataloader().dataset) == 600
    assert len(dm.probe_dataloader().dataset) == 3 and len(dm.align_dataloader().dataset) == 27


def test_selected_split_and_validation_file(tmp_path):
    dm = SFTDataModule(builtin_size=60, validation=None)
    chosen = [r for r in dm.pool_records if r["category"] == "addition"][:5]
    path = write_records_jsonl(chosen, tmp_path / "selected.jsonl")
    dm2 = SFTDataModule(builtin_size=60, validation=None, train_split="selected", selected=str(path), batch_size=2)
    got = [i for b in dm2.train_dataloader() for i in b["id"]]
    assert sorted(got) == sorted(r["id"] for r in chosen)
    with pytest.raises(ValueError, match="train_split='selected' needs `selected`"):
        SFTDataModule(train_split="selected")

    val_rows = [{"id": f"v{t}{i}", "instruction": f"Q{i}", "response": "A", "category": t} for t in "xy" for i in range(5)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val_rows))
    groups = read_validation_sets(str(tmp_path / "val.jsonl"), per_task=2, seed=0)
    assert list(groups) == ["x", "y"] and [len(v) for v in groups.values()] == [2, 2]
    assert groups == read_validation_sets(str(tmp_path / "val.jsonl"), per_task=2, seed=0)
    dm3 = SFTDataModule(builtin_size=60, validation=str(tmp_path / "val.jsonl"), val_per_task=2)
    assert dm3.validation_tasks == ["x", "y"]
    assert dm3.ids("validation") == [r["id"] for g in groups.values() for r in g]


def test_logs_to_trainer_logger():
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((metrics, step)))
    dm = SFTDataModule(builtin_size=60, validation=None)
    dm.trainer = SimpleNamespace(logger=logger, is_global_zero=True)
    dm.setup("predict")
    assert logged == [({"data/pool_read": 60.0, "data/pool_dropped": 0.0, "data/pool_kept": 60.0,
                        "data/pool_tokens": float(dm.stats["pool"]["tokens"])}, 0)]


def test_jsonargparse_signature(tmp_path):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(SFTDataModule, "data")
    cfg = parser.parse_object({"data": {"pool": "builtin", "field_map": {"response": "output"}, "max_length": 128,
                                        "train_split": "warmup", "validation": None}})
    dm = parser.instantiate_classes(cfg).data
    assert isinstance(dm, SFTDataModule) and dm.max_length == 128 and dm.field_map == {"response": "output"}
    assert dm.hparams.train_split == "warmup"


@pytest.mark.slow
def test_real_pool_with_smollm_tokenizer(shared_dir, smollm_gguf):
    pool = shared_dir / "data" / "pool" / "instructions.jsonl"
    if not pool.exists():
        pytest.skip("shared pool not present")
    dm = SFTDataModule(pool=str(pool), validation=None, tokenizer=str(smollm_gguf), max_length=512, seed=0)
    recs = dm.pool_records
    assert len(recs) == sum(1 for line in open(pool) if line.strip())
    sp = dm.splits
    assert (len(sp.warmup), len(sp.probe), len(sp.align)) == tuple(
        getattr(split_sizes(len(recs)), k) for k in ("warmup", "probe", "align"))
    tok = dm.tokenizer
    by_id = {r["id"]: r for r in recs}
    n_full = 0
    for batch in dm.dataloader("warmup"):
        check_batch(batch)
        for b, i in enumerate(batch["id"]):
            ids, labels = batch["input_ids"][b], batch["labels"][b]
            resp = tok.decode(ids[labels != IGNORE_INDEX])
            prompt = tok.decode(ids[: int((labels == IGNORE_INDEX).long().argmin())])
            assert prompt.endswith("<|im_start|>assistant\n")
            if int(batch["attention_mask"][b].sum()) < 512:  # not truncated: exact response + end of turn
                assert resp == by_id[i]["response"] + "<|im_end|>\n"
                assert by_id[i]["instruction"] in prompt
                n_full += 1
    assert n_full > 0.9 * len(sp.warmup)


def test_trainer_fit_with_datamodule(tmp_path):
    """End to end in Lightning: fit + validate on the built-in data, data stats land in the logger."""
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from iprox_lightning.engine.batch import sft_loss

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = builtin_model(0)
            self.seen = []

        def training_step(self, batch, _):
            check_batch(batch)
            self.seen += batch["id"]
            loss = sft_loss(self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"])
            assert torch.isfinite(loss)
            return loss

        def validation_step(self, batch, _):
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            self.log("val_loss", sft_loss(logits, batch["labels"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = SFTDataModule(builtin_size=120, batch_size=4, train_split="warmup", warmup_fraction=0.1)
    module = LM()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=CSVLogger(tmp_path), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    assert sorted(module.seen) == sorted(dm.splits.warmup) and len(module.seen) == 12
    assert trainer.callback_metrics["val_loss"] > 0
    rows = list(csv.DictReader(open(trainer.logger.experiment.metrics_file_path)))
    got = {k: float(v) for row in rows for k, v in row.items() if k.startswith("data/") and v}
    assert got["data/warmup_read"] == 12 and got["data/warmup_dropped"] == 0
    assert got["data/validation_kept"] == 2 * 8


def test_eval_validation_sets_from_paper_suites(eval_dir):
    """LESS-style validation sets: MMLU dev shots, BBH CoT exemplars, TyDiQA one-shot exemplars."""
    from collections import Counter

    from iprox_lightning.data.eval_validation import eval_validation_records, parse_eval_source, split_cot_prompt

    recs = eval_validation_records(eval_dir)
    counts = Counter(r["category"] for r in recs)
    assert counts == {"mmlu": 57 * 5, "bbh": 27 * 3, "tydiqa": 9}
    assert all(r["response"].strip() and r["instruction"].strip() for r in recs)
    assert {r["response"] for r in recs if r["category"] == "mmlu"} <= set("ABCD")
    assert all("So the answer is" in r["response"] for r in recs if r["category"] == "bbh")
    assert parse_eval_source(f"eval:{eval_dir}:mmlu,bbh") == (str(eval_dir), ("mmlu", "bbh"))
    assert parse_eval_source(f"eval:{eval_dir}") == (str(eval_dir), ("mmlu", "bbh", "tydiqa"))
    assert parse_eval_source("data.jsonl") is None
    with pytest.raises(ValueError, match="no 'A: ' answer"):
        split_cot_prompt("header\n\nQ: a question without answer", "x.txt")

    dm = SFTDataModule(pool="builtin", validation=f"eval:{eval_dir}", val_per_task=4, builtin_size=60)
    tasks = Counter(r["category"] for r in dm.validation_records)
    assert tasks == {"mmlu": 4, "bbh": 4, "tydiqa": 4}
    assert dm.validation_tasks == ["mmlu", "bbh", "tydiqa"]


def test_batch_rows_picks_rows_of_tensors_and_lists_and_keeps_the_rest():
    from iprox_lightning.engine.batch import batch_rows

    ids = torch.arange(12).reshape(4, 3)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids + 100, "id": ("a", "b", "c", "d"),
             "task": ["t0", "t1", "t0", "t1"], "scalar": torch.tensor(7.0), "meta": {"k": 1}, "pair": [1, 2]}
    picked = batch_rows(batch, [3, 1])
    assert picked["input_ids"].tolist() == [[9, 10, 11], [3, 4, 5]] and picked["labels"].tolist() == [[109, 110, 111],
                                                                                                      [103, 104, 105]]
    assert picked["id"] == ["d", "b"] and picked["task"] == ["t1", "t1"]
    assert picked["scalar"] is batch["scalar"] and picked["meta"] is batch["meta"] and picked["pair"] == [1, 2]
    head = batch_rows(batch, slice(0, 2))
    assert head["input_ids"].tolist() == ids[:2].tolist() and head["id"] == ["a", "b"] and head["task"] == ["t0", "t1"]
    from iprox_lightning.scoring.features import slice_rows

    assert {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in slice_rows(batch, 3).items()} == \
        {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in batch_rows(batch, [0, 1, 2]).items()}


def _tiny_bbh(root):
    """A BBH folder of two tasks, each with its task file and a two-exemplar CoT prompt."""
    (root / "bbh" / "cot-prompts").mkdir(parents=True)
    answers = {"logic": ["(A)", "valid"], "sums": ["24", "1.5"]}
    for task, ans in answers.items():
        (root / "bbh" / f"{task}.json").write_text(json.dumps({"examples": [{"input": "q?", "target": ans[0]}]}))
        blocks = [f"Q: {task} question {j}\nA: Let's think step by step. It is {a}, so. So the answer is {a}."
                  for j, a in enumerate(ans)]
        (root / "bbh" / "cot-prompts" / f"{task}.txt").write_text(f"{task}: task description.\n\n" + "\n\n".join(blocks) + "\n")
    return answers


def test_bbh_direct_validation_form(tmp_path):
    """``bbh-direct``: BBH's exemplars with the final answer alone as the response (ids of their own, category
    ``bbh`` and the subtask kept), selectable by name in an ``eval:<dir>:<suites>`` source; a CoT without the
    answer cue is an error naming the file and the exemplar."""
    from iprox_lightning.data.eval_validation import (bbh_validation_records, direct_answer, eval_validation_records,
                                                      parse_eval_source)

    answers = _tiny_bbh(tmp_path)
    cot = eval_validation_records(tmp_path, ("bbh",))
    direct = eval_validation_records(tmp_path, ("bbh-direct",))
    assert [r["response"] for r in direct] == [a for task in sorted(answers) for a in answers[task]]
    assert [r["instruction"] for r in direct] == [r["instruction"] for r in cot]
    assert [(r["category"], r["subtask"]) for r in direct] == [(r["category"], r["subtask"]) for r in cot]
    assert [r["id"] for r in direct] == [r["id"].replace("val-bbh-", "val-bbh-direct-") for r in cot]
    assert all(r["response"].endswith("So the answer is " + d["response"] + ".") for r, d in zip(cot, direct))
    assert parse_eval_source(f"eval:{tmp_path}:mmlu,bbh-direct") == (str(tmp_path), ("mmlu", "bbh-direct"))
    with pytest.raises(ValueError, match="bbh-direct"):
        parse_eval_source(f"eval:{tmp_path}:bbh-cot")
    with pytest.raises(ValueError, match="form 'short'"):
        bbh_validation_records(tmp_path / "bbh", form="short")
    with pytest.raises(ValueError, match=r"x\.txt exemplar 2: exemplar answer has no 'So the answer is'"):
        direct_answer("Let's think. It is (B).", "x.txt exemplar 2")
    assert direct_answer("So the answer is 1.5.", "x") == "1.5" and direct_answer("So the answer is No", "x") == "No"
