"""Issue 22's levers end to end: the validation examples Stage 2 may train on (``SFTDataModule(val_train_fraction,
mix_val_train)``) and the task terms of ``ProxyAlignModule`` (``val_grad_weight``, ``score_weight``) under a real
``Trainer.fit`` on the built-in model and data — each option is used (its term logged every step, the data it reads),
moves the factors, and improves what it targets on held-out data; with the options off nothing changes."""
from __future__ import annotations

import csv
import json

import lightning as L
import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from iprox_lightning.compression.callback import IPSVDCallback
from iprox_lightning.data import SFTDataModule
from iprox_lightning.data.splits import split_validation
from iprox_lightning.engine.lowrank import LowRankLinear
from iprox_lightning.models.builtin import builtin_model
from iprox_lightning.modules import ProxyAlignModule
from iprox_lightning.alignment import module as proxy_align_module
from iprox_lightning.alignment.module import AlignConfig
from iprox_lightning.scoring.influence import tracin_scores
from iprox_lightning.alignment.task import task_gradient_alignment

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8


# ------------------------------------------------------------------------------------------------ the split
def test_split_validation_rule_disjoint_deterministic_and_spread_over_subtasks():
    ids = [f"e{i:02d}" for i in range(23)]
    tasks = ["mmlu"] * 10 + ["bbh"] * 9 + ["tydiqa"] * 3 + ["solo"]
    subtasks = [f"s{i % 5}" for i in range(10)] + [f"b{i % 3}" for i in range(9)] + ["fi", "ru", "sw"] + [None]
    train, monitor = split_validation(ids, tasks, 0.5, seed=3, subtasks=subtasks)
    assert not set(train) & set(monitor) and sorted(train + monitor) == ids
    n_train = {t: sum(1 for i in train if tasks[ids.index(i)] == t) for t in ("mmlu", "bbh", "tydiqa", "solo")}
    assert n_train == {"mmlu": 5, "bbh": 5, "tydiqa": 2, "solo": 0}  # min(n-1, max(1, ⌊f n + 0.5⌋)); 1 example: monitors
    # spread: the 5 MMLU training examples come from the 5 subjects, BBH's 5 from all 3 tasks
    assert sorted({subtasks[ids.index(i)] for i in train if i.startswith("e0")}) == [f"s{k}" for k in range(5)]
    assert {subtasks[ids.index(i)] for i in train if tasks[ids.index(i)] == "bbh"} == {"b0", "b1", "b2"}
    # deterministic by seed, independent of the read order, another seed another draw
    rev = split_validation(ids[::-1], tasks[::-1], 0.5, seed=3, subtasks=subtasks[::-1])
    assert sorted(rev[0]) == sorted(train)
    assert split_validation(ids, tasks, 0.5, seed=3, subtasks=subtasks) == (train, monitor)
    assert any(split_validation(ids, tasks, 0.5, seed=s, subtasks=subtasks)[0] != train for s in range(4, 8))
    assert split_validation(ids, tasks, 0.0) == ([], ids)
    assert len(split_validation(ids, tasks, 0.9)[1]) == 4  # every task keeps one to monitor
    with pytest.raises(ValueError, match="< 1"):
        split_validation(ids, tasks, 1.0)


def datamodule(**kw) -> SFTDataModule:
    kw = {"builtin_size": 200, "val_per_task": 8, "seed": 1, "construction_fraction": 0.1, "probe_fraction": 0.2,
          "max_length": 40, "batch_size": 4, "eval_batch_size": 8, "train_split": "align", **kw}
    return SFTDataModule(**kw)


