"""The built-in demo data, tokenizer and tiny model (iprox_lightning/data/synthetic.py, iprox_lightning/models/builtin.py)."""
import collections
import re

import pytest
import torch

from iprox_lightning.data.synthetic import (
    BUILTIN_FAMILIES,
    BUILTIN_VALIDATION_FAMILIES,
    builtin_family,
    builtin_validation,
    generate_builtin_dataset,
    oracle_share,
)
from iprox_lightning.models.builtin import BUILTIN_ALPHABET, builtin_model, builtin_tokenizer


def _check_response(r):
    """Recompute the answer of a built-in example from its instruction/context (brute force)."""
    fam, ctx = r["category"], r["context"]
    if fam == "addition":
        a, b = ctx.split("+")
        return str(int(a) + int(b))
    if fam == "reverse":
        return " ".join(ctx.split(" ")[::-1])
    if fam == "sort":
        return " ".join(sorted(ctx.split(" ")))
    if fam == "uppercase":
        return ctx.upper()
    if fam == "lookup":
        key = re.search(r"(?:What is|Look up) ([a-z])", r["instruction"]).group(1)
        return dict(kv.split("=") for kv in ctx.split(" "))[key]
    if fam == "count":
        return str(len(ctx.split(" ")))
    raise AssertionError(fam)


def test_tokenizer_ids_and_roundtrip():
    tok = builtin_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 7 + len(BUILTIN_ALPHABET) < 200
    assert tok.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [4, 5, 6]
    # character level: 'a' is the first character after the 7 special tokens
    assert tok("ab").input_ids == [1, 7, 8]
    assert tok("ab", add_special_tokens=False).input_ids == [7, 8]
    assert tok("aé", add_special_tokens=False).input_ids == [7, 3]
    ids = tok(BUILTIN_ALPHABET, add_special_tokens=False).input_ids
    assert ids == list(range(7, 7 + len(BUILTIN_ALPHABET)))
    assert tok.decode(ids) == BUILTIN_ALPHABET
    # deterministic: same vocabulary every build
    assert builtin_tokenizer().get_vocab() == tok.get_vocab()


def test_tokenizer_chat_template():
    tok = builtin_tokenizer()
    msgs = [{"role": "user", "content": "Sort the list.\n\nc a"}, {"role": "assistant", "content": "a c"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<s><|user|>\nSort the list.\n\nc a</s>\n<|assistant|>\na c</s>\n"
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|user|>\nSort the list.\n\nc a</s>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[:3] == [1, 5, tok.convert_tokens_to_ids("\n")]
    assert ids[-2:] == [2, tok.convert_tokens_to_ids("\n")]
    assert len(ids) == len(text) - len("<s><|user|></s><|assistant|></s>") + 5


def test_builtin_model():
    tok = builtin_tokenizer()
    m0, m0b, m1 = builtin_model(0), builtin_model(0), builtin_model(1)
    assert type(m0).__name__ == "LlamaForCausalLM"
    assert m0.config.vocab_size == len(tok)
    assert (m0.config.hidden_size, m0.config.intermediate_size) == (64, 128)
    assert (m0.config.pad_token_id, m0.config.bos_token_id, m0.config.eos_token_id) == (0, 1, 2)
    sd0, sd0b, sd1 = m0.state_dict(), m0b.state_dict(), m1.state_dict()
    assert all(torch.equal(sd0[k], sd0b[k]) for k in sd0)
    assert not torch.equal(sd0["model.layers.0.self_attn.q_proj.weight"], sd1["model.layers.0.self_attn.q_proj.weight"])
    assert builtin_model(0, num_layers=3).config.num_hidden_layers == 3
    x = torch.tensor([tok("Add the numbers.\n\n1+2").input_ids])
    assert m0(input_ids=x).logits.shape == (1, x.shape[1], len(tok))


def test_dataset_content_and_determinism():
    ds = generate_builtin_dataset(600, seed=3)
    assert ds == generate_builtin_dataset(600, seed=3)
    assert ds != generate_builtin_dataset(600, seed=4)
    assert len(ds) == 600 and len({r["id"] for r in ds}) == 600
    counts = collections.Counter(r["category"] for r in ds)
    assert counts == {f: 100 for f in BUILTIN_FAMILIES}
    for r in ds:
        assert set(r) == {"id", "instruction", "context", "response", "category"}
        assert re.fullmatch(rf"builtin-{r['category']}-\d{{5}}", r["id"])
        assert builtin_family(r["id"]) == r["category"]
        assert _check_response(r) == r["response"], r
    # per-family indices are exactly 0..99
    for f in BUILTIN_FAMILIES:
        idx = sorted(int(r["id"].rsplit("-", 1)[1]) for r in ds if r["category"] == f)
        assert idx == list(range(100))
    # the first n examples of a bigger data set have the same ids' family layout (round robin)
    assert collections.Counter(r["category"] for r in generate_builtin_dataset(7)) == {
        "addition": 2, "reverse": 1, "sort": 1, "uppercase": 1, "lookup": 1, "count": 1}


def test_sequences_are_short():
    tok = builtin_tokenizer()
    lengths = []
    for r in generate_builtin_dataset(300) + builtin_validation(20):
        msgs = [{"role": "user", "content": r["instruction"] + "\n\n" + r["context"]},
                {"role": "assistant", "content": r["response"]}]
        lengths.append(len(tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids))
    assert max(lengths) <= 64


def test_validation_and_oracle():
    val = builtin_validation(5, seed=0)
    assert [r["id"] for r in val] == [f"builtin-val-{f}-{i:05d}" for f in BUILTIN_VALIDATION_FAMILIES for i in range(5)]
    assert {r["category"] for r in val} == set(BUILTIN_VALIDATION_FAMILIES)
    assert all(_check_response(r) == r["response"] for r in val)
    assert val == builtin_validation(5, seed=0) and val != builtin_validation(5, seed=1)
    with pytest.raises(ValueError, match="unknown families"):
        builtin_validation(2, families=["nope"])

    pool = generate_builtin_dataset(2000)
    ids = [r["id"] for r in pool]
    # 2000 = 6 * 333 + 2 -> addition and reverse get 334, the others 333
    assert oracle_share(ids) == pytest.approx((334 + 333) / 2000)
    assert oracle_share([i for i in ids if i.startswith("builtin-addition-")]) == 1.0
    assert oracle_share(["builtin-sort-00001", "builtin-uppercase-00002", "builtin-count-00003", "builtin-lookup-00000"]) == 0.25
    assert oracle_share(["builtin-sort-00001", "builtin-lookup-00002"], families=["sort"]) == 0.5
    with pytest.raises(ValueError, match="not a built-in example id"):
        oracle_share(["gsm8k-train-00000"])
    with pytest.raises(ValueError, match="no selected ids"):
        oracle_share([])
