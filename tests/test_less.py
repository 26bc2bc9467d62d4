"""LESS (issue 66): the Adam-preconditioned training gradient from a checkpoint's saved optimiser state against a real
``torch.optim.AdamW`` step and a hand-computed update, SGD validation gradients, and its optimiser-state file."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from iprox_lightning.engine.batch import per_example_loss
from iprox_lightning.errors import InputNotFoundError, UserInputError
from iprox_lightning.io.optimizer_state import adam_state_of, read_adam_state, save_adam_state
from iprox_lightning.scoring import influence_scores
from iprox_lightning.scoring.config import ScoringConfig

from test_lora_scoring import adapted_model
from test_scoring_influence import BATCHING_ATOL, TRAIN, VAL, batches, collate

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread

BETAS, EPS = (0.9, 0.99), 1e-6  # not AdamW's defaults: the file's must be the ones used


def trained(steps=3, seed=0):
    """A LoRA-adapted tiny float64 model after ``steps`` AdamW steps on the training examples, and its optimiser."""
    model = adapted_model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.0)
    for s in range(steps):
        b = collate(TRAIN[3 * s:3 * s + 3])
        loss, _ = per_example_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                   b["labels"])
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return model.eval(), opt


def example_grad(model, ex) -> dict[str, torch.Tensor]:
    """The autograd gradient of ``L(z)`` over the trained (adapter) parameters, by name."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    ids = ex["input_ids"][None]
    loss, _ = per_example_loss(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ex["labels"][None])
    return dict(zip(names, torch.autograd.grad(loss.sum(), params)))


def adamw_step_direction(model, opt, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``-(θ' − θ) / lr`` of one real AdamW step (weight decay 0) from a copy of the checkpoint's optimiser state with
    the example's gradient: Adam's own update direction ``m̂ / (√v̂ + ε)``."""
    named = dict(model.named_parameters())
    params = {n: named[n].detach().clone().requires_grad_(True) for n in grads}
    step = torch.optim.AdamW(list(params.values()), lr=1.0, betas=BETAS, eps=EPS, weight_decay=0.0)
    for n, p in params.items():
        st = copy.deepcopy(opt.state[named[n]])
        step.state[p] = st
        p.grad = grads[n].clone()
    before = {n: p.detach().clone() for n, p in params.items()}
    step.step()
    return {n: before[n] - p.detach() for n, p in params.items()}


def less_repo_direction(model, opt, grads):
    """princeton-nlp/LESS's ``obtain_gradients_with_adam``, written out: ``m' / √(v' + ε)``, no bias correction."""
    named = dict(model.named_parameters())
    out = {}
    for n, g in grads.items():
        st = opt.state[named[n]]
        m1 = BETAS[0] * st["exp_avg"] + (1 - BETAS[0]) * g
        v1 = BETAS[1] * st["exp_avg_sq"] + (1 - BETAS[1]) * g * g
        out[n] = m1 / torch.sqrt(v1 + EPS)
    return out


def reference(model, opt, direction):
    """LESS scores by brute force: cos(Γ(g(z)), ḡ_T) per validation task T, and against the mean of every task."""
    flat = lambda d: torch.cat([t.reshape(-1) for t in d.values()])  # noqa: E731
    train = [flat(direction(model, opt, example_grad(model, e))) if (e["labels"][1:] != -100).any() else None
             for e in TRAIN]
    val = [flat(example_grad(model, e)) for e in VAL]
    tasks = sorted({e["task"] for e in VAL})
    vt = {t: sum(v for v, e in zip(val, VAL) if e["task"] == t) for t in tasks}
    vall = sum(val)
    cos = lambda a, b: 0.0 if a is None else float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    return np.array([cos(g, vall) for g in train]), np.array([[cos(g, vt[t]) for t in tasks] for g in train])


@pytest.mark.parametrize("adam", ["paper", "less_repo"])
def test_less_scores_equal_the_adam_update_from_the_saved_moments(tmp_path, adam):
    model, opt = trained()
    path = save_adam_state(tmp_path / "optimizer_state.safetensors",
                           adam_state_of(dict(model.named_parameters()), opt))
    state = read_adam_state(tmp_path)
    assert state.betas == BETAS and state.eps == EPS and set(state.step.values()) == {3}
    metric = ScoringConfig(method="less", options={"adam": adam}).build_metric().use_optimizer_state(state)
    table = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), metric=metric, progress=False)
    want, want_t = reference(model, opt, adamw_step_direction if adam == "paper" else less_repo_direction)
    # float64; batched and padded against one example at a time (BATCHING_ATOL, of the largest |score|)
    np.testing.assert_allclose(table.scores, want, rtol=0, atol=BATCHING_ATOL)
    np.testing.assert_allclose(table.task_scores, want_t, rtol=0, atol=BATCHING_ATOL)
    assert table.settings["method"] == "less" and table.settings["adam"] == adam
    # not TracIn: the preconditioning changes the scores
    sgd = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), progress=False)
    assert np.abs(sgd.scores - table.scores).max() > 1e-2
    assert path.name == "optimizer_state.safetensors"


