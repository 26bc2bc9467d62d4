"""``plan --fit`` and ``pipeline --plan``: the ordered search over the memory levers ``plan`` counts
(``iprox_lightning/analysis/fit.py``), priced by ``plan``'s own stage functions, its overlay, and the target table."""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest

from iprox_lightning.analysis import fit as F
from iprox_lightning.analysis import memory as M
from iprox_lightning.errors import UserInputError

ROOT = Path(__file__).resolve().parents[1]
PAPER = dict(precision="bf16-mixed", max_length=512, batch_size=8, align_batch_size=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A small Llama config directory (4 layers: the search's candidates are priced in milliseconds)."""
    from iprox_lightning.models.tiny import tiny_config

    d = tmp_path_factory.mktemp("model")
    tiny_config(hidden_size=128, intermediate_size=256, num_layers=4, vocab_size=2048).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def counts(model):
    run = M.RunSettings(**PAPER)
    return run, M.model_counts(model, run)


def _stages(counts, run):
    sizes, acts, acts32 = counts[1]
    return {s.stage: s for s in M.plan_stages(sizes, None, run, acts=acts, acts32=acts32)}


@pytest.mark.parametrize("settings", [
    {},
    dict(devices=4, strategy="fsdp", micro_batch_size=2, gradient_checkpointing=True, fsdp_cpu_offload=True,
         probe_group_layers=5, align_micro_batch_size=1, kfac_partitions=4, kfac_offload=True, batch_size=2,
         validation_gradients={"dtype": "bfloat16", "device": "cpu", "column_groups": 2}, tasks=5,
         store_gradient_checkpointing=True),
])
def test_the_search_prices_each_stage_with_plans_own_rows(counts, settings):
    """The fit's per-stage functions give plan_stages' rows, part by part (the search prices one stage at a time)."""
    run = dataclasses.replace(counts[0], **settings)
    sizes, acts, acts32 = counts[1]
    fns = F.stage_functions(sizes, acts, acts32, run)
    rows = _stages(counts, run)
    assert list(fns) == list(rows)
    for name, fn in fns.items():
        assert fn(run).parts == rows[name].parts, name


def test_the_fit_is_the_first_candidate_in_order_that_fits(counts):
    """Against a brute force over the ordered candidates: at a device memory between each stage's lowest and its
    configs' peak, the fit is the first candidate whose peak fits (levers chosen, the peak within the device); the
    batch is the largest at the chosen levers."""
    run = counts[0]
    sizes, acts, acts32 = counts[1]
    fns = F.stage_functions(sizes, acts, acts32, run)
    for name, fn in fns.items():
        tried = [(c, fn(dataclasses.replace(run, **{**F.LEVERS_OFF, **c})).peak)
                 for c in F.candidates(name, sizes, dataclasses.replace(run, **F.LEVERS_OFF))]
        low, high = min(p for _, p in tried), tried[0][1]
        if low == high:
            continue
        memory = (low + high) / 2
        first = next(c for c, p in tried if p <= memory)
        f = F.fit_stage(name, fn, sizes, run, memory)
        assert f.fits and f.plan.peak <= memory < f.base.peak, name
        assert f.settings == F._changed(first, dataclasses.replace(run, **F.LEVERS_OFF)) != {}, name
        assert f.levers, name


def test_nothing_fits_gives_the_lowest_setting_and_its_largest_parts(counts):
    run = counts[0]
    sizes, acts, acts32 = counts[1]
    fn = F.stage_functions(sizes, acts, acts32, run)["warm-up"]
    f = F.fit_stage("warm-up", fn, sizes, run, 1e6)
    peaks = [fn(dataclasses.replace(run, **{**F.LEVERS_OFF, **c})).peak
             for c in F.candidates("warm-up", sizes, run)]
    assert not f.fits and f.plan.peak == min(peaks)
    assert f.settings == {"gradient_checkpointing": True, "micro_batch_size": 1}
    top = max(f.plan.parts, key=f.plan.parts.get)
    assert f"largest: {top}" in F.reason(f, 1e6)


def test_a_stage_that_fits_at_no_lever_names_the_nearest_run_setting_it_fits_at(model, counts):
    """Stage 2 on a device between its lowest peak at T 256 and at T 384 (the paper's T 512 fits at no lever): the
    nearest settings named are T 256 (the first T, longest first, at which the search fits; at T 448 and 384 it
    does not) and bf16-true where it fits; each is the fit the search gives at that setting."""
    run = counts[0]
    stage = F.STAGE2

    def lowest(**over):
        alt = dataclasses.replace(run, **over)
        return F.fit_stages(*M.model_counts(model, alt), alt, 1.0, [stage])[0].plan.peak

    at = {t: lowest(max_length=t) for t in (512, 448, 384, 256)}
    assert at[512] > at[448] > at[384] > at[256]
    memory = (at[384] + at[256]) / 2
    report = F.fit_report(*counts[1], run, memory, model=model)
    f = next(f for f in report["stages"] if f.stage == stage)
    assert not f.fits
    near = {tuple(n["setting"].items())[0]: n for n in f.nearest_fitting}
    assert ("max_length", 256) in near and not any(k == "max_length" and v != 256 for k, v in near)
    bf16 = lowest(precision="bf16-true")
    assert (("precision", "bf16-true") in near) == (bf16 <= memory)
    for (key, value), n in near.items():
        alt = dataclasses.replace(run, **{key: value})
        again = F.fit_stages(*M.model_counts(model, alt), alt, memory, [stage])[0]
        assert again.fits and n["peak"] == again.plan.peak <= memory and n["settings"] == again.settings
    assert "fits at max_length 256" in "\n".join(F.table_lines(report["stages"], memory, run.method))
    assert f.to_dict(memory)["nearest_fitting"] == f.nearest_fitting


def test_a_roomy_device_needs_no_lever_and_no_overlay(counts):
    run = counts[0]
    report = F.fit_report(*counts[1], run, 1e13)
    assert all(f.fits and f.settings == {} and f.plan.peak == f.base.peak for f in report["stages"])
    assert report["overlay"] == {"stages": {}, "build_store": [], "plan": []}
    assert not report["tracin"]["to_store"]


def test_tracin_goes_to_the_store_when_its_columns_need_passes(counts):
    """93 columns: where the validation gradients fit only in column groups, the fit says exact TracIn goes to the
    store, in how many passes, at the store build's peak."""
    run = dataclasses.replace(counts[0], tasks=93)
    sizes, acts, acts32 = counts[1]
    fn = F.stage_functions(sizes, acts, acts32, run)["scoring (tracin)"]
    host = dataclasses.replace(run, batch_size=1, validation_gradients={"dtype": "bfloat16", "device": "cpu"})
    groups = dataclasses.replace(host, validation_gradients={"dtype": "bfloat16", "device": "cpu", "column_groups": 93})
    memory = (fn(host).peak + fn(groups).peak) / 2  # one pass does not fit, 93 passes do
    tracin, store = F.fit_stages(sizes, acts, acts32, run, memory, ["scoring (tracin)", F.STORE])
    passes = tracin.settings["validation_gradients"]["column_groups"]
    assert tracin.fits and passes > 1
    route = F.tracin_route(sizes, run, memory, tracin, store)
    assert route["to_store"] and route["exact_passes"] == passes
    assert f"{passes} passes over the pool" in route["why"]


def _plan(args, capsys):
    """``(exit code, stdout, the error line)`` of ``train.py plan args`` (in this process: a user error is raised)."""
    from iprox_lightning.cli import main

    try:
        main(["plan", *args])
        code, err = 0, ""
    except UserInputError as e:
        code, err = 2, f"error: {e}"
    return code, capsys.readouterr().out, err


def test_plan_fit_prints_an_overlay_that_plan_accepts(model, counts, capsys, tmp_path):
    """Through the CLI: a device that the configs' settings overflow; --fit chooses levers (the batch kept: micro-
    batches) and prints plan's flags for them, with which plan refuses nothing; the stage overlays are the stages'
    YAML keys."""
    base = ["--model", model, "--precision", "bf16-mixed", "--accelerator", "cuda"]
    run = counts[0]
    rows = _stages(counts, run)
    memory = str(int(rows["warm-up"].peak * 0.7))  # warm-up and fine-tune overflow at the configs' batch
    code, _, _ = _plan(base + ["--device_memory", memory], capsys)
    assert code == 2
    code, out, err = _plan(base + ["--device_memory", memory, "--fit", "true", "--output", str(tmp_path / "p.json")],
                           capsys)
    assert code == 0, err
    written = json.loads((tmp_path / "p.json").read_text())["fit"]
    assert [s["stage"] for s in written["stages"]] == list(_stages(counts, run))
    assert written["overlay"]["stages"]["warmup"]["model"]["init_args"]["micro_batch_size"] < 8
    lines = out.splitlines()
    plan_line = next(l for l in lines if l.strip().startswith("plan:        python train.py plan"))
    flags = shlex.split(plan_line.split("python train.py plan", 1)[1])
    assert "--micro_batch_size" in flags
    code, _, err = _plan(flags, capsys)
    assert code == 0, err
    warm = next(l for l in lines if l.strip().startswith("warmup:"))
    overlay = json.loads(shlex.split(warm.split("--config configs/warmup.yaml --config", 1)[1])[0])
    assert set(overlay["model"]["init_args"]) <= {"micro_batch_size", "gradient_checkpointing"}
    pipe = next(l for l in lines if l.strip().startswith("pipeline:"))
    assert json.loads(shlex.split(pipe.split("--plan", 1)[1])[0])["warmup"] == overlay


def test_plan_fit_refuses_what_fits_at_no_setting(model, capsys):
    code, out, err = _plan(["--model", model, "--device_memory", "0.1MB", "--fit", "true"], capsys)
    assert code == 2 and "fits 0.10 MiB (0.1MB) at no setting" in err and "nearest:" in err and "largest:" in err
    assert "  warm-up " in out.split("fit: ", 1)[1]  # the fit's table is printed before the refusal
    code, _, err = _plan(["--model", model, "--fit", "true"], capsys)
    assert code == 2 and "--fit true needs --device_memory" in err


def _demo_plan(plan, device_memory=None, **kw):
    from iprox_lightning.workflow.plan import stage_plan

    args = dict(target="builtin", hardware={"accelerator": "cpu", "devices": 1}, config_dir=None, demo=True,
                data_args={"pool": "builtin", "validation": "builtin", "seed": 0}, sparsity=0.5, align_epochs=None,
                method="tracin", lora=None, validation="builtin")
    return stage_plan(plan, device_memory, **{**args, **kw})


def test_pipeline_plan_auto_on_the_demo(capsys):
    """On the host's memory the demo needs nothing (its stages keep their overlays and fingerprints); on a forced
    small device the fit chooses micro-batches (accumulated to the configs' batch), probe groups and a smaller
    scoring batch, as the stage configs' keys; the same overlay may be given as --plan."""
    assert _demo_plan("auto") == {}
    assert "nothing changed" in capsys.readouterr().out
    small = _demo_plan("auto", "13MB")
    assert "every stage fits" in capsys.readouterr().out
    assert small["warmup"]["model"]["init_args"]["micro_batch_size"] in (1, 2, 4)
    assert small["build_proxy"]["model"]["init_args"]["micro_batch_size"] in (1, 2)
    assert small["build_proxy"]["trainer"]["callbacks"][0]["init_args"]["probe_group_layers"] >= 1
    assert small["score"]["data"]["init_args"]["batch_size"] < 32
    assert _demo_plan(small) == small
    with pytest.raises(UserInputError, match="fits .* at no setting"):
        _demo_plan("auto", "1MB")
    with pytest.raises(UserInputError, match="plan must be auto"):
        _demo_plan("yes")
    with pytest.raises(UserInputError, match="an overlay per stage config"):
        _demo_plan({"evaluate": {}})
    with pytest.raises(UserInputError, match="pass --plan auto too"):
        _demo_plan(None, "13MB")


def test_pipeline_plan_auto_follows_proxy_validation(capsys):
    """``pipeline --plan auto --proxy_validation proxy`` plans the proxy's scoring against its own validation gradients
    (no target held): Llama-3.2-1B on 8 devices of 21 GB under FSDP (the proxy's scoring is DDP: both models on every
    rank), where with the target's validation gradients (the default) the proxy's row needs a validation batch below
    the scoring batch and with its own needs none; each overlay is the fit of its own run's rows."""
    kw = dict(target="llama-3.2-1b", demo=False,
              hardware={"accelerator": "gpu", "devices": 8, "strategy": "fsdp", "precision": "bf16-mixed"})
    plans, proxy_rows = {}, {}
    for pv in ("target", "proxy"):
        plans[pv] = _demo_plan("auto", "21GB", proxy_validation=pv, **kw)["score"]
        proxy_rows[pv] = capsys.readouterr().out.split("scoring with the proxy (tracin): ", 1)[1].split(" | ")[0]
        runs, sizes_of = F.pipeline_runs(_pipeline_configs(), target=kw["target"], hardware=kw["hardware"],
                                         sparsity=0.5, align_epochs=None, method="tracin", lora=None,
                                         validation="builtin", proxy_validation=pv)
        (run,) = [r for stages, r in runs if M.PROXY_SCORING in stages]
        (f,) = F.fit_stages(*sizes_of(run), run, M.parse_bytes("21GB"), [M.PROXY_SCORING])
        assert run.proxy_validation == pv and proxy_rows[pv] == "; ".join(f.levers)
    vb = plans["target"]["model"]["init_args"]["validation_batch_size"]
    assert 1 <= vb < plans["target"]["data"]["init_args"]["batch_size"]
    assert "validation_batch_size" not in json.dumps(plans["proxy"]) and "validation_batch_size" in proxy_rows["target"]


def _pipeline_configs() -> dict:
    """The stage configs as ``pipeline --plan auto`` merges them (no demo overlays), with the demo's data arguments."""
    import yaml

    out = {}
    for name in ("warmup", "build_proxy", "score", "finetune"):
        cfg = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
        data = {"pool": "builtin", "validation": "builtin", "seed": 0}
        out[name] = F.merge_overlay(cfg, {"data": {"init_args": data}})
    return out


def test_pipeline_passes_its_proxy_validation_to_the_plan(tmp_path, monkeypatch):
    """Through the CLI: ``pipeline --plan auto --proxy_validation proxy`` hands its setting to the plan (stopped there,
    before any stage runs)."""
    from iprox_lightning.cli import main
    from iprox_lightning.workflow import pipeline as P

    seen = []

    class Stop(Exception):
        pass

    def spy(*args, **kwargs):
        seen.append(kwargs["proxy_validation"])
        raise Stop

    monkeypatch.setattr(P, "stage_plan", spy)
    for pv in ("proxy", "target"):
        with pytest.raises(Stop):
            main(["pipeline", "--workdir", str(tmp_path / pv), "--plan", "auto", "--device_memory", "13MB",
                  "--proxy_validation", pv])
    assert seen == ["proxy", "target"] and not (tmp_path / "proxy").exists()


def test_a_stage_overlay_merges_into_the_pipelines_callbacks():
    base = {"trainer": {"callbacks": [{"class_path": F.IPSVD_CALLBACK, "init_args": {"sparsity": 0.5}}]},
            "model": {"init_args": {"target": "w"}}}
    extra = {"trainer": {"callbacks": [{"class_path": F.IPSVD_CALLBACK, "init_args": {"probe_group_layers": 2}}]},
             "model": {"init_args": {"micro_batch_size": 1}}}
    assert F.merge_overlay(base, extra) == {
        "trainer": {"callbacks": [{"class_path": F.IPSVD_CALLBACK, "init_args": {"sparsity": 0.5, "probe_group_layers": 2}}]},
        "model": {"init_args": {"target": "w", "micro_batch_size": 1}}}
    assert F.merge_overlay(base, {}) == base


def test_the_target_table_is_what_the_plan_gives_today():
    """bench/results/plan/targets.json (the README's table, bench/tables.py --check) is the fit of today's plan: a
    change to the plan's model fails here until ``python bench/plan_targets.py`` and ``python bench/tables.py``."""
    sys.path.insert(0, str(ROOT / "bench"))
    import plan_targets

    assert plan_targets.main(["--check"]) == 0


def test_the_fits_build_store_line_runs_sharded_where_the_plan_priced_it_so(capsys):
    """Under ``--strategy fsdp`` on several devices the plan prices the store build sharded per block (the shard,
    the root and two gathered blocks), so the printed ``build_store`` command carries ``--strategy fsdp``; under DDP
    (each process holding the whole model) it does not."""
    from iprox_lightning.cli import main

    common = ["plan", "--model", "llama-3.2-1b", "--devices", "8", "--precision", "bf16-mixed", "--max_length", "512",
              "--device_memory", "80GB", "--fit", "true", "--speed_results", "/nonexistent"]
    lines = {}
    for strategy in ("fsdp", "ddp"):
        main([*common, "--strategy", strategy])
        lines[strategy] = [l for l in capsys.readouterr().out.splitlines() if "train.py build_store" in l]
    assert len(lines["fsdp"]) == 1 and lines["fsdp"][0].endswith("--strategy fsdp")
    assert not any("--strategy" in l for l in lines["ddp"])


def test_the_fit_scores_several_checkpoints_in_turn_before_any_dearer_lever(model, capsys, tmp_path):
    """LESS over 4 checkpoints (``--method less --checkpoints 4``, 2,000 score columns) on a device that their
    batch-by-batch scoring overflows at any batch and one checkpoint at a time fits at the configs' batch: the fit
    takes ``checkpoints_in_turn`` alone (the same work, no other holding), prints it as the score stage's
    ``model.init_args`` and as ``plan``'s flag, which price it so."""
    lora = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    run = M.RunSettings(**PAPER, method="less", checkpoints=4, tasks=2000, lora=M.with_lora_targets(lora, model))
    sizes, acts, acts32 = M.model_counts(model, run)
    together = M.less_scoring_plan(sizes, acts, dataclasses.replace(run, batch_size=1))
    in_turn = M.less_scoring_plan(sizes, acts, dataclasses.replace(run, checkpoints_in_turn=True))
    assert in_turn.peak < together.peak
    memory = (in_turn.peak + together.peak) / 2
    (f,) = F.fit_stages(sizes, acts, acts32, run, memory, ["scoring (less)"])
    assert f.fits and f.settings == {"checkpoints_in_turn": True} and f.plan.peak == in_turn.peak
    assert F.lever_words(f.settings, run)[0].startswith("model.checkpoints_in_turn true (one of the 4 checkpoints")
    out = F.overlays([f], "less")
    assert out["stages"]["score"]["model"]["init_args"] == {"checkpoints_in_turn": True}
    assert out["plan"] == ["--checkpoints_in_turn", "true"]
    args = ["--model", model, *[a for k, v in PAPER.items() for a in (f"--{k}", str(v))], "--method", "less",
            "--checkpoints", "4", "--tasks", "2000", "--lora", json.dumps(lora), "--output", str(tmp_path / "p.json")]
    code, _, err = _plan(args + out["plan"], capsys)
    assert code == 0, err
    (row,) = [s for s in json.loads((tmp_path / "p.json").read_text())["stages"] if s["stage"] == "scoring (less)"]
    assert row["peak"] == in_turn.peak