def test_datamodule_serves_disjoint_recorded_val_train_and_mixes_it_in():
    dm = datamodule(val_train_fraction=0.5, mix_val_train=2)
    full = datamodule()
    every = full.ids("validation")
    train, monitor = dm.ids("val_train"), dm.ids("validation")
    assert len(every) == 16 and len(train) == len(monitor) == 8 and sorted(train + monitor) == sorted(every)
    assert [i for b in dm.val_dataloader() for i in b["id"]] == monitor  # monitoring / keep_best: never trained on
    rec = dm.validation_split_record()
    assert (rec["val_train_ids"], rec["monitor_ids"], rec["fraction"], rec["seed"]) == (train, monitor, 0.5, 1)
    json.dumps(rec)
    assert datamodule(val_train_fraction=0.5).ids("val_train") == train  # the same seed, the same split
    assert datamodule(val_train_fraction=0.5, seed=2).ids("val_train") != train
    # the training loader: the align split plus two copies of val_train, shuffled by seed
    served = [i for b in dm.train_dataloader() for i in b["id"]]
    assert sorted(served) == sorted(dm.ids("align") + 2 * train)
    assert served == [i for b in dm.train_dataloader() for i in b["id"]]
    assert not set(served) & set(monitor)
    # task batches: per_task examples of each task, cycling through every val_train example of the task
    it = dm.task_batches(3)
    batches = [next(it) for _ in range(4)]
    for b in batches:
        assert sorted(b["task"]) == ["addition"] * 3 + ["uppercase"] * 3 and set(b["id"]) <= set(train)
    assert {i for b in batches for i in b["id"]} == set(train)
    again = dm.task_batches(3)
    assert [next(again)["id"] for _ in range(4)] == [b["id"] for b in batches]
    # off (default): no val_train split, the full validation set monitors
    assert full.val_train_fraction == 0 and full.ids("validation") == every
    with pytest.raises(ValueError, match="val_train_fraction"):
        full.dataset("val_train")
    with pytest.raises(ValueError, match="val_train_fraction"):
        datamodule(mix_val_train=1)
    with pytest.raises(ValueError, match="val_train_fraction must be"):
        datamodule(val_train_fraction=1.0)
    with pytest.raises(ValueError, match="train_split"):
        datamodule(train_split="val_train")


# ------------------------------------------------------------------------------------------------ fits
class Seen(L.Callback):
    """The example ids each part of the fit read: training batches, validation (monitoring) batches."""

    def __init__(self):
        self.train, self.val = set(), set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train.update(batch["id"])

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.val.update(batch["id"])


def spy_datamodule(dm: SFTDataModule) -> dict[str, set]:
    """Record the ids the module's task terms read from the datamodule."""
    seen = {"task_batches": set(), "val_train_loader": set()}
    task_batches, val_train_dataloader = dm.task_batches, dm.val_train_dataloader

    def tb(per_task):
        for b in task_batches(per_task):
            seen["task_batches"].update(b["id"])
            yield b

    def vt(*a, **k):
        batches = list(val_train_dataloader(*a, **k))
        seen["val_train_loader"].update(i for b in batches for i in b["id"])
        return batches

    dm.task_batches, dm.val_train_dataloader = tb, vt
    return seen


def fit(tmp_path, name, data=None, **module_kw):
    dm = datamodule(**{"val_train_fraction": 0.5, **(data or {})})
    seen_dm = spy_datamodule(dm)
    module = ProxyAlignModule(target=builtin_model(0), lr=1e-2, save_dir=str(tmp_path / name / "proxy"),
                              log_layer_cosines=False, keep_best=False, **module_kw)
    seen = Seen()
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, val_check_interval=4, num_sanity_val_steps=0,
                   callbacks=[IPSVDCallback(sparsity=0.5, method="ipsvd", num_probe_tokens=32, allocation="uniform",
                                            health_batches=0), seen],
                   default_root_dir=tmp_path / name, logger=L.pytorch.loggers.CSVLogger(tmp_path / name, name="log"),
                   log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False)
    tr.fit(module, datamodule=dm)
    rows = list(csv.DictReader(open(tmp_path / name / "log" / "version_0" / "metrics.csv")))
    manifest = json.loads((tmp_path / name / "proxy" / "iprox_proxy.json").read_text())
    return {"module": module, "dm": dm, "seen": seen, "seen_dm": seen_dm, "rows": rows, "manifest": manifest}


def factors(model) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": getattr(m, k).detach().clone() for n, m in model.named_modules()
            if isinstance(m, LowRankLinear) for k in ("A", "B")}