def test_a_missing_or_foreign_optimizer_state_is_refused(tmp_path):
    model, opt = trained(steps=1)
    with pytest.raises(InputNotFoundError, match="no Adam optimizer state"):
        read_adam_state(tmp_path)
    with pytest.raises(UserInputError, match="method less needs the checkpoint's Adam optimizer state"):
        influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), method="less", progress=False)
    state = adam_state_of({f"other.{n}": p for n, p in model.named_parameters()}, opt)
    metric = ScoringConfig(method="less").build_metric().use_optimizer_state(state)
    with pytest.raises(UserInputError, match="holds no Adam moments for 'base_model"):
        influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), metric=metric, progress=False)
    with pytest.raises(UserInputError, match="options.adam of method less must be one of"):
        ScoringConfig(method="less", options={"adam": "sgd"}).build_metric()


# ------------------------------------------------------------------------------------------------- the commands
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
DEMO_DATA = {"builtin_size": 120, "max_length": 64, "batch_size": 16}


def guide_commands() -> list[list[str]]:
    """The arguments of the GUIDE's "Reproduce LESS on the demo" commands, as written: the tests below run them
    (with a smaller pool, fewer epochs and their outputs in a temporary directory given after them)."""
    import re
    import shlex

    from test_readme import GUIDE, bash_commands, doc_section

    (block,) = re.findall(r"```bash\n(.*?)```", doc_section(GUIDE, "## LoRA: adapter gradients and LESS"), re.S)
    cmds = [shlex.split(c) for c in bash_commands(block)]
    assert [c[:3] for c in cmds] == [["python", "train.py", s] for s in ("fit", "predict", "select")]
    return [[str(ROOT / a) if a.startswith("configs/") else a for a in c[2:]] for c in cmds]


@pytest.fixture(scope="module")
def less_warmup(tmp_path_factory):
    """``configs/less/warmup.yaml`` on the demo (2 epochs here, r 8, a small pool): the LoRA warm-up's directory."""
    from iprox_lightning.cli import main

    root = tmp_path_factory.mktemp("less")
    main([*guide_commands()[0], "--trainer.max_epochs", "2",
          "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
          str(root), "--model.init_args.save_dir", str(root / "warmup"),
          "--model.init_args.lora", '{"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}',
          *[a for k, v in DEMO_DATA.items() for a in (f"--data.init_args.{k}", str(v))]])
    return root / "warmup"


def _score(tmp_path, name, warm, trainer=None, callbacks=(), **init_args):
    """``configs/less/score.yaml`` (with ``init_args`` over it, ``trainer`` over its trainer and ``callbacks`` after
    its writer) on the demo: the score table."""
    import yaml

    from iprox_lightning.cli import main
    from iprox_lightning.scoring.influence import ScoreTable

    out = tmp_path / name
    cfg = {"trainer": {**(trainer or {}), "logger": False, "enable_progress_bar": False, "default_root_dir": str(tmp_path), "callbacks": [
        {"class_path": "iprox_lightning.scoring.InfluenceWriter", "init_args": {"output_dir": str(out)}}, *callbacks]},
        "model": {"init_args": init_args}, "data": {"init_args": {"tokenizer": str(warm), **DEMO_DATA}}}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    main([*guide_commands()[1], "--config", str(tmp_path / f"{name}.yaml")])
    return ScoreTable.load(str(out))


