"""bf16 vs float32 on a real model, every stage through the product's commands (issue 54, deliverable 1).

Each stage is ``python train.py <command>`` with the shipped config and a generated overlay (``OUT/configs/``), run
one at a time under ``flock /tmp/iprox-heavy.lock`` (one heavy process machine-wide). Stages, in order of priority:

1. ``sample``: ``train.py sample_pool`` draws ``--sample`` pool examples (stratified by ``source``);
2. ``warmup:32-true``: the target warmed up (``configs/warmup.yaml``, a ``--warmup-fraction`` share of the pool);
3. ``score:<method>:<precision>``: the warmed target scores the sample (``configs/score.yaml``, per task) under each
   precision, TracIn and K-FAC;
4. ``store:<precision>``: ``train.py build_store --precision P`` of the sample and ``train.py query`` of the same
   validation set;
5. ``build:<precision>``: a short proxy build (``configs/build_proxy.yaml``: Stage 1, then ``--align-steps`` steps of
   Stage 2 and one held-out check) -> Stage-1 health (manifest) and the alignment losses (CSV log);
6. ``warmup:bf16-mixed``: the same warm-up under bf16-mixed, and both warmed models' held-out loss in float32
   (``train.py validate``).

Results: ``RESULTS/results.json`` after every stage (``stages``: each command, seconds; ``spearman``: per score
table, Spearman with the float32 table of the same method, per task and pooled).

    python bench/bf16.py --out /tmp/bf16run --results bench/results/bf16
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
LOCK = "/tmp/iprox-heavy.lock"


def spearman_by_column(a_path: Path, b_path: Path) -> dict:
    """Spearman of two score tables over their common ids, per score column (``score``, ``score/<task>``)."""
    import pandas as pd
    from scipy.stats import spearmanr

    a, b = pd.read_parquet(a_path).set_index("id"), pd.read_parquet(b_path).set_index("id")
    ids = a.index.intersection(b.index)
    cols = [c for c in a.columns if (c == "score" or c.startswith("score/")) and c in b.columns]
    out = {}
    for c in cols:
        x, y = a.loc[ids, c].to_numpy(), b.loc[ids, c].to_numpy()
        out[c] = float(spearmanr(x, y).statistic)
    out["n"] = int(len(ids))
    tasks = [v for k, v in out.items() if k.startswith("score/")]
    out["worst_task"] = min(tasks) if tasks else None  # no task column in common (a store's subtasks vs tasks)
    return out


def last_metrics(csv_dir: Path) -> dict:
    """The last value of every metric in a CSVLogger run's ``metrics.csv`` (and the first of ``val/*``)."""
    import pandas as pd

    files = sorted(csv_dir.rglob("metrics.csv"))
    if not files:
        return {}
    df = pd.read_csv(files[-1])
    out = {}
    for c in df.columns:
        if c in ("step", "epoch"):
            continue
        s = df[c].dropna()
        if len(s):
            out[c] = {"last": float(s.iloc[-1]), "first": float(s.iloc[0]), "n": int(len(s))}
    return out