def logged(rows, key) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def heldout_val_grad_loss(run) -> float:
    """L_val of the trained proxy on the monitoring examples (never trained on)."""
    dm, m = run["dm"], run["module"]
    batch = next(iter(dm.dataloader("validation", batch_size=100)))
    return float(task_gradient_alignment(m.teacher, m.proxy, batch, create_graph=False).loss)


def heldout_ranking(run, target_validation: bool = False) -> float:
    """Mean over tasks of the Spearman of the proxy's and the target's per-task TracIn scores of 48 held-out pool
    examples (the fidelity split, in no training split) against the monitoring validation examples (the proxy's
    against the target's validation gradients with ``target_validation``)."""
    dm, m = run["dm"], run["module"]
    loader = dm.fidelity_dataloader(48)
    target = tracin_scores(m.teacher, loader, dm.val_dataloader(), progress=False)
    proxy = tracin_scores(m.proxy, loader, dm.val_dataloader(), progress=False,
                          validation_model=m.teacher if target_validation else None)
    return float(np.mean([spearmanr(proxy.task_scores[:, k], target.task_scores[:, k]).statistic
                          for k in range(len(target.task_names))]))


def assert_never_trained_on_monitoring(run):
    dm, seen, seen_dm = run["dm"], run["seen"], run["seen_dm"]
    monitor, train = set(dm.ids("validation")), set(dm.ids("val_train"))
    assert seen.val == monitor  # the validation loop (keep_best's monitor) read exactly the monitoring examples
    read = seen.train | seen_dm["task_batches"] | seen_dm["val_train_loader"]
    assert read and not read & monitor
    assert seen_dm["task_batches"] <= train and seen_dm["val_train_loader"] <= train
    rec = run["manifest"]["alignment"]["validation_split"]
    assert rec["val_train_ids"] == dm.ids("val_train") and rec["monitor_ids"] == dm.ids("validation")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("base"), "base")


def test_val_grad_term_is_used_and_aligns_held_out_task_gradients(tmp_path, base):
    run = fit(tmp_path, "valg", val_grad_weight=1.0, val_examples_per_task=2)
    rows = run["rows"]
    l_val = logged(rows, "align/l_val_grad")
    assert len(l_val) == STEPS and all(0 <= v <= 2 for v in l_val)
    assert len(logged(rows, "align/val_grad_cos/addition")) == len(logged(rows, "align/val_grad_cos/uppercase")) == STEPS
    # the total logged loss is L_GA + λ_KL L_KL + w L_val
    for r in rows:
        if r.get("align/l_val_grad"):
            parts = float(r["align/l_ga"]) + 0.1 * float(r["align/l_kl"]) + float(r["align/l_val_grad"])
            assert float(r["align/loss"]) == pytest.approx(parts, rel=1e-5)
    assert run["seen_dm"]["task_batches"] == set(run["dm"].ids("val_train"))  # 8 steps x 2 per task cycle through all
    assert_never_trained_on_monitoring(run)
    a, b = factors(run["module"].proxy), factors(base["module"].proxy)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    # what it targets, on the monitoring examples: the per-task validation gradients align better than without it
    mine, without = heldout_val_grad_loss(run), heldout_val_grad_loss(base)
    assert mine < without - 0.05, (mine, without)
    assert run["manifest"]["alignment"]["val_grad_weight"] == 1.0
    assert "align/l_val_grad" not in base["rows"][0] and "align/l_score" not in base["rows"][0]


def test_val_grad_chunks_train_the_factors_one_graph_trains(tmp_path):
    """``val_grad_chunk=1`` (one row per double backward) trains the factors ``None`` (the whole L_val batch in one
    graph) trains, and logs the same terms (float32: summation order only)."""
    runs = {c: fit(tmp_path / str(c), f"chunk{c}", val_grad_weight=1.0, val_examples_per_task=2, val_grad_chunk=c)
            for c in (1, None)}
    a, b = factors(runs[1]["module"].proxy), factors(runs[None]["module"].proxy)
    moved = factors(fit(tmp_path / "base", "base")["module"].proxy)
    assert any(not torch.equal(a[k], moved[k]) for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4 * float(b[k].abs().max()))  # measured: 8e-6
    np.testing.assert_allclose(logged(runs[1]["rows"], "align/l_val_grad"), logged(runs[None]["rows"], "align/l_val_grad"),
                               rtol=1e-4)
    assert runs[1]["manifest"]["alignment"]["val_grad_chunk"] == 1