def test_less_checkpoint_sum_equals_each_checkpoint_scored_alone_and_summed(less_warmup, tmp_path):
    """``--model.checkpoints`` (configs/less/score.yaml): the LESS scores summed over the warm-up's checkpoints with
    the epochs' mean learning rates equal each checkpoint scored on its own (``--model.model``) and summed with those
    weights; then ``select --rule max`` selects from the table."""
    from iprox_lightning.cli import main
    from iprox_lightning.io.optimizer_state import read_adam_state

    ckpts = [less_warmup / "adapters" / f"epoch_{e}" for e in (1, 2)]
    lrs = [read_adam_state(c).lr for c in ckpts]
    assert lrs[0] != lrs[1] and all(lr > 0 for lr in lrs)  # the linear schedule: each epoch its own mean
    both = _score(tmp_path, "both", less_warmup, checkpoints=[{"path": str(c)} for c in ckpts])
    alone = [_score(tmp_path, f"alone{j}", less_warmup, checkpoints=None, model=str(c)) for j, c in enumerate(ckpts)]
    assert both.ids == alone[0].ids == alone[1].ids and len(both) == 120 and len(both.task_names) > 1
    recorded = both.settings["fingerprint"]["settings"]
    assert recorded["method"] == "less" and recorded["gradients"] == "adapters" and recorded["checkpoint_weights"] == lrs
    # the same per-checkpoint numbers (the same computation, batch by batch), summed in float64: equal to rounding
    want = lrs[0] * alone[0].scores + lrs[1] * alone[1].scores
    np.testing.assert_allclose(both.scores, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    want_t = lrs[0] * alone[0].task_scores + lrs[1] * alone[1].task_scores
    np.testing.assert_allclose(both.task_scores, want_t, rtol=1e-12, atol=1e-12 * np.abs(want_t).max())
    assert np.abs(alone[0].scores - alone[1].scores).max() > 1e-3  # the checkpoints differ
    # under Lightning's default inference mode too (configs/score.yaml turns it off): the later checkpoints are loaded
    # outside it, as the first is, so their backward works and the scores are the same numbers
    inf = _score(tmp_path, "both_inference", less_warmup, trainer={"inference_mode": True},
                 checkpoints=[{"path": str(c)} for c in ckpts])
    np.testing.assert_array_equal(inf.scores, both.scores)
    # a changed weight is another result: never reused
    from iprox_lightning.io.fingerprint import FingerprintMismatch

    with pytest.raises(FingerprintMismatch):
        _score(tmp_path, "both", less_warmup, checkpoints=[{"path": str(c), "weight": 1.0} for c in ckpts])
    out = tmp_path / "less.jsonl"
    main([*guide_commands()[2], "--scores_path", str(tmp_path / "both"), "--k", "6", "--output", str(out),
          "--builtin_size", "120", "--quiet", "true"])
    rows = [l for l in out.read_text().splitlines() if l.strip()]
    assert len(rows) == 6


def test_less_store_unprojected_equals_exact_less_scoring(less_warmup, tmp_path):
    """``build_store --method less`` on a checkpoint's adapter directory, unprojected (k above every side), queried
    with the plain validation gradients: the exact LESS scores of that checkpoint (``predict``)."""
    from iprox_lightning.cli import main
    from iprox_lightning.io.scores import read_settings
    from iprox_lightning.scoring.influence import ScoreTable

    ckpt = less_warmup / "adapters" / "epoch_1"
    exact = _score(tmp_path, "exact", less_warmup, checkpoints=[{"path": str(ckpt), "weight": 1.0}])
    store, out = tmp_path / "store", tmp_path / "query"
    main(["build_store", "--model", str(ckpt), "--tokenizer", str(less_warmup), "--pool", "builtin",
          "--builtin_size", "120", "--max_length", "64", "--batch_size", "16", "--method", "less", "--k", "100000",
          "--output_dir", str(store), "--progress", "false"])
    main(["query", "--store", str(store), "--validation", "builtin", "--output_dir", str(out), "--progress", "false"])
    got = ScoreTable.load(str(out / "scores.parquet"))
    assert read_settings(out)["scorer"]["method"] == "less"
    assert got.ids == exact.ids and got.task_names == exact.task_names
    # float32 rows and a float32 exact run, in other batches and orders; Γ divides each gradient entry by √v̂ + ε, which
    # scales float32 rounding up where v̂ is small: up to 1.05e-5 of these cosines measured, 1e-4 allowed
    np.testing.assert_allclose(got.task_scores, exact.task_scores, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got.scores, exact.scores, rtol=0, atol=1e-4)


def _counting_loads(monkeypatch) -> list[str]:
    """The sources the scoring module loads a whole model from (its ``load_model`` calls), recorded."""
    from iprox_lightning.scoring import module

    loads, load = [], module.load_model

    def counted(source, *a, **kw):
        loads.append(str(source))
        return load(source, *a, **kw)

    monkeypatch.setattr(module, "load_model", counted)
    return loads


@pytest.mark.parametrize("method", ["less", "tracin"])
def test_checkpoints_over_one_base_load_it_once_and_score_as_each_loaded_whole(less_warmup, tmp_path, monkeypatch,
                                                                               method):
    """A LoRA warm-up's epochs (adapter directories over one base) share one loaded base, each checkpoint's adapter
    tensors put in place in turn: the scores (LESS, and multi-checkpoint TracIn) are bit for bit the ones of loading a
    base per checkpoint (the same tensors in the same operations), under Lightning's inference mode too (the adapters
    are read outside it); the fingerprint is the same, so a run recorded before resumes."""
    from iprox_lightning.scoring import module

    ckpts = [{"path": str(less_warmup / "adapters" / f"epoch_{e}")} for e in (1, 2)]
    loads = _counting_loads(monkeypatch)
    shared = _score(tmp_path, "shared", less_warmup, method=method, checkpoints=ckpts)
    assert loads == [ckpts[0]["path"]]  # one base (with the first checkpoint's adapters) for both
    inference = _score(tmp_path, "inference", less_warmup, trainer={"inference_mode": True}, method=method,
                       checkpoints=ckpts)
    loads.clear()
    with monkeypatch.context() as m:  # the path of a model loaded whole per checkpoint, as before
        m.setattr(module, "shared_base_key", lambda path: None)
        whole = _score(tmp_path, "whole", less_warmup, method=method, checkpoints=ckpts)
    assert loads == [c["path"] for c in ckpts]
    assert shared.ids == whole.ids == inference.ids and shared.task_names == whole.task_names
    for got in (shared, inference):
        np.testing.assert_array_equal(got.scores, whole.scores)
        np.testing.assert_array_equal(got.task_scores, whole.task_scores)
    assert shared.settings["fingerprint"] == whole.settings["fingerprint"]
    assert shared.settings["fingerprint"]["settings"]["method"] == method
    # the whole-model run's directory resumes under the shared path: nothing to score again, the same table
    again = _score(tmp_path, "whole", less_warmup, method=method, checkpoints=ckpts)
    np.testing.assert_array_equal(again.scores, whole.scores)


def _over_another_base(adapter, base, out):
    """A copy of the adapter directory ``adapter`` at ``out`` naming ``base`` (the warm-up's merged dense model) as its
    base: the same adapter tensors over another base."""
    import json
    import shutil

    shutil.copytree(adapter, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def test_checkpoints_over_other_bases_are_each_loaded_with_their_base(less_warmup, tmp_path, monkeypatch):
    """An adapter over another base (here the same adapters named over the warm-up's merged model) shares nothing:
    each checkpoint loads whole with its own base, as before (summing the scores of other models' checkpoints is
    what ``checkpoints`` does for dense checkpoints too); a dense checkpoint likewise."""
    from iprox_lightning.models.lora import shared_base_key

    first, second = (less_warmup / "adapters" / f"epoch_{e}" for e in (1, 2))
    other = _over_another_base(second, less_warmup, tmp_path / "other_base")
    assert shared_base_key(first) == shared_base_key(second) is not None
    assert shared_base_key(other) not in (None, shared_base_key(first))
    assert shared_base_key(less_warmup) is None  # a dense model
    loads = _counting_loads(monkeypatch)
    table = _score(tmp_path, "mixed", less_warmup, method="tracin", checkpoints=[
        {"path": str(first), "weight": 1.0}, {"path": str(other), "weight": 1.0}, {"path": str(second), "weight": 1.0}])
    # the third shares the first's base; the second loads whole
    assert loads == [str(first), str(other)]
    alone = _score(tmp_path, "alone", less_warmup, method="tracin", checkpoints=[{"path": str(other), "weight": 1.0}])
    pair = _score(tmp_path, "pair", less_warmup, method="tracin", checkpoints=[
        {"path": str(first), "weight": 1.0}, {"path": str(second), "weight": 1.0}])
    # float64 sums of the same per-checkpoint numbers in another order: equal to rounding
    want = pair.scores + alone.scores
    np.testing.assert_allclose(table.scores, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def _scorers_alive(monkeypatch) -> list[int]:
    """At each scorer's preparation (its validation gradients stacked): how many other scorers are alive then."""
    import gc
    import weakref

    from iprox_lightning.scoring.influence import InfluenceScorer

    alive, seen, stacked = weakref.WeakSet(), [], InfluenceScorer._stacked

    def counting(self, sums, names, reduce):
        gc.collect()
        seen.append(sum(1 for s in alive if s is not self))
        alive.add(self)
        return stacked(self, sums, names, reduce)

    monkeypatch.setattr(InfluenceScorer, "_stacked", counting)
    return seen


def test_checkpoints_in_turn_score_bit_for_bit_as_batch_by_batch_holding_one_scorer(less_warmup, tmp_path,
                                                                                     monkeypatch):
    """``checkpoints_in_turn``: LESS over a LoRA warm-up's epochs scored one checkpoint at a time (a pass over the pool
    each, the adapters over the shared base put in place in turn) equals the batch-by-batch scores bit for bit (the
    same tensors in the same operations, summed in the same order), while one checkpoint's scorer (its Adam moments
    and validation gradients) is alive at a time instead of every one; the fingerprint is the same, so either way
    resumes the other's directory."""
    ckpts = [{"path": str(less_warmup / "adapters" / f"epoch_{e}")} for e in (1, 2)]
    alive = _scorers_alive(monkeypatch)
    together = _score(tmp_path, "together", less_warmup, checkpoints=ckpts)
    assert alive == list(range(len(ckpts)))  # batch by batch: every earlier checkpoint's scorer is held
    alive.clear()
    loads = _counting_loads(monkeypatch)
    in_turn = _score(tmp_path, "in_turn", less_warmup, checkpoints=ckpts, checkpoints_in_turn=True)
    assert alive == [0] * len(ckpts)  # in turn: the one being prepared only
    assert loads == [ckpts[0]["path"]]  # the base once, each later checkpoint's adapters put in place over it
    assert in_turn.ids == together.ids and in_turn.task_names == together.task_names and len(in_turn) == 120
    np.testing.assert_array_equal(in_turn.scores, together.scores)
    np.testing.assert_array_equal(in_turn.task_scores, together.task_scores)
    np.testing.assert_array_equal(in_turn.zero_grad, together.zero_grad)
    assert in_turn.settings["fingerprint"] == together.settings["fingerprint"]
    # under Lightning's default inference mode too (the passes replay the pool inside it)
    inference = _score(tmp_path, "in_turn_inference", less_warmup, trainer={"inference_mode": True}, checkpoints=ckpts,
                       checkpoints_in_turn=True)
    np.testing.assert_array_equal(inference.scores, together.scores)
    # the batch-by-batch directory resumed in turn: every row done, the same table
    again = _score(tmp_path, "together", less_warmup, checkpoints=ckpts, checkpoints_in_turn=True)
    np.testing.assert_array_equal(again.scores, together.scores)


def test_checkpoints_in_turn_load_each_other_model_in_turn_and_resume_after_a_crash(less_warmup, tmp_path,
                                                                                    monkeypatch):
    """Multi-checkpoint TracIn over checkpoints of several kinds (an adapter over another base and a dense model,
    each loaded whole; an adapter over the first's base, swapped in) in turn: bit for bit the batch-by-batch scores,
    at most one loaded model beside the first's at a time. Stopped inside the second checkpoint's pass, then after 3
    of the live loop's 8 batches, and run again: nothing is scored twice. Each earlier checkpoint's pass keeps its rows
    in the output directory (``checkpoint_passes/``, removed with the merge), read back by the next run; a stop inside
    a pass keeps the rows scored before it. The table is the uninterrupted one, bit for bit; another setting never
    resumes those rows."""
    import weakref

    from iprox_lightning.scoring import module

    first, second = (less_warmup / "adapters" / f"epoch_{e}" for e in (1, 2))
    other = _over_another_base(second, less_warmup, tmp_path / "other_base")
    ckpts = [{"path": str(first), "weight": 1.0}, {"path": str(other), "weight": 0.5},
             {"path": str(less_warmup), "weight": 0.25}, {"path": str(second), "weight": 2.0}]
    together = _score(tmp_path, "together", less_warmup, method="tracin", checkpoints=ckpts)
    loaded, most, load = weakref.WeakSet(), [], module.load_model

    def counted(source, *a, **kw):
        import gc

        gc.collect()
        net, tok = load(source, *a, **kw)
        loaded.add(net)
        most.append(len(loaded))
        return net, tok

    monkeypatch.setattr(module, "load_model", counted)
    in_turn = _score(tmp_path, "in_turn", less_warmup, method="tracin", checkpoints=ckpts, checkpoints_in_turn=True)
    assert most == [1, 2, 2]  # the first; then the other base's, dropped before the dense one is loaded
    np.testing.assert_array_equal(in_turn.scores, together.scores)
    np.testing.assert_array_equal(in_turn.task_scores, together.task_scores)
    from iprox_lightning.io.score_dir import PASSES_DIR
    from iprox_lightning.scoring.influence import InfluenceScorer

    scored, score = [], InfluenceScorer.score_batch  # rows scored per call, in order; a stop at a chosen call

    def counting(self, batch):
        if len(scored) + 1 == stop_at:
            raise RuntimeError("simulated crash")
        scored.append(len(batch["id"]))
        return score(self, batch)

    monkeypatch.setattr(InfluenceScorer, "score_batch", counting)
    # a stop in the second checkpoint's pass (its third batch of 8: the three passes come before the live loop)
    stop_at = 8 + 3
    with pytest.raises(RuntimeError, match="simulated crash"):
        _score(tmp_path, "crashed", less_warmup, method="tracin", checkpoints=ckpts, checkpoints_in_turn=True)
    assert sum(scored) == 120 + 32
    passes = tmp_path / "crashed" / PASSES_DIR
    assert sorted(p.name for p in passes.iterdir()) == ["checkpoint_1", "checkpoint_2"]  # the rows kept on the stop
    # then a stop in the live loop (after 3 of its batches, written by the writer's flush)
    monkeypatch.setenv("IPROX_ALLOW_IMPORTS", "test_writer_scoring")  # the command line imports the test's callback
    crash = {"class_path": "test_writer_scoring.Crash", "init_args": {"after": 3}}
    scored.clear()
    stop_at = None
    with pytest.raises(RuntimeError, match="simulated crash"):
        _score(tmp_path, "crashed", less_warmup, method="tracin", checkpoints=ckpts, checkpoints_in_turn=True,
               callbacks=[crash])
    assert sum(scored) == (120 - 32) + 120 + 48  # the second pass's rest, the third pass, 3 live batches
    scored.clear()
    resumed = _score(tmp_path, "crashed", less_warmup, method="tracin", checkpoints=ckpts, checkpoints_in_turn=True)
    assert sum(scored) == 120 - 48  # every pass's rows read back; the live loop's rest
    assert not passes.exists()  # removed with the merge
    assert sorted(resumed.ids) == sorted(together.ids)
    order = [resumed.ids.index(i) for i in together.ids]
    np.testing.assert_array_equal(resumed.scores[order], together.scores)
    np.testing.assert_array_equal(resumed.task_scores[order], together.task_scores)
    # a changed setting (another weight) is never resumed from the passes of the first
    scored.clear()
    stop_at = 3
    with pytest.raises(RuntimeError, match="simulated crash"):
        _score(tmp_path, "stopped", less_warmup, method="tracin", checkpoints=ckpts, checkpoints_in_turn=True)
    assert (tmp_path / "stopped" / PASSES_DIR).exists()
    stop_at = None
    from iprox_lightning.io.fingerprint import FingerprintMismatch

    with pytest.raises(FingerprintMismatch, match="produced from different inputs"):
        _score(tmp_path, "stopped", less_warmup, method="tracin", checkpoints_in_turn=True,
               checkpoints=[{**c, "weight": 3.0} for c in ckpts])


def test_checkpoints_in_turn_needs_checkpoints():
    from iprox_lightning.scoring import InfluenceScoringModule

    with pytest.raises(UserInputError, match="checkpoints_in_turn scores the checkpoints of `checkpoints`"):
        InfluenceScoringModule(checkpoints_in_turn=True)
    with pytest.raises(UserInputError, match="checkpoints_in_turn must be true or false"):
        InfluenceScoringModule(checkpoints=[{"path": "x", "weight": 1.0}], checkpoints_in_turn="yes")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapters_read_for_a_shared_base_equal_the_ones_loaded_with_it(less_warmup, dtype):
    """A checkpoint's adapter tensors read through another checkpoint's peft model (one base) are bit for bit the ones
    loading it whole holds, in float32 and in bfloat16 (peft's float32 adapters cast to the model's dtype); the model
    keeps the tensors in place before until the new ones are put in place, and takes them back."""
    from iprox_lightning.models.loading import load_model
    from iprox_lightning.models.lora import adapter_weights, read_adapter_weights, use_adapter_weights

    first, second = (str(less_warmup / "adapters" / f"epoch_{e}") for e in (1, 2))
    kw = dict(dtype=dtype, tokenizer=False, merge_adapters=False)
    net, _ = load_model(first, **kw)
    own = {k: t.clone() for k, t in adapter_weights(net).items()}
    kept = adapter_weights(net)
    read = read_adapter_weights(net, second)
    assert all(adapter_weights(net)[k].data_ptr() == t.data_ptr() for k, t in kept.items())  # nothing in place yet
    use_adapter_weights(net, read)
    assert all(adapter_weights(net)[k].data_ptr() == t.data_ptr() for k, t in read.items())
    whole = adapter_weights(load_model(second, **kw)[0])
    assert set(read) == set(whole) == set(own) and len(read) > 0
    for k in whole:
        assert read[k].dtype == whole[k].dtype == getattr(torch, dtype)
        assert torch.equal(read[k], whole[k]), k
        assert torch.equal(kept[k], own[k]) and not torch.equal(kept[k], read[k]), k
    use_adapter_weights(net, kept)
    assert all(torch.equal(t, own[k]) for k, t in adapter_weights(net).items())


@pytest.mark.parametrize("bad, message", [
    ("a/b", r"checkpoints must be a non-empty list of \{path, weight\}"),
    ([], r"checkpoints must be a non-empty list"),
    ([{"weight": 1.0}], r"checkpoints\[0\] must be \{path, weight\}"),
    ([{"path": "x", "weight": 1.0, "lr": 2}], r"checkpoints\[0\] must be \{path, weight\}"),
    ([{"path": "x", "weight": "big"}], r"checkpoints\[0\]\.weight must be a finite number"),
    ([{"path": "x", "weight": float("nan")}], r"checkpoints\[0\]\.weight must be a finite number"),
])
def test_bad_checkpoints_are_refused_naming_the_entry(bad, message):
    from iprox_lightning.scoring import InfluenceScoringModule

    with pytest.raises(UserInputError, match=message):
        InfluenceScoringModule(checkpoints=bad)


def test_a_checkpoint_without_weight_or_optimizer_state_is_refused(tmp_path):
    from iprox_lightning.scoring import InfluenceScoringModule

    with pytest.raises(InputNotFoundError, match=r"checkpoints\[1\]: no weight given and no optimizer_state"):
        InfluenceScoringModule(checkpoints=[{"path": str(tmp_path), "weight": 1.0}, {"path": str(tmp_path)}])


def test_check_refuses_less_before_loading_anything(tmp_path):
    """LESS scores a LoRA checkpoint with its Adam moments: ``check`` (a proxy against its dense target) refuses it
    at once, naming the metrics it takes (``pipeline --method less``: tests/test_hostile_inputs.py)."""
    from iprox_lightning.cli import main

    with pytest.raises(UserInputError, match="check with tracin, kfac or ekfac"):
        main(["check", "--target", "builtin", "--proxy", "builtin", "--output_dir", str(tmp_path / "c"),
              "--method", "less"])
    assert not (tmp_path / "c").exists()


def test_plan_on_a_cpu_counts_the_last_checkpoints_preparation_the_scorers_hold(less_warmup, tmp_path, monkeypatch):
    """On a CPU the plan's LESS stage over several checkpoints is the last checkpoint's preparation (bfloat16 holding):
    the earlier checkpoints' validation gradients as held beside this one's float32 sums — the bytes the scorers hold
    at its stacking (SmolLM2-135M, 4 checkpoints, 93 columns: this moment ran a 24 GB machine out of memory in
    float32; measured peak 19.4 GiB resident in bfloat16, plan 15.4 GiB)."""
    import json

    from iprox_lightning.analysis import memory as M
    from iprox_lightning.scoring.influence import InfluenceScorer

    ckpts = [less_warmup / "adapters" / f"epoch_{e}" for e in (1, 2)]
    seen: list[tuple[float, float]] = []  # at each stacking: (this scorer's sums, every earlier scorer's V), bytes
    scorers: list[InfluenceScorer] = []
    stacked = InfluenceScorer._stacked

    def counting(self, sums, names, reduce):
        if self not in scorers:
            scorers.append(self)
        held = sum(t.numel() * t.element_size() for s in scorers if s is not self for t in s.V.values())
        seen.append((float(sum(t.numel() * t.element_size() for acc in sums.values() for t in acc.values())), held))
        return stacked(self, sums, names, reduce)

    monkeypatch.setattr(InfluenceScorer, "_stacked", counting)
    table = _score(tmp_path, "plan", less_warmup, checkpoints=[{"path": str(c)} for c in ckpts],
                   validation_gradients={"dtype": "bfloat16"})
    assert len(seen) == 2 and seen[1][1] > 0
    lora = json.loads((ckpts[0] / "adapter_config.json").read_text())
    run = M.RunSettings(tasks=len(table.task_names), checkpoints=2, method="less", device_kind="cpu",
                        validation_gradients={"dtype": "bfloat16"}, max_length=16, batch_size=4,
                        lora={"r": lora["r"], "alpha": lora["lora_alpha"], "target_modules": sorted(lora["target_modules"])})
    sizes, acts, _ = M.model_counts(str(less_warmup), run)
    plan = M.less_scoring_plan(sizes, acts, run)
    vg = M.validation_gradient_bytes(M.lora_weights(sizes, run.lora), run.tasks, run.validation_gradients)
    prep = M.validation_preparation(plan.parts, vg, run)
    assert prep["validation_sums"] == seen[1][0]  # this checkpoint's float32 sums
    assert prep["validation_gradients"] == seen[1][1]  # the first checkpoint's, in bfloat16
    assert plan.peak >= sum(prep.values()) and plan.parts["validation_gradients"] in (2 * seen[1][1], seen[1][1])
    cuda = M.less_scoring_plan(sizes, acts, M.RunSettings(**{**run.__dict__, "device_kind": "cuda"})).parts
    assert "validation_sums" not in cuda and cuda["validation_gradients"] == 2 * seen[1][1]  # the device's: both held


def test_plan_counts_one_checkpoint_held_in_turn(less_warmup, tmp_path, monkeypatch):
    """``plan --checkpoints_in_turn``: the scorers alive at each checkpoint's preparation hold no other checkpoint's
    validation gradients (measured at the stacking, as above), and the plan's LESS stage holds one checkpoint's
    validation gradients and Adam moments (the device's: a half of the batch-by-batch two here), the base with one
    more checkpoint's adapters, and the earlier checkpoints' scores of its rows."""
    import gc
    import json
    import weakref

    from iprox_lightning.analysis import memory as M
    from iprox_lightning.scoring.influence import InfluenceScorer

    ckpts = [less_warmup / "adapters" / f"epoch_{e}" for e in (1, 2)]
    alive, seen, held, stacked, score = weakref.WeakSet(), [], set(), InfluenceScorer._stacked, InfluenceScorer.score_batch

    def counting(self, sums, names, reduce):
        gc.collect()
        seen.append(sum(t.numel() * t.element_size() for s in alive if s is not self for t in s.V.values()))
        alive.add(self)
        return stacked(self, sums, names, reduce)

    def scoring(self, batch):  # what a scorer holds while it scores (its validation gradients as narrowed)
        held.add(sum(t.numel() * t.element_size() for t in self.V.values()))
        return score(self, batch)

    monkeypatch.setattr(InfluenceScorer, "_stacked", counting)
    monkeypatch.setattr(InfluenceScorer, "score_batch", scoring)
    table = _score(tmp_path, "plan", less_warmup, checkpoints=[{"path": str(c)} for c in ckpts],
                   validation_gradients={"dtype": "bfloat16"}, checkpoints_in_turn=True)
    (own,) = held
    assert seen == [0, 0] and own > 0  # no other checkpoint's validation gradients at a preparation
    lora = json.loads((ckpts[0] / "adapter_config.json").read_text())
    settings = dict(tasks=len(table.task_names), checkpoints=2, method="less", validation_gradients={"dtype": "bfloat16"},
                    max_length=16, batch_size=4, pool_size=120,
                    lora={"r": lora["r"], "alpha": lora["lora_alpha"], "target_modules": sorted(lora["target_modules"])})
    sizes, acts, _ = M.model_counts(str(less_warmup), M.RunSettings(**settings))
    plans = {(kind, turn): M.less_scoring_plan(sizes, acts, M.RunSettings(**settings, device_kind=kind,
                                                                          checkpoints_in_turn=turn))
             for kind in ("cpu", "cuda") for turn in (False, True)}
    vg = M.validation_gradient_bytes(M.lora_weights(sizes, M.RunSettings(**settings).lora), len(table.task_names),
                                     {"dtype": "bfloat16"})
    assert vg["held"] == own  # one checkpoint's, as the scorer holds them
    turn, together = plans[("cuda", True)].parts, plans[("cuda", False)].parts
    assert turn["validation_gradients"] == own and together["validation_gradients"] == 2 * own
    assert 2 * turn["adam_moments"] == together["adam_moments"] > 0
    assert turn["weights"] == together["weights"]  # two checkpoints: the base and two adapter sets either way
    four = {turn: M.less_scoring_plan(sizes, acts, M.RunSettings(**{**settings, "checkpoints": 4},
                                                                 checkpoints_in_turn=turn)).parts for turn in (0, 1)}
    adapters = (four[0]["weights"] - together["weights"]) / 2  # one checkpoint's adapters
    assert adapters > 0 and four[1]["weights"] == together["weights"]  # four in turn: still the base and two sets
    assert "earlier_scores" not in turn  # host memory, not the device's
    cpu = plans[("cpu", True)].parts
    assert cpu["earlier_scores"] == 1 * 120 * (8 * (len(table.task_names) + 1) + 2)  # the other checkpoint's rows
    prep = M.validation_preparation(plans[("cpu", True)].parts, vg, M.RunSettings(**settings, device_kind="cpu",
                                                                                  checkpoints_in_turn=True))
    assert prep["validation_gradients"] == 0  # no other checkpoint's held at a preparation
    assert plans[("cpu", True)].peak < plans[("cpu", False)].peak