class Run:
    def __init__(self, args):
        self.a = args
        self.out = Path(args.out)
        self.res_dir = Path(args.results)
        self.out.mkdir(parents=True, exist_ok=True)
        self.res_dir.mkdir(parents=True, exist_ok=True)
        path = self.res_dir / "results.json"
        self.results = json.loads(path.read_text()) if path.exists() else {}
        self.results["args"] = vars(args)
        self.results.setdefault("stages", {})
        self.results.setdefault("spearman", {})

    def save(self):
        (self.res_dir / "results.json").write_text(json.dumps(self.results, indent=2))
        (self.res_dir / "results.md").write_text(markdown(self.results))

    def overlay(self, name: str, content: dict) -> Path:
        p = self.out / "configs" / f"{name.replace(':', '_')}.yaml"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(content, indent=2))
        return p

    def sh(self, key: str, cmd: list[str], done: Path) -> bool:
        """Run ``cmd`` under the heavy lock unless ``done`` exists; record it. True when it succeeded."""
        if done.exists() and key in self.results["stages"] and self.results["stages"][key].get("rc") == 0:
            return True
        full = ["flock", LOCK, "nice", "-n", "5", sys.executable, "train.py", *cmd]
        print(f"[bf16] {key}: {shlex.join(full)}", flush=True)
        t0 = time.perf_counter()
        log = self.out / "logs" / f"{key.replace(':', '_')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            rc = subprocess.run(full, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
        secs = time.perf_counter() - t0
        self.results["stages"][key] = {"command": shlex.join(["python", "train.py", *cmd]), "seconds": round(secs, 1),
                                       "rc": rc, "started": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                          time.localtime(time.time() - secs))}
        if rc:
            self.results["stages"][key]["error_tail"] = log.read_text()[-2000:]
        self.save()
        print(f"[bf16] {key}: rc {rc}, {secs:.0f} s", flush=True)
        return rc == 0

    def data(self, pool, tokenizer, **extra) -> dict:
        a = self.a
        return {"pool": str(pool), "validation": f"eval:{a.eval_dir}", "tokenizer": str(tokenizer),
                "max_length": a.max_length, "val_per_task": a.val_per_task, **extra}

    def logger(self, name):
        return {"class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(self.out / "csv"), "name": name}}

    # -- stages --------------------------------------------------------------------------------------
    def sample(self) -> Path:
        p = self.out / f"sample{self.a.sample}.jsonl"
        self.sh(f"sample{self.a.sample}", ["sample_pool", "--pool", self.a.pool, "--n", str(self.a.sample), "--output", str(p),
                           "--by", "source", "--seed", "0"], p)
        return p

    def warmup(self, precision: str) -> Path:
        key = f"warmup:{precision}"
        save = self.out / f"warm_{precision}"
        ov = self.overlay(key, {
            "trainer": {"precision": precision, "accelerator": "cpu", "devices": 1, "logger": self.logger(key),
                        "enable_progress_bar": False, "enable_model_summary": False,
                        "default_root_dir": str(self.out / "lightning")},
            "model": {"init_args": {"model": self.a.model, "save_dir": str(save)}},
            "data": {"init_args": self.data(self.a.pool, self.a.model, warmup_fraction=self.a.warmup_fraction,
                                            train_split="warmup", max_length=self.a.warmup_max_length)}})
        if self.sh(key, ["fit", "--config", "configs/warmup.yaml", "--config", str(ov)], save / "config.json"):
            self.results.setdefault("warmup", {})[precision] = {
                "logged": last_metrics(self.out / "csv" / key)}
            self.save()
        return save

    def validate32(self, warm: Path, tag: str) -> None:
        key = f"validate32:{tag}"
        ov = self.overlay(key, {
            "trainer": {"precision": "32-true", "accelerator": "cpu", "devices": 1, "logger": self.logger(key),
                        "enable_progress_bar": False, "enable_model_summary": False,
                        "default_root_dir": str(self.out / "lightning")},
            "model": {"init_args": {"model": str(warm), "save_dir": None}},
            "data": {"init_args": self.data(self.a.pool, warm, max_length=self.a.warmup_max_length)}})
        marker = self.out / "csv" / key
        if self.sh(key, ["validate", "--config", "configs/warmup.yaml", "--config", str(ov)], marker):
            self.results.setdefault("heldout_loss_fp32_eval", {})[tag] = last_metrics(marker)
            self.save()

    def score(self, warm: Path, sample: Path, method: str, precision: str) -> Path:
        key = f"score:{method}:{precision}"
        out = self.out / "scores" / f"{method}_{precision}"
        ov = self.overlay(key, {
            "trainer": {"precision": precision, "accelerator": "cpu", "devices": 1, "logger": False,
                        "enable_progress_bar": False, "enable_model_summary": False,
                        "default_root_dir": str(self.out / "lightning"),
                        "callbacks": [{"class_path": "iprox_lightning.scoring.InfluenceWriter",
                                       "init_args": {"output_dir": str(out)}}]},
            "model": {"init_args": {"model": str(warm), "method": method, "kfac_examples": self.a.kfac_examples}},
            "data": {"init_args": self.data(sample, warm)}})
        self.sh(key, ["predict", "--config", "configs/score.yaml", "--config", str(ov)], out / "scores.parquet")
        return out / "scores.parquet"

    def store(self, warm: Path, sample: Path, precision: str) -> Path:
        key = f"store:{precision}"
        st = self.out / "stores" / precision
        q = self.out / "scores" / f"store_{precision}"
        ok = self.sh(key + ":build", ["build_store", "--model", str(warm), "--output_dir", str(st), "--pool", str(sample),
                                      "--max_length", str(self.a.max_length), "--precision", precision,
                                      "--progress", "false", "--accelerator", "cpu"], st / "store.json")
        if ok:
            self.sh(key + ":query", ["query", "--store", str(st), "--validation", f"eval:{self.a.eval_dir}",
                                     "--val_per_task", str(self.a.val_per_task), "--output_dir", str(q),
                                     "--progress", "false"], q / "scores.parquet")
        return q / "scores.parquet"

    def build(self, warm: Path, precision: str) -> None:
        key = f"build:{precision}"
        save = self.out / "proxies" / precision
        ov = self.overlay(key, {
            "trainer": {"precision": precision, "accelerator": "cpu", "devices": 1, "logger": self.logger(key),
                        "enable_progress_bar": False, "enable_model_summary": False, "max_epochs": 1,
                        "limit_train_batches": self.a.align_steps, "val_check_interval": 1.0,
                        "log_every_n_steps": 1, "default_root_dir": str(self.out / "lightning")},
            "model": {"init_args": {"target": str(warm), "save_dir": str(save)}},
            "data": {"init_args": self.data(self.a.pool, warm, train_split="align")}})
        if self.sh(key, ["fit", "--config", "configs/build_proxy.yaml", "--config", str(ov)],
                   save / "iprox_proxy.json"):
            man = json.loads((save / "iprox_proxy.json").read_text())
            self.results.setdefault("build", {})[precision] = {
                "stage1_health": _find(man, "health"), "logged": last_metrics(self.out / "csv" / key)}
            self.save()

    def compare(self, name: str, ref: Path, other: Path) -> None:
        if ref.exists() and other.exists():
            self.results["spearman"][name] = spearman_by_column(ref, other)
            self.save()
            print(f"[bf16] spearman {name}: {self.results['spearman'][name]}", flush=True)


def markdown(results: dict) -> str:
    """The table of ``docs/BENCHMARKS.md`` (bf16 vs float32) from ``results.json``: Spearman per task (a store's per
    subtask: its worst), then one line each for the short proxy builds and the warm-ups."""
    rows = ["| scores | precision | Spearman with float32 per task (worst) | pooled `score` | examples |",
            "|---|---|---|---|---|"]
    for name, r in results.get("spearman", {}).items():
        what, _, prec = name.partition(":")
        tasks = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("score/")}
        shown = (", ".join(f"{k} {v:.4f}" for k, v in tasks.items()) if len(tasks) <= 4 else
                 f"{len(tasks)} subtasks")
        worst = "—" if r["worst_task"] is None else format(r["worst_task"], ".4f")
        rows.append(f"| {what} | {prec or '32-true'} | {shown} (**{worst}**) | {r.get('score', float('nan')):.4f} "
                    f"| {r['n']} |")
    lines = ["\n".join(rows)]

    def last(v, key):
        x = v.get("logged", {}).get(key)
        return None if x is None else round(x["last"], 4)

    builds = results.get("build", {})
    if builds:
        health = {p: (v.get("stage1_health") or {}).get("health", {}) for p, v in builds.items()}
        lines.append("- short proxy build (held-out `val/l_ga`, `val/loss` after alignment; Stage-1 health proxy / target "
                     "loss, KL): " + "; ".join(
                         f"{p}: {last(v, 'val/l_ga')}, {last(v, 'val/loss')}; {health[p].get('proxy_loss', 0):.3f} / "
                         f"{health[p].get('target_loss', 0):.3f}, {health[p].get('kl', 0):.3f}" for p, v in builds.items()))
    warm, evals = results.get("warmup", {}), results.get("heldout_loss_fp32_eval", {})
    if warm:
        lines.append("- warm-up (held-out loss in its precision; evaluated in float32): " + "; ".join(
            f"{p}: {last(v, 'val/loss')}; {last({'logged': evals.get(p, {})}, 'val/loss')}" for p, v in warm.items()))
    return "\n".join(lines) + "\n"


