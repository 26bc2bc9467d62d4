"""Metric code, answer extraction, letter log-likelihood choice and batched (left-padded) scoring /
generation against brute-force references on tiny models."""
from __future__ import annotations

import pytest
import torch

from iprox_lightning.models.builtin import builtin_tokenizer
from iprox_lightning.evaluation.common import (
    continuation_tokens,
    greedy_generate,
    left_pad,
    next_token_logprobs,
    truncate_at_stop,
)
from iprox_lightning.evaluation.metrics import (
    ExactMatch,
    PerTaskAccuracy,
    PerTaskMean,
    SquadF1,
    bbh_exact_match,
    bbh_normalize,
    extract_bbh_answer,
    flatten_results,
    squad_exact_match,
    squad_f1,
    squad_normalize,
)
from iprox_lightning.evaluation.mmlu import choice_logprobs
from iprox_lightning.models.tiny import tiny_causal_lm


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


def bpe_tokenizer():
    """A tiny byte-level BPE (GPT-2 style) whose answer letters carry their leading space (" A")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [f"Question {i}?\nA. x\nB. y\nC. z\nD. w\nAnswer: {c}\n\n" for i in range(40) for c in "ABCD"]
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


# ------------------------------------------------------------------------- SQuAD / BBH strings
def test_squad_normalize_and_scores():
    assert squad_normalize("The  Cat, sat!") == "cat sat"
    assert squad_normalize("An apple and a pear.") == "apple and pear"
    assert squad_exact_match("the Home Box Office.", ["Home Box Office"]) == 100.0
    assert squad_exact_match("Home Box Office Inc", ["Home Box Office"]) == 0.0
    # P = 3/4, R = 3/3 -> F1 = 2 * 0.75 * 1 / 1.75
    assert squad_f1("Home Box Office Inc", ["Home Box Office"]) == pytest.approx(100 * 1.5 / 1.75)
    # max over gold answers; repeated tokens count with multiplicity (P = 1/2, R = 1)
    assert squad_f1("paris paris", ["London", "Paris"]) == pytest.approx(100 * 2 * 0.5 / 1.5)
    assert squad_f1("", ["Paris"]) == 0.0 and squad_f1("Rome", ["Paris"]) == 0.0


def test_squad_matches_torchmetrics_reference():
    from torchmetrics.functional.text import squad

    cases = [
        ("Home Box Office Inc", ["Home Box Office"]),
        ("the Kigali", ["Kigali", "Kigali city"]),
        ("in 1998 or so", ["1998"]),
        ("Jibu", ["jibu la swali"]),
        ("nothing", ["Paris"]),
        ("A. B. C.", ["a b c"]),
    ]
    preds = [{"prediction_text": p, "id": str(i)} for i, (p, _) in enumerate(cases)]
    target = [{"answers": {"answer_start": [0] * len(g), "text": g}, "id": str(i)} for i, (_, g) in enumerate(cases)]
    ref = squad(preds, target)
    ours_em = sum(squad_exact_match(p, g) for p, g in cases) / len(cases)
    ours_f1 = sum(squad_f1(p, g) for p, g in cases) / len(cases)
    assert ours_em == pytest.approx(float(ref["exact_match"]), abs=1e-4)
    assert ours_f1 == pytest.approx(float(ref["f1"]), abs=1e-4)


def test_bbh_answer_extraction_and_match():
    assert extract_bbh_answer("Let's think. A is True. So the answer is (B). Then more.") == "(B)"
    assert extract_bbh_answer(" So the answer is  False .") == "False"
    assert extract_bbh_answer("the answer is (C).") == "the answer is (C)."  # cue is case-sensitive "So"
    assert extract_bbh_answer("  Yes\n\nQ: next question") == "Yes"  # no cue: up to the first blank line
    assert extract_bbh_answer("So the answer is 12") == "So the answer is 12"  # no period after the cue
    assert bbh_exact_match("(a)", "(A)") == 100.0 and bbh_exact_match("Yes.", "yes") == 100.0
    assert bbh_exact_match("(A)", "(B)") == 0.0
    # HF exact_match keeps whitespace after dropping punctuation: "] ]" -> " " and "]]" -> ""
    assert bbh_normalize("] ]") == " " and bbh_exact_match("]]", "] ]") == 0.0
    assert truncate_at_stop("abc\n\ndef\nx", ["\n\n", "\nx"]) == "abc"


# ------------------------------------------------------------------------- torchmetrics
def test_per_task_mean_macro_micro_and_merge():
    m = PerTaskMean(["a", "b", "c"])
    m.update(torch.tensor([100.0, 0.0, 100.0]), ["a", "a", "b"])
    m.update([50.0], ["a"])
    out = m.compute()
    assert set(out) == {"a", "b", "macro", "micro"}  # "c" has no example
    assert float(out["a"]) == pytest.approx(50.0) and float(out["b"]) == 100.0
    assert float(out["macro"]) == pytest.approx(75.0) and float(out["micro"]) == pytest.approx(62.5)
    with pytest.raises(KeyError, match="unknown task 'd'"):
        m.update([1.0], ["d"])
    # two "ranks" merged == one metric that saw everything (sum reduction of the states)
    r0, r1 = PerTaskMean(["a", "b"]), PerTaskMean(["a", "b"])
    r0.update([100.0, 0.0], ["a", "b"])
    r1.update([0.0, 100.0, 100.0], ["a", "b", "b"])
    r0.merge_state(r1)
    merged = r0.compute()
    assert float(merged["a"]) == 50.0 and float(merged["b"]) == pytest.approx(200 / 3)
    assert flatten_results("s", "em", merged) == pytest.approx(
        {"s/em/a": 50.0, "s/em/b": 200 / 3, "s/em": (50 + 200 / 3) / 2, "s/em_micro": 60.0}
    )


def test_accuracy_exact_match_f1_metrics():
    acc = PerTaskAccuracy(["x", "y"])
    acc.update(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 0, 0]), ["x", "x", "y", "y"])
    out = acc.compute()
    assert (float(out["x"]), float(out["y"]), float(out["macro"])) == (100.0, 0.0, 50.0)

    em = ExactMatch(["t1", "t2"], normalization="bbh")
    em.update(["(A)", "true", "(c)"], ["(A)", "False", "(C)"], ["t1", "t1", "t2"])
    out = em.compute()
    assert (float(out["t1"]), float(out["t2"]), float(out["macro"])) == (50.0, 100.0, 75.0)

    golds = [["Kigali"], ["Home Box Office"], ["1998", "in 1998"]]
    preds = ["kigali.", "Home Box Office Inc", "in 1998"]
    tasks = ["finnish", "english", "english"]
    em = ExactMatch(["english", "finnish"])
    f1 = SquadF1(["english", "finnish"])
    em.update(preds, golds, tasks)
    f1.update(preds, golds, tasks)
    e, f = em.compute(), f1.compute()
    assert float(e["finnish"]) == 100.0 and float(e["english"]) == 50.0 and float(e["macro"]) == 75.0
    f_en = (100 * 1.5 / 1.75 + 100.0) / 2
    assert float(f["english"]) == pytest.approx(f_en) and float(f["macro"]) == pytest.approx((f_en + 100) / 2)


# ------------------------------------------------------------------------- answer-letter tokens
def test_continuation_tokens_char_and_bpe():
    char = builtin_tokenizer()  # " A" -> [" ", "A"]: the space is a shared prefix token
    prefix, letters = continuation_tokens(char, "Answer:", [" A", " B", " C", " D"])
    assert prefix == char.convert_tokens_to_ids([" "]) and letters == char.convert_tokens_to_ids(list("ABCD"))

    bpe = bpe_tokenizer()  # " A" is one token "ĠA"
    assert len(bpe(" A", add_special_tokens=False)["input_ids"]) == 1
    prefix, letters = continuation_tokens(bpe, "Answer:", [" A", " B", " C", " D"])
    assert prefix == [] and letters == bpe.convert_tokens_to_ids(["ĠA", "ĠB", "ĠC", "ĠD"])
    # in context the prompt + letter really tokenizes that way
    full = bpe("Question?\nAnswer: C", add_special_tokens=False)["input_ids"]
    assert full[-1] == letters[2]
    with pytest.raises(ValueError, match="expected the same number"):
        continuation_tokens(char, "Answer:", [" A", " AB"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_next_token_logprobs_left_padding_matches_unpadded(arch):
    tok = builtin_tokenizer()
    model = tiny_causal_lm(arch, vocab_size=len(tok), seed=3)
    prompts = ["Q: 1+1?\nAnswer:", "Longer question here?\nAnswer:", "x"]
    seqs = [tok(p)["input_ids"] for p in prompts]
    ids, mask = left_pad(seqs, tok.pad_token_id)
    assert ids.shape[1] == max(map(len, seqs)) and int(mask[2].sum()) == len(seqs[2])
    batched = next_token_logprobs(model, ids, mask)
    for i, s in enumerate(seqs):  # reference: each prompt alone, no padding, plain forward
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([s])).logits[0, -1].float(), -1)
        torch.testing.assert_close(batched[i], ref, atol=1e-5, rtol=1e-5)


def test_choice_logprobs_forced_letter_and_reference():
    tok = builtin_tokenizer()
    model = tiny_causal_lm("llama", vocab_size=len(tok), seed=1)
    prefix, letters = continuation_tokens(tok, "Answer:", [" A", " B", " C", " D"])
    seqs = [tok(p)["input_ids"] + prefix for p in ["Q?\nA. a\nB. b\nC. c\nD. d\nAnswer:", "2+2?\nAnswer:"]]
    ids, mask = left_pad(seqs, tok.pad_token_id)
    clp = choice_logprobs(model, ids, mask, letters)
    for i, s in enumerate(seqs):  # brute force: full-vocab log-softmax of the unpadded prompt, read at the letters
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([s])).logits[0, -1], -1)[letters]
        torch.testing.assert_close(clp[i], ref, atol=1e-5, rtol=1e-5)
    # force the model to prefer "C": every prediction becomes index 2 with probability ~1
    c_id = letters[2]

    def force(module, inputs, output):
        output = output.clone()
        output[..., c_id] += 50.0
        return output

    handle = model.lm_head.register_forward_hook(force)
    try:
        forced = choice_logprobs(model, ids, mask, letters)
    finally:
        handle.remove()
    assert forced.argmax(-1).tolist() == [2, 2]
    assert torch.softmax(forced, -1)[:, 2].min() > 0.999


# ------------------------------------------------------------------------- greedy generation
def _reference_greedy(model, tok, prompt_ids, max_new, eos):
    """Brute force: one prompt, no padding, no KV cache, argmax of a full forward per step."""
    seq = list(prompt_ids)
    out = []
    for _ in range(max_new):
        with torch.no_grad():
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        if nxt in eos:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_generate_matches_unpadded_reference(arch):
    tok = builtin_tokenizer()
    model = tiny_causal_lm(arch, vocab_size=len(tok), seed=7)
    prompts = ["Q: what is 2+3?\nA:", "Hi\nA:", "Name a colour.\nA:"]
    seqs = [tok(p)["input_ids"] for p in prompts]
    ids, mask = left_pad(seqs, tok.pad_token_id)
    eos = [tok.eos_token_id]
    refs = [_reference_greedy(model, tok, s, 12, eos) for s in seqs]
    texts, gen_ids = greedy_generate(model, tok, ids, mask, max_new_tokens=12)
    assert gen_ids == refs
    assert texts == [tok.decode(r, skip_special_tokens=True) for r in refs]
    # a stop string taken from row 0's reference text: row 0 is cut before its first occurrence
    ref0 = tok.decode(refs[0], skip_special_tokens=True)
    stop = ref0[3]
    texts_stop, _ = greedy_generate(model, tok, ids, mask, max_new_tokens=12, stop_strings=[stop])
    for t, r in zip(texts_stop, refs):
        full = tok.decode(r, skip_special_tokens=True)
        assert t == full[: full.find(stop)] if stop in full else t == full
    assert texts_stop[0] == ref0[: ref0.index(stop)]
