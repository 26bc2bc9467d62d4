"""The pipeline and every baseline / ablation config on the real SmolLM2-135M (slow; small sizes)."""
import json

import pytest

from iprox_lightning.commands.pipeline import pipeline

from test_pipeline import run_all_variants

pytestmark = pytest.mark.slow

DATA = {"max_length": 64, "batch_size": 4, "val_per_task": 2, "construction_fraction": 0.25, "probe_fraction": 0.5,
        "warmup_fraction": 0.05}


def test_pipeline_and_variants_on_smollm(smollm_gguf, shared_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pool = tmp_path / "pool.jsonl"
    with open(shared_dir / "data" / "pool" / "instructions.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows = rows[:: len(rows) // 40][:40]  # 40 examples spread over the file (28 categories, 5 sources)
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {**DATA, "pool": str(pool)}
    wd = tmp_path / "run"
    summary = pipeline(workdir=str(wd), target=str(smollm_gguf), pool=str(pool),
                       validation=f"eval:{shared_dir / 'data' / 'eval'}", data_args=DATA)
    assert summary["proxy_params"] < summary["target_params"]
    assert -1.0 <= summary["retention_proxy_vs_target"]["spearman"] <= 1.0
    res = run_all_variants(wd, tmp_path, demo=False, data=data, base_model=str(smollm_gguf), le_fraction="0.1")
    out = {k: round(v[0], 3) for k, v in res.items()}
    print("SmolLM2 retention (Spearman vs target TracIn):", out)
    (tmp_path.parent / "smollm_variants.json").write_text(json.dumps(out))
    (tmp_path.parent / "smollm_summary.json").write_text(json.dumps(summary, default=str))
