"""The whole method end to end on the built-in data, through the same configs users run."""
import json

import pytest

from iprox_lightning.analysis.score_table import read_scores
from iprox_lightning.cli import main
from iprox_lightning.pipeline import pipeline


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    wd = tmp_path_factory.mktemp("pipeline")
    summary = pipeline(workdir=str(wd))
    return wd, summary


def test_pipeline_selects_like_the_target(run):
    wd, s = run
    for path in ("warmup/model/config.json", "proxy/model/iprox_proxy.json", "scores/target/scores.parquet",
                 "scores/proxy/scores.parquet", "selected/proxy.jsonl", "finetune/model/config.json", "summary.json"):
        assert (wd / path).exists(), path
    assert s["proxy_params"] < 0.7 * s["target_params"]
    o = s["oracle"]
    # the built-in validation families are 1/3 of the pool: a random 5% selection lands near that
    assert abs(o["base_rate"] - 1 / 3) < 0.01
    assert o["random_selection"] < 0.55
    assert o["target_selection"] >= 0.9
    assert o["proxy_selection"] >= 0.9
    assert s["retention_proxy_vs_target"]["spearman"] > 0.8
    assert abs(s["retention_random_vs_target"]["spearman"]) < 0.15
    # selection size: 5% of the 2000-example pool, ids kept
    ids = [json.loads(l)["id"] for l in open(wd / "selected" / "proxy.jsonl")]
    assert len(ids) == 100 and len(set(ids)) == 100
    top = sorted(read_scores(wd / "scores" / "proxy" / "scores.parquet").items(), key=lambda kv: (-kv[1], kv[0]))[:100]
    assert set(ids) == {i for i, _ in top}


def test_pipeline_resumes_without_rerunning(run, capsys):
    wd, s = run
    again = pipeline(workdir=str(wd))
    out = capsys.readouterr().out
    assert out.count("already done") == 5  # warmup, build_proxy, 2 x score, finetune: nothing re-ran
    assert again["retention_proxy_vs_target"] == s["retention_proxy_vs_target"]
    assert again["oracle"] == s["oracle"]


def test_proxy_check_and_report_commands(run, capsys, tmp_path):
    wd, s = run
    row = main(["check", "--target", str(wd / "warmup" / "model"), "--proxy", str(wd / "proxy" / "model"),
                "--sample", "120", "--output", str(tmp_path / "check.json")])
    assert row["n"] == 120 and row["spearman"] > 0.8
    assert json.loads((tmp_path / "check.json").read_text())[0]["spearman"] == row["spearman"]
    rows = main(["report", "--target_scores", str(wd / "scores" / "target" / "scores.parquet"),
                 "--proxy_scores", json.dumps({"iprox": str(wd / "scores" / "proxy" / "scores.parquet"),
                                               "random": str(wd / "scores" / "random" / "scores.parquet")}),
                 "--target_model", str(wd / "warmup" / "model"),
                 "--proxy_models", json.dumps({"iprox": str(wd / "proxy" / "model")}),
                 "--gradient_model", str(wd / "warmup" / "model"), "--max_examples", "400",
                 "--output_dir", str(tmp_path / "report")])
    by = {r["proxy"]: r for r in rows}
    assert by["iprox"]["spearman"] == pytest.approx(s["retention_proxy_vs_target"]["spearman"])
    assert by["iprox"]["TFLOPs_scoring"] > 0 and "SA" in by["iprox"] and "1-NND" in by["target"]
    assert (tmp_path / "report" / "report.md").read_text().startswith("| proxy |")
    assert (tmp_path / "report" / "scatter_iprox.png").stat().st_size > 5000