def test_score_term_is_used_refreshed_and_improves_held_out_ranking(tmp_path, base, monkeypatch):
    calls = []
    real = proxy_align_module.proxy_directions

    def counting(proxy, batches, tasks, layers=None):
        calls.append(len(batches))
        return real(proxy, batches, tasks, layers)

    monkeypatch.setattr(proxy_align_module, "proxy_directions", counting)
    run = fit(tmp_path, "score", score_weight=1.0, score_refresh_every=3)
    rows = run["rows"]
    l_score = logged(rows, "align/l_score")
    assert len(l_score) == STEPS and all(0 <= v <= 2 for v in l_score)
    assert len(logged(rows, "align/score_loss/addition")) == STEPS
    assert len(calls) == 3 and run["module"].directions.proxy_step == 6  # steps 0, 3, 6
    assert run["seen_dm"]["val_train_loader"] == set(run["dm"].ids("val_train"))
    assert_never_trained_on_monitoring(run)
    assert run["manifest"]["alignment"]["task_directions"] == {"tasks": ["addition", "uppercase"], "examples": 8}
    a, b = factors(run["module"].proxy), factors(base["module"].proxy)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    # what it targets: the proxy's per-task TracIn ranking of held-out pool examples agrees better with the target's
    mine, without = heldout_ranking(run), heldout_ranking(base)
    assert mine > without + 0.05, (mine, without)


