"""Issue 12: the pipeline summary states method, ρ, each reused stage with its fingerprint, the stages that ran
and the truncation drops, line by line (no model needed: the ledger and the score settings are the inputs)."""
from __future__ import annotations

import json

from iprox_lightning.io.score_dir import write_settings
from iprox_lightning.io.stages import StageLedger, format_provenance, pipeline_provenance


def _ledger(wd, cfg, done):
    ledger = StageLedger(wd, {"target": "builtin", "pool": "builtin", "validation": "builtin"})
    fps = {}
    fps["warmup"] = ledger.prepare("warmup", [cfg], {"model": {"init_args": {"save_dir": "w"}}})
    reused_w = ledger.reuse("warmup", done["warmup"])
    fps["build_proxy"] = ledger.prepare("build_proxy", [cfg], {"trainer": {"callbacks": [{"init_args": {"sparsity": 0.3}}]}},
                                        upstream=("warmup",))
    reused_b = ledger.reuse("build_proxy", done["build_proxy"])
    fps["score:proxy"] = ledger.prepare("score:proxy", [cfg], {"model": {"init_args": {"method": "kfac"}}},
                                        upstream=("warmup", "build_proxy"))
    reused_s = ledger.reuse("score:proxy", done["score:proxy"])
    return ledger, fps, (reused_w, reused_b, reused_s)


def test_summary_lines_state_method_rho_reused_fingerprints_and_truncation(tmp_path):
    wd = tmp_path / "wd"
    cfg = tmp_path / "stage.yaml"
    cfg.write_text("seed_everything: 0\n")
    done = {k: wd / k / "out.txt" for k in ("warmup", "build_proxy", "score:proxy")}

    # first run: every stage runs and is recorded
    ledger, fps, reused = _ledger(wd, cfg, done)
    assert reused == (False, False, False)
    for k in ("warmup", "build_proxy"):
        done[k].parent.mkdir(parents=True)
        done[k].write_text("x")
        ledger.record(k)

    # second run: warmup and build_proxy reused (outputs and records exist), score:proxy runs
    ledger2, fps2, reused2 = _ledger(wd, cfg, done)
    assert reused2 == (True, True, False) and fps2 == fps
    scores = {"target": tmp_path / "scores_t", "proxy": tmp_path / "scores_p"}
    write_settings(scores["target"], {"data": {"pool": {"read": 10, "dropped": 0, "kept": 10, "dropped_ids": [],
                                                        "max_length": 64, "truncation": "right"}}})
    write_settings(scores["proxy"], {"data": {
        "pool": {"read": 10, "dropped": 4, "kept": 6, "dropped_ids": ["p1", "p2", "p3", "p4"], "max_length": 64,
                 "truncation": "right"},
        "validation": {"read": 5, "dropped": 1, "kept": 4, "dropped_ids": ["v9"], "max_length": 64,
                       "truncation": "right"}}})
    prov = pipeline_provenance(ledger2, method="kfac", sparsity=0.3, score_dirs=scores, proxy_validation="proxy")

    assert prov["method"] == "kfac" and prov["sparsity"] == 0.3 and prov["proxy_validation"] == "proxy"
    assert prov["stages"] == {"warmup": {"status": "reused", "fingerprint": fps["warmup"]},
                              "build_proxy": {"status": "reused", "fingerprint": fps["build_proxy"]},
                              "score:proxy": {"status": "ran", "fingerprint": fps["score:proxy"]}}
    assert prov["truncation_dropped"]["proxy"]["pool"] == {"dropped": 4, "dropped_ids": ["p1", "p2", "p3", "p4"],
                                                           "max_length": 64, "truncation": "right"}
    assert format_provenance(prov) == [
        "method / sparsity : kfac / rho = 0.3",
        "proxy validation  : the proxy's validation gradients",
        f"stages reused     : warmup ({fps['warmup'][:12]}), build_proxy ({fps['build_proxy'][:12]}) (fingerprints match)",
        "stages run        : score:proxy",
        "dropped by truncation (no response token left): proxy pool 4 (e.g. p1, p2, p3); proxy validation 1 (e.g. v9)",
    ]
    # the summary keeps the full fingerprints (the line shows their first 12 characters)
    assert all(len(v["fingerprint"]) > 12 for v in json.loads(json.dumps(prov))["stages"].values())


def test_summary_lines_without_reuse_or_drops(tmp_path):
    cfg = tmp_path / "stage.yaml"
    cfg.write_text("a: 1\n")
    ledger = StageLedger(tmp_path / "wd", {"pool": "builtin"})
    ledger.prepare("warmup", [cfg], {})
    assert ledger.reuse("warmup", tmp_path / "missing") is False
    write_settings(tmp_path / "s", {"data": {"pool": {"read": 3, "dropped": 0, "kept": 3, "dropped_ids": []}}})
    prov = pipeline_provenance(ledger, method="tracin", sparsity=0.5, score_dirs={"proxy": tmp_path / "s"})
    assert format_provenance(prov) == ["method / sparsity : tracin / rho = 0.5",
                                       "proxy validation  : the target's validation gradients", "stages run        : warmup"]