def _find(obj, word):
    """Every entry of a nested dict whose key contains ``word``."""
    found = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if word in k:
                found[k] = v
            else:
                sub = _find(v, word)
                if sub:
                    found[k] = sub
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--pool", default=str(SHARED / "data" / "pool" / "instructions.jsonl"))
    ap.add_argument("--eval-dir", default=str(SHARED / "data" / "eval"))
    ap.add_argument("--sample", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--warmup-max-length", type=int, default=256)
    ap.add_argument("--warmup-fraction", type=float, default=0.01)
    ap.add_argument("--no-warmup", action="store_true",
                    help="score and build from the target as shipped (the warm-up took > 35 min on a shared 2-core CPU)")
    ap.add_argument("--val-per-task", type=int, default=16)
    ap.add_argument("--kfac-examples", type=int, default=128)
    ap.add_argument("--align-steps", type=int, default=12)
    ap.add_argument("--stages", nargs="*", default=["tracin", "kfac", "store", "true_extra", "build", "warmup_bf16"],
                    help="which groups run (always in the order of main(), priority first)")
    ap.add_argument("--summary-only", action="store_true", help="only re-write RESULTS/results.md; run nothing")
    ap.add_argument("--out", required=True, help="work directory (weights, stores: not kept in git)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "bf16"))
    a = ap.parse_args(argv)
    os.chdir(ROOT)
    if a.summary_only:
        res = json.loads((Path(a.results) / "results.json").read_text())
        (Path(a.results) / "results.md").write_text(markdown(res))
        print(markdown(res))
        return res
    r = Run(a)
    sample = r.sample()
    warm = Path(a.model) if a.no_warmup else r.warmup("32-true")
    if "tracin" in a.stages:
        ref = r.score(warm, sample, "tracin", "32-true")
        r.compare("tracin:bf16-mixed", ref, r.score(warm, sample, "tracin", "bf16-mixed"))
    if "kfac" in a.stages:
        ref = r.score(warm, sample, "kfac", "32-true")
        r.compare("kfac:bf16-mixed", ref, r.score(warm, sample, "kfac", "bf16-mixed"))
    if "store" in a.stages:
        ref = r.store(warm, sample, "32-true")
        r.compare("store:bf16-mixed", ref, r.store(warm, sample, "bf16-mixed"))
        exact = r.out / "scores" / "tracin_32-true" / "scores.parquet"
        r.compare("store32_vs_exact32", exact, ref)
    if "true_extra" in a.stages:
        r.compare("tracin:bf16-true", r.out / "scores" / "tracin_32-true" / "scores.parquet",
                  r.score(warm, sample, "tracin", "bf16-true"))
        ref = r.out / "scores" / "kfac_32-true" / "scores.parquet"
        r.compare("kfac:bf16-true", ref, r.score(warm, sample, "kfac", "bf16-true"))
        r.compare("store:bf16-true", r.out / "scores" / "store_32-true" / "scores.parquet",
                  r.store(warm, sample, "bf16-true"))
    if "build" in a.stages:
        for p in ("32-true", "bf16-mixed"):
            r.build(warm, p)
    if "warmup_bf16" in a.stages:
        wb = r.warmup("bf16-mixed")
        r.validate32(warm, "32-true")
        r.validate32(wb, "bf16-mixed")
    print(json.dumps(r.results["spearman"], indent=1))


if __name__ == "__main__":
    main()