def test_score_term_against_the_targets_validation_directions(tmp_path, base, monkeypatch):
    """``proxy_validation="target"``: the score term's proxy directions are the target's projected by the current
    factors (``projected_directions``) at every step, with no proxy pass over the validation examples; the factors
    train, and the proxy's ranking of held-out pool examples scored that way (``validation_model``) agrees better with
    the target's than without the term."""
    calls = {"proxy": 0, "projected": []}
    real_proxy, real_proj = proxy_align_module.proxy_directions, proxy_align_module.projected_directions

    def counting_proxy(*a, **k):
        calls["proxy"] += 1
        return real_proxy(*a, **k)

    def counting_projected(proxy, d, layers=None):
        calls["projected"].append({n: (m.A.detach().clone(), m.B.detach().clone())
                                   for n, m in proxy_align_module.proxy_factor_layers(proxy, layers).items()})
        return real_proj(proxy, d, layers)

    monkeypatch.setattr(proxy_align_module, "proxy_directions", counting_proxy)
    monkeypatch.setattr(proxy_align_module, "projected_directions", counting_projected)
    run = fit(tmp_path, "score_tval", score_weight=1.0, proxy_validation="target")
    m = run["module"]
    assert calls["proxy"] == 0 and len(calls["projected"]) == STEPS and m.directions.proxy_step == STEPS - 1
    assert not torch.equal(calls["projected"][0][next(iter(calls["projected"][0]))][0],
                           calls["projected"][-1][next(iter(calls["projected"][-1]))][0])  # re-made as factors move
    assert len(logged(run["rows"], "align/l_score")) == STEPS and run["manifest"]["alignment"]["proxy_validation"] == "target"
    # the directions the last step used: the target's through the factors of that step
    last = calls["projected"][-1]
    for n, (va, vb) in m.directions.proxy.items():
        A, B = last[n]
        torch.testing.assert_close(va, m.directions.target[n] @ B.t().to(va), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(vb, A.t().to(vb) @ m.directions.target[n], rtol=1e-5, atol=1e-7)
    a, b = factors(m.proxy), factors(base["module"].proxy)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    # scored that way the un-trained proxy already ranks these examples well (measured 0.914, against 0.759 with its
    # own validation gradients); the term still lifts it (0.923)
    mine, without = heldout_ranking(run, True), heldout_ranking(base, True)
    assert mine > without, (mine, without)
    with pytest.raises(ValueError, match="proxy_validation must be"):
        AlignConfig(proxy_validation="both")


def test_listwise_worst_task_score_term_trains_other_factors(tmp_path, base):
    run = fit(tmp_path, "listwise", score_weight=1.0, score_loss="listwise", task_reduction="max",
              score_refresh_every=4)
    rows = run["rows"]
    for r in rows:
        if r.get("align/l_score"):
            per = [float(r[f"align/score_loss/{t}"]) for t in ("addition", "uppercase")]
            assert float(r["align/l_score"]) == pytest.approx(max(per), rel=1e-5)  # the worst task
    assert len(logged(rows, "align/l_score")) == STEPS
    a, b = factors(run["module"].proxy), factors(base["module"].proxy)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert run["manifest"]["alignment"]["score_loss"] == "listwise"


def test_mixing_validation_examples_into_training(tmp_path, base):
    run = fit(tmp_path, "mix", data={"mix_val_train": 2})
    dm = run["dm"]
    assert run["seen"].train & set(dm.ids("val_train"))  # training read validation examples ...
    assert_never_trained_on_monitoring(run)  # ... never the monitoring ones
    assert run["manifest"]["alignment"]["validation_split"]["mix_val_train"] == 2
    a, b = factors(run["module"].proxy), factors(base["module"].proxy)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    mine, without = heldout_val_grad_loss(run), heldout_val_grad_loss(base)
    assert mine < without - 0.02, (mine, without)


def test_defaults_off_and_the_split_alone_changes_no_factor(tmp_path, base):
    """The options default to off; setting the validation split aside (no term, no mixing) trains exactly the factors
    a fit without it trains (only the monitoring set shrinks)."""
    cfg = AlignConfig()
    assert (cfg.val_grad_weight, cfg.score_weight, cfg.task_terms) == (0.0, 0.0, False)
    dm = SFTDataModule()
    assert (dm.val_train_fraction, dm.mix_val_train) == (0.0, 0)
    plain = fit(tmp_path, "plain", data={"val_train_fraction": 0.0})
    a, b = factors(plain["module"].proxy), factors(base["module"].proxy)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "validation_split" not in plain["manifest"]["alignment"]
    assert "task_directions" not in plain["manifest"]["alignment"]


def test_task_terms_need_the_val_train_split(tmp_path, caplog):
    with pytest.raises(ValueError, match="val_train_fraction > 0"):
        fit(tmp_path, "nosplit", data={"val_train_fraction": 0.0}, val_grad_weight=1.0)
    for bad, msg in (({"score_loss": "spearman"}, "score_loss"), ({"task_reduction": "min"}, "task_reduction"),
                     ({"val_grad_weight": -1.0}, "val_grad_weight"), ({"score_refresh_every": 0}, "score_refresh_every"),
                     ({"val_examples_per_task": 1.5}, "val_examples_per_task"), ({"val_grad_chunk": 0}, "val_grad_chunk")):
        with pytest.raises(ValueError, match=msg):
            AlignConfig(**bad)


def test_keep_best_refuses_to_judge_task_terms_by_the_held_out_alignment_loss():
    """The held-out ``val/loss`` is L_GA + λ_KL·L_KL, which the task terms trade for the ranking: keep_best on it
    kept the step-0 factors of the issue-22 ``+score1`` row. A task term with keep_best needs a fidelity monitor."""
    from iprox_lightning.errors import UserInputError
    from iprox_lightning.alignment.module import AlignConfig as AlignmentConfig

    for terms in ({"score_weight": 1.0}, {"val_grad_weight": 0.5}):
        with pytest.raises(UserInputError, match="cannot judge the task terms"):
            AlignmentConfig(**terms)
        with pytest.raises(UserInputError, match="cannot judge the task terms"):
            AlignmentConfig(monitor="val/l_ga", **terms)
        ok = AlignmentConfig(fidelity_examples=16, fidelity_per_task=True, monitor="val/fidelity_worst_loss", **terms)
        assert ok.task_terms and ok.keep_best
        assert AlignmentConfig(keep_best=False, **terms).task_terms
    assert AlignmentConfig().monitor == "val/loss"  # without task terms the default stands
