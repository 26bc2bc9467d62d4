"""Downstream effect benchmark: does fine-tuning the warmed target on a selector's subset beat a random subset of
the same size, per target task, on held-out examples? Every step is the product's own stage.

Inputs come from the fidelity benchmark (``bench/fidelity_v2.py``, ``--fidelity``): its warmed target
(``WarmupModule`` on the pool's warm-up split; re-made by that script when its weights are gone), its stratified
pool sample, its validation file (all few-shot examples of MMLU / BBH / TyDiQA, each suite in two halves) and its
score tables (target, proxies, Layer Extraction), so no model is scored twice. Then, one stage at a time:

1. **score tables** the fidelity run does not have: RDS+ (``train.py rds_scores`` with the warmed target), seeded
   random scores (``train.py random_scores``), the length sort (shortest response first, from the target table's
   response-token counts);
2. **select** (``iprox_lightning.selection.select.select``): one subset per target task and selector, ``k`` of the sample,
   ranked by ``--rule`` over that task's score columns (default ``mean``: the suite's score); the task-independent
   selectors (random, length) make one subset used for every task;
3. **fine-tune** the warmed target on each subset (``train.py fit --config configs/finetune.yaml``,
   ``FinetuneModule``, identical settings for every row);
4. **evaluate** (``iprox_lightning.evaluation.heldout``) on held-out examples that never steered a selection:
   MMLU **test** questions, BBH task examples (the validation set holds MMLU dev shots and the BBH CoT exemplars)
   and, for TyDiQA (its GoldP dev file is not available here), **pool XQuAD examples outside the sample and the
   warm-up / construction splits**, formatted as the TyDiQA validation records — multilingual extractive QA of
   the same form, an honest stand-in, labelled ``tydiqa (xquad held-out)``. Metrics per example: ``loss`` (mean
   token NLL of the gold answer, teacher-forced) and ``exact_match`` (greedy decoding reproduces the gold answer);
5. **summary** ``OUT/summary.json``: per task and selector the mean with a percentile bootstrap CI over held-out
   examples, and the paired difference to the mean of the random seeds (positive = better than random, whatever the
   metric's direction) with its paired bootstrap CI; the seed spread (noise floor); each selector's scoring cost;
   the share of each subset from its task's held-out source (TyDiQA: pool XQuAD) and how it tracks the value.
   ``OUT/summary.md`` and (``--docs``) the section of ``docs/BENCHMARKS.md`` are generated from it.

Resumable: every stage is recorded in ``OUT/state.json`` with its fingerprint and skipped when it matches; each
evaluation is cached in ``OUT/evals/`` under its fingerprint; the summary is rewritten after each evaluation.

    python bench/effect.py --out bench/results/effect --threads 2

This file runs the benchmark (held-out sets, the stages, the summary); its other jobs are files of their own:
``effect_selectors.py`` (what a selector string says), ``effect_stats.py`` (the controls and the noise floor) and
``effect_tables.py`` (``summary.md``, the headline and the page sections).
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from fidelity_v2 import DEFAULT_EVAL, DEFAULT_MODEL, DEFAULT_POOL  # bench/: the fidelity run's inputs
from ledger import (Stages, attempts_wall, check_local_inputs, config_text, git_commit, host_info,  # bench/: the ledger
                    logger_overlay, read_kept, recorded_hosts, same_settings, splice_docs)
from variants import TARGET_VALIDATION, dir_name  # bench/: the variant grammar
# the benchmark's three other jobs, each its own file: the selector grammar, the statistics, the tables (their public
# names are this script's too: bench/tables.py and the tests read them here)
from effect_selectors import (DEFAULT_SELECTORS, DEFAULT_SOURCES, FT_SUFFIX, METRICS, TASKS, host_key, is_less, is_rds,  # bench/
                              is_store, json_digest, lenmatch_reference, proxy_weights_digest, run_on_host,
                              split_finetune_seed, split_fresh, split_rule, split_shortlist, split_store_source,
                              store_model, store_source, task_free)
from effect_stats import (finetune_noise, fresh_controls, length_matched_controls, length_vs_effect,  # bench/
                          shortlist_controls)
from effect_tables import (DOCS_BEGIN, DOCS_END, docs_markers, headline_markdown, headline_markers,  # bench/
                           headline_rows, markdown, selector_family, splice_effect_docs)

from iprox_lightning.evaluation import paired_gain, percentile_interval
from iprox_lightning.data import VALIDATION_FORMS, write_records_jsonl  # VALIDATION_FORMS: a form -> its suite
from iprox_lightning.selection import task_columns


# ------------------------------------------------------------------------------------------------
# held-out examples
# ------------------------------------------------------------------------------------------------
def xquad_heldout(pool: str, exclude: set[str], per_language: int, seed: int) -> tuple[list[dict], set[str]]:
    """Pool XQuAD examples outside ``exclude``, ``per_language`` per language, as TyDiQA-form records, and the pool
    categories they were drawn from."""
    from iprox_lightning.data import read_pool, sample_per_group

    by_lang: dict[str, list[dict]] = {}
    for r in read_pool(pool):
        if r["id"].startswith("xquad-") and r["id"] not in exclude:
            by_lang.setdefault(r["id"].split("-")[1], []).append(r)
    out, categories = [], set()
    for lang in sorted(by_lang):
        for r in sample_per_group(by_lang[lang], per_language, seed, f"heldout:xquad:{lang}"):
            categories.add(r["category"])
            out.append({"id": f"heldout-{r['id']}", "category": "tydiqa", "subtask": lang,
                        "instruction": "Answer the following question based on the information in the given passage.",
                        "context": f"Passage: {str(r.get('context') or '').strip()}\nQuestion: {r['instruction'].strip()}",
                        "response": r["response"].strip()})
    return out, categories


def heldout_sets(args, sample_ids: set[str], used: set[str]) -> tuple[dict[str, list[dict]], dict[str, set[str]]]:
    """Per task, the held-out examples, and the pool categories they were drawn from (``origins``: TyDiQA's
    stand-in is pool XQuAD, the demo's tasks are fresh examples of their own pool family; none for MMLU / BBH)."""
    from iprox_lightning.evaluation import suite_heldout_records

    sets, origins = {}, {}
    for task in args.tasks:
        origins[task] = set()
        if task == "mmlu":
            sets[task] = suite_heldout_records(args.eval_dir, ["mmlu"], args.mmlu_per_subject, args.seed)
        elif task == "bbh":
            sets[task] = suite_heldout_records(args.eval_dir, ["bbh"], args.bbh_per_task, args.seed)
        elif task == "tydiqa":
            sets[task], origins[task] = xquad_heldout(args.pool, sample_ids | used, args.tydiqa_per_language, args.seed)
        elif args.eval_dir == "builtin":  # the demo: fresh examples of a validation family
            from iprox_lightning.evaluation import heldout_records

            recs, _ = heldout_records("builtin", "builtin", n_per_task=args.builtin_per_task, seed=args.seed)
            sets[task], origins[task] = [r for r in recs if r["category"] == task], {task}
            if not sets[task]:
                raise ValueError(f"no built-in held-out examples for task {task!r}")
        else:
            raise ValueError(f"unknown task {task!r}; tasks: {TASKS}")
    return sets, origins


# ------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------
class Effect:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.fid = Path(args.fidelity).resolve()
        self.t0 = time.perf_counter()
        self.st = Stages(self.out, args.threads, self.log, in_process=args.in_process, read_only=args.summary_only)
        fid_state = read_kept(self.fid / "state.json")
        self.fid_stages = fid_state["stages"]
        self.warmed_up = "warmup" in self.fid_stages
        # the target every row fine-tunes: the fidelity run's warmed target (or, for a --no-warmup run, the model)
        self._warmed = str(self.fid / "warmed") if self.warmed_up else args.model
        self.target_fp = self.fid_stages["warmup"]["fingerprint"] if self.warmed_up else args.model
        self.sample = self.fid / "sample.jsonl"
        self.validation = self.fid / "validation.jsonl"
        self.sample_ids = [json.loads(line)["id"] for line in open(self.sample)]
        self.k = max(1, int(round(args.k * len(self.sample_ids)))) if args.k < 1 else int(args.k)
        self.evals_dir = self.out / "evals"
        self.evals_dir.mkdir(exist_ok=True)

    @property
    def warmed(self) -> str:
        """The warmed target's directory; asked for only by the stages that use it (a LESS table, a LoRA warm-up of
        the model as shipped, is made without it)."""
        if self.warmed_up and not self.args.summary_only and not (Path(self._warmed) / "config.json").exists():
            raise SystemExit(f"{self._warmed} is missing: run bench/fidelity_v2.py --out {self.fid} first (it "
                             "re-makes the warmed target from its recorded stage)")
        return self._warmed

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)

    # --- score tables ----------------------------------------------------------------------------
    def table(self, selector: str) -> Path:
        a = self.args
        if selector in self.sources:
            p = self.fid / "scores" / dir_name(self.sources[selector]) / "scores.parquet"
            if not p.exists():
                raise SystemExit(f"selector {selector}: {p} missing (run bench/fidelity_v2.py with variant "
                                 f"{self.sources[selector]!r})")
            return p
        if is_rds(selector):
            # RDS+ against the fidelity run's validation file, or (rds@<form>) the suites with one in another form
            form = selector.partition("@")[2] or None
            d = self.out / "scores" / dir_name(selector)
            val = str(self.validation) if form is None else self.form_validation(form, selector)
            ov = {"model": self.warmed, "output_dir": str(d), "pool": str(self.sample), "validation": val,
                  "tokenizer": self.warmed, "max_length": a.max_length, "batch_size": a.batch_size, "seed": a.seed}
            self.st.run(f"score:{selector}", "rds_scores", [], ov, {
                "warmup": self.target_fp,
                "data": [self.sample_ids, json_digest(self.validation.read_text()) if form is None else val],
                "settings": {k: ov[k] for k in ("max_length", "batch_size")}}, d / "scores.parquet", clean=d)
            return d / "scores.parquet"
        if is_store(selector):
            return self.store_table(store_source(selector))
        if is_less(selector):
            return self.less_table()
        if selector.startswith("random:"):
            seed = int(selector.split(":", 1)[1])
            p = self.out / "scores" / f"random_{seed}" / "scores.parquet"
            self.st.run(selector, "random_scores", [], {"output": str(p), "pool": str(self.sample), "seed": seed},
                        {"sample": self.sample_ids, "seed": seed}, p, clean=p.parent)
            return p
        if selector == "length":  # model-free: shortest response (in the scored tokens) first
            from iprox_lightning.io import write_scores

            p = self.out / "scores" / "length" / "scores.parquet"
            p.parent.mkdir(parents=True, exist_ok=True)
            write_scores({i: -n for i, n in self.response_tokens().items()}, p)
            return p
        raise ValueError(f"unknown selector {selector!r}")

    def less_table(self) -> Path:
        """LESS's score table (issue 66): a LoRA warm-up of ``--model`` on the pool's warm-up split (the recorded
        full warm-up's examples; ``configs/less/warmup.yaml``: 4 epochs, each epoch's adapters and Adam moments
        kept), then the sample scored with ``method: less`` at the 4 checkpoints, summed with the epochs' mean
        learning rates (``configs/less/score.yaml``), one column per subtask (what LESS's max needs)."""
        a = self.args
        cfg = ROOT / "configs"
        warm = self.out / "less" / "warmup"
        builtin = a.pool == "builtin"
        demo = [cfg / "builtin" / "warmup.yaml"] if builtin else []
        resume = warm / "resume"  # a Lightning checkpoint per epoch: an interrupted warm-up goes on from its last
        wov = {"seed_everything": a.seed,
               "trainer": {"default_root_dir": str(self.out / "lightning"), "limit_val_batches": 0,
                           "num_sanity_val_steps": 0, "logger": False, "enable_checkpointing": True,
                           "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                          "init_args": {"dirpath": str(resume), "filename": "last",
                                                        "enable_version_counter": False}}]},  # (one file, each epoch's)
               "model": {"init_args": {"model": a.model, "save_dir": str(warm)}},
               "data": {"init_args": {"pool": a.pool, "validation": None, "tokenizer": a.model, "seed": a.seed,
                                      "max_length": a.max_length, "train_split": "warmup"}}}
        wfp = {"model": a.model, "pool": a.pool, "seed": a.seed, "max_length": a.max_length,
               "config": [config_text(c) for c in (cfg / "warmup.yaml", *demo, cfg / "less" / "warmup.yaml")]}
        epochs = 4  # configs/less/warmup.yaml's
        last = warm / "adapters" / f"epoch_{epochs}" / "optimizer_state.safetensors"
        d = self.out / "scores" / "less"
        val = str(self.validation) if a.eval_dir == "builtin" else f"eval:{a.eval_dir}"
        # the 4 checkpoints' validation gradients are held together, one [K, out, in] per adapter weight each: with the
        # suites' 93 subtasks and LESS's LoRA (r 128 on q/k/v/o, 14.7M parameters at 135M) 22 GB in float32, which
        # ran this 24 GB machine out of memory; held in bfloat16 (ScoringConfig.validation_gradients), 11 GB
        settings = {"max_length": a.max_length, "batch_size": a.batch_size, "validation_gradients": {"dtype": "bfloat16"}}

        def score_fp() -> dict:  # the score table's settings, the warm-up's recorded fingerprint among them
            return {"warmup": self.st.state["stages"]["less:warmup"]["fingerprint"], "data": self.sample_ids,
                    "validation": val, "config": config_text(cfg / "less" / "score.yaml"), "settings": settings}

        if a.recorded_tables and (d / "scores.parquet").exists() and self.st.recorded("less:warmup", wfp) \
                and self.st.recorded("score:less", score_fp()):
            return d / "scores.parquet"  # recorded with these settings: the warm-up's adapters are not needed
        self.st.run("less:warmup", "fit", [cfg / "warmup.yaml", *demo, cfg / "less" / "warmup.yaml"], wov, wfp, last,
                    clean=warm, resume=lambda: {"ckpt_path": str(resume / "last.ckpt")}
                    if (resume / "last.ckpt").exists() else {})
        if resume.exists():  # (the base model's weights and the optimiser: not a result)
            shutil.rmtree(resume)
        sov = {"seed_everything": a.seed,
               "trainer": {"default_root_dir": str(self.out / "lightning"), "logger": False, "callbacks": [
                   {"class_path": "iprox_lightning.scoring.InfluenceWriter", "init_args": {"output_dir": str(d)}}]},
               "model": {"init_args": {"checkpoints": [{"path": str(warm / "adapters" / f"epoch_{e}")}
                                                       for e in range(1, epochs + 1)],
                                       "validation_gradients": settings["validation_gradients"]}},
               "data": {"init_args": {"pool": str(self.sample), "validation": val, "tokenizer": str(warm),
                                      "max_length": a.max_length, "batch_size": a.batch_size, "seed": a.seed,
                                      # the suites' subtasks (the demo's validation file names none)
                                      "validation_subtasks": a.eval_dir != "builtin"}}}
        self.st.run("score:less", "predict", [cfg / "score.yaml", cfg / "less" / "score.yaml"], sov, score_fp(),
                    d / "scores.parquet", clean=d, resume=lambda: {})  # (the writer skips the ids it holds)
        return d / "scores.parquet"

    def store_paths(self, source: str) -> tuple[Path, Path]:
        """``(store dir, query score dir)`` of a gradient-store selector (``store`` = ``store:target``; a validation
        form queries its model's store into a directory of its own)."""
        model = store_model(self.sources, split_store_source(source)[0])
        store = self.out / "stores" / dir_name(model)  # "target" -> stores/target, the first store's path
        if source == "target":  # the first store's query path, kept so its recorded stages stay valid
            return store, self.out / "scores" / "store"
        return store, self.out / "scores" / dir_name(f"store:{source}")

    def store_table(self, source: str) -> Path:
        """A model's gradient store (``train.py build_store``) queried per subtask (``train.py query`` on
        ``eval:<dir>``: one column per MMLU subject / BBH task / TyDiQA language, what LESS max needs). ``source``:
        ``target`` (the warmed target), ``target_unwarmed`` (the model as shipped: full size, not warmed up — the
        off-the-shelf reference of the per-task fidelity table) or a selector naming a fidelity_v2 proxy
        (``store:iprox@0.5``: the proxy's factor layers), whose directory the fidelity run must have kept. A ``+tval``
        source (``store:tval@0.5``) queries its proxy's store with the warmed target's validation gradients."""
        a = self.args
        store, d = self.store_paths(source)
        if (a.summary_only or a.recorded_tables) and (d / "scores.parquet").exists():
            return d / "scores.parquet"  # what the recorded query wrote; no store or proxy is needed
        query_source, form = split_store_source(source)
        source = store_model(self.sources, query_source)  # a +tval source queries its proxy's store ...
        # ... with the warmed target's validation gradients
        validation_model = self.warmed if self.sources.get(query_source, "").endswith(TARGET_VALIDATION) else None
        if source == "target":
            model, base_fp = self.warmed, self.target_fp
        elif source == "target_unwarmed":
            model, base_fp = a.model, a.model
        else:
            if source not in self.sources or self.sources[source] in ("target", "target_unwarmed"):
                raise ValueError(f"store:{source}: not a proxy selector ({sorted(self.sources)})")
            v = self.sources[source].removesuffix(TARGET_VALIDATION)
            pdir = self.fid / "proxies" / dir_name(v)
            rec = self.fid_stages.get(f"build:{v}")
            if rec is None or not (pdir / "config.json").exists():
                raise SystemExit(f"selector store:{source}: the proxy {pdir} is gone; re-make it with "
                                 f"python bench/fidelity_v2.py --out {self.fid} --variants '{v}' --no-unwarmed")
            model, base_fp = str(pdir), rec["fingerprint"]
        ov = {"model": model, "output_dir": str(store), "pool": str(self.sample), "tokenizer": self.warmed,
              "k": a.store_k, "max_length": a.max_length, "batch_size": a.batch_size, "data_seed": a.seed,
              "progress": False}
        fp = {"warmup": self.target_fp, "data": self.sample_ids,
              "settings": {k: ov[k] for k in ("k", "max_length", "batch_size")}}
        if source != "target":
            fp["proxy"] = base_fp
            if source != "target_unwarmed":  # the weights themselves: a proxy re-made from the same settings (its
                # directory is never kept) need not be bit-identical (float rounding of other code, e.g. the fused
                # head, moves Stage 2's steps), and a store or query of the earlier one must not stand for it
                fp["proxy_weights"] = proxy_weights_digest(Path(model))
        self.st.run(f"store:{source}", "build_store", [], ov, fp, store / "store.json", clean=store)
        # eval:<dir> keeps each example's subtask (MMLU subject, BBH task, TyDiQA language): one column each
        if form is not None:  # the same suites, one of them in another form (its task's columns keep their names)
            val = self.form_validation(form, f"store:{source}@{form}")
        else:
            val = str(self.validation) if a.eval_dir == "builtin" else f"eval:{a.eval_dir}"
        qv = {"store": str(store), "validation": val, "output_dir": str(d), "subtasks": True}
        qfp = {"store": self.st.state["stages"][f"store:{source}"]["fingerprint"], "validation": qv["validation"]}
        if validation_model is not None:  # the target's validation gradients in the proxy's coordinates
            qv["validation_model"], qfp["validation_model"] = validation_model, self.target_fp
        key = query_source if form is None else f"{query_source}@{form}"
        self.st.run(f"query:{key}", "query", [], qv, qfp, d / "scores.parquet", clean=d)
        return d / "scores.parquet"

    def form_validation(self, form: str, selector: str) -> str:
        """The validation spec of the evaluation suites with ``form`` in place of its suite's default form
        (``eval:<dir>:mmlu,bbh-direct,tydiqa``); refused for an unknown form or the built-in demo suites."""
        if form not in VALIDATION_FORMS:
            raise ValueError(f"{selector}: unknown validation form {form!r}; forms: {list(VALIDATION_FORMS)}")
        if self.args.eval_dir == "builtin":
            raise ValueError(f"{selector}: validation forms need the real evaluation suites")
        return f"eval:{self.args.eval_dir}:" + ",".join(form if t == VALIDATION_FORMS[form] else t for t in TASKS)

    # --- select, fine-tune, evaluate --------------------------------------------------------------
    def selection(self, task: str | None, selector: str) -> Path:
        from iprox_lightning.selection import select

        out = self.selection_path(task, selector)
        out.parent.mkdir(parents=True, exist_ok=True)
        if lenmatch_reference(selector):
            return self.length_matched(task, selector, out)
        base, rule = split_rule(selector, self.args.rule)
        rule, rtask = ("pooled", None) if task is None else (rule, task)
        within = split_shortlist(selector)[1]
        table = self.table(base) if within is None else self.table_with_tokens(base)
        select(str(table), k=self.k, rule=rule, task=rtask, pool=str(self.sample), output=str(out), quiet=True,
               within_shortest=within, exclude_categories=self.fresh_exclusion(task, selector))
        return out

    def fresh_exclusion(self, task: str | None, selector: str) -> list[str] | None:
        """The pool categories a ``~fresh`` selector leaves out: those ``task``'s held-out examples come from (every
        task's for a task-free selector); ``None`` without the suffix or when the held-out examples are no pool's."""
        if not split_fresh(selector)[1]:
            return None
        tasks = [task] if task is not None else list(self.args.tasks)
        return sorted(set().union(*(self.heldout_origins.get(t, set()) for t in tasks))) or None

    def table_with_tokens(self, selector: str) -> Path:
        """``selector``'s score table with the sample's response tokens (``n_tokens``, the length sort's key) for a
        ``~short`` row: the table itself when it has them, else a copy with them (random scores carry none)."""
        import pyarrow.parquet as pq

        from iprox_lightning.io import read_table, write_scores

        src = self.table(selector)
        if "n_tokens" in pq.read_schema(src).names:
            return src
        _, t = read_table(src)
        out = self.out / "scores" / f"{dir_name(selector)}+tokens" / "scores.parquet"
        return write_scores(dict(zip(t.column("id").to_pylist(), t.column("score").to_pylist())), out,
                            n_tokens=self.response_tokens())

    def ft_key(self, key: str, ft_seed: int | None) -> str:
        """The key of ``key``'s selection fine-tuned with ``ft_seed`` (``--seed``'s run keeps the plain key)."""
        return key if ft_seed is None or ft_seed == self.args.seed else f"{key}{FT_SUFFIX}{ft_seed}"

    def response_tokens(self) -> dict[str, float]:
        """``{id: response tokens}`` of the sample, as the target scored it (the length sort's key)."""
        from iprox_lightning.io import read_table

        if not hasattr(self, "_response_tokens"):
            _, t = read_table(self.fid / "scores" / "target" / "scores.parquet")
            self._response_tokens = dict(zip(t.column("id").to_pylist(), map(float, t.column("n_tokens").to_pylist())))
        return self._response_tokens

    def length_matched(self, task: str | None, selector: str, out: Path) -> Path:
        """``lenmatch:<seed>`` (``lenmatch-<selector>:<seed>``): a seeded random subset with the response lengths of
        the target's (that selector's) selection for ``task`` (``baselines.random_selection.length_matched_subset``)
        — the control that tells what the selector's choice gains beyond the lengths it picked."""
        from iprox_lightning.baselines import length_matched_subset
        from iprox_lightning.io import write_selection

        ref_sel, seed = lenmatch_reference(selector)
        if task is None or task_free(ref_sel):
            raise ValueError(f"{selector}: matched to a per-task selection; it needs a task and a per-task selector")
        ref_path = self.selection(task, ref_sel)
        ref = [json.loads(line)["id"] for line in open(ref_path)]
        ids = length_matched_subset(ref, self.response_tokens(), seed)
        records = {r["id"]: r for r in map(json.loads, open(self.sample))}
        return write_selection(out, [(i, 0.0) for i in ids], records, {
            "selector": selector, "matched_to": str(ref_path.relative_to(self.out)), "seed": seed, "k": len(ids),
            "how": "baselines.random_selection.length_matched_subset over the sample's response tokens"})

    def finetune_fingerprint(self, selection: Path, ft_seed: int | None = None) -> dict:
        a = self.args
        ids = [json.loads(line)["id"] for line in open(selection)]
        fp = {"warmup": self.target_fp, "selected": ids, "epochs": a.epochs, "lr": a.lr,
              "max_length": a.max_length, "batch_size": a.batch_size, "seed": a.seed,
              "config": config_text(ROOT / "configs" / "finetune.yaml")}
        if ft_seed is not None and ft_seed != a.seed:  # only the training seed differs: the batch order (no dropout)
            fp["shuffle_seed"] = ft_seed
        return fp

    def finetune(self, key: str, selection: Path, ft_seed: int | None = None) -> tuple[str, dict]:
        a = self.args
        d = self.out / "models" / dir_name(key)
        overlay = {
            "seed_everything": a.seed if ft_seed is None else ft_seed,
            "trainer": {"default_root_dir": str(self.out / "lightning"), "max_epochs": a.epochs, "limit_val_batches": 0,
                        "num_sanity_val_steps": 0, "logger": logger_overlay(self.out, f"finetune_{dir_name(key)}")},
            "model": {"init_args": {"model": self.warmed, "save_dir": str(d), "lr": a.lr}},
            "data": {"init_args": {"pool": str(self.sample), "validation": None, "tokenizer": self.warmed,
                                   "selected": str(selection), "max_length": a.max_length, "batch_size": a.batch_size,
                                   # the data seed orders the training batches (the selected split does not depend
                                   # on it); seed_everything alone leaves a dropout-free fine-tune identical
                                   "seed": a.seed if ft_seed is None else ft_seed}},
        }
        fp = self.finetune_fingerprint(selection, ft_seed)
        rec = self.st.run(f"finetune:{key}", "fit", [ROOT / "configs" / "finetune.yaml"], overlay, fp,
                          d / "config.json", clean=d)
        return str(d), rec

    def evals_todo(self, key: str, model_fp: str, tasks: list[str]) -> tuple[dict, dict, list[str]]:
        """``(cached evaluations of key, wanted fingerprint per task, tasks whose evaluation is missing or stale)``."""
        path = self.evals_dir / f"{dir_name(key)}.json"
        cached = json.loads(path.read_text()) if path.exists() else {"tasks": {}}
        cached.update(key=key, selector=key.split("/", 1)[-1])
        want = {t: json_digest([model_fp, self.heldout_digest[t], self.args.eval_max_length]) for t in tasks}
        return cached, want, [t for t in tasks if cached["tasks"].get(t, {}).get("fingerprint") != want[t]]

    def evaluate(self, key: str, model_dir: str, model_fp: str, tasks: list[str]) -> dict:
        """``{task: [{"id", "loss", "exact_match"}, ...]}``, cached in ``OUT/evals/<key>.json`` by fingerprint."""
        from iprox_lightning.evaluation import evaluate_heldout

        path = self.evals_dir / f"{dir_name(key)}.json"
        cached, want, todo = self.evals_todo(key, model_fp, tasks)
        if todo and model_dir != self.warmed and not (Path(model_dir) / "config.json").exists():
            raise RuntimeError(f"{key}: model {model_dir} is gone but evaluations {todo} are missing; re-run its "
                               "fine-tune (delete its record from state.json)")
        for t in todo:
            t0 = time.perf_counter()
            m = evaluate_heldout(model_dir, self.heldout[t], self.warmed, max_length=self.args.eval_max_length,
                                 batch_size=self.args.eval_batch_size, per_example=True)
            cached["tasks"][t] = {"fingerprint": want[t], "heldout_digest": self.heldout_digest[t],
                                  "wall_s": time.perf_counter() - t0, "n": m["n"],
                                  "loss": m["loss"], "exact_match": m["exact_match"],
                                  "examples": [{k: e[k] for k in ("id", "loss", "exact_match")} for e in m["examples"]]}
            path.write_text(json.dumps(cached, indent=1))
            self.log(f"evaluated {key} on {t}: loss {m['loss']:.4f}, exact match {m['exact_match']:.3f} "
                     f"({time.perf_counter() - t0:.0f}s)")
        return {t: cached["tasks"][t] for t in tasks}

    def run_model(self, key: str, selection: Path | None, tasks: list[str], ft_seed: int | None = None) -> None:
        if selection is None:  # the warmed target itself
            model_dir, fp = self.warmed, self.target_fp
        else:
            key = self.ft_key(key, ft_seed)
            rec = self.st.state["stages"].get(f"finetune:{key}")
            fp = json.dumps(self.finetune_fingerprint(selection, ft_seed), sort_keys=True)
            # the ledger's equality (up to outcome-neutral config lines), and the recorded text the evaluations carry
            if rec is not None and same_settings(rec["fingerprint"], fp) and \
                    not self.evals_todo(key, rec["fingerprint"], tasks)[2]:
                return  # fine-tuned and evaluated with these settings (the weights were not kept)
            model_dir, rec = self.finetune(key, selection, ft_seed)
            fp = rec.get("fingerprint", "")
        self.evaluate(key, model_dir, fp, tasks)
        if selection is not None and not self.args.keep_models and all(
                t in json.loads((self.evals_dir / f"{dir_name(key)}.json").read_text())["tasks"] for t in tasks):
            shutil.rmtree(model_dir, ignore_errors=True)  # 0.5 GB each; the evaluation is what is kept
        self.write_summary()

    def run(self) -> dict:
        a = self.args
        self.sources = {**DEFAULT_SOURCES, **dict(s.split("=", 1) for s in a.source)}
        from iprox_lightning.data import SFTDataModule

        dm = SFTDataModule(pool=a.pool, validation=None, tokenizer="builtin", seed=a.seed)
        used = set(dm.splits.warmup) | set(dm.splits.probe) | set(dm.splits.align)
        self.heldout, self.heldout_origins = heldout_sets(a, set(self.sample_ids), used)
        (self.out / "heldout").mkdir(exist_ok=True)
        self.heldout_digest = {}
        for t, recs in self.heldout.items():
            write_records_jsonl(recs, self.out / "heldout" / f"{t}.jsonl")
            self.heldout_digest[t] = json_digest(recs)
        state = self.st.state
        tasks = list(a.tasks)
        if a.summary_only:
            return self.write_summary()
        cmd = "python bench/effect.py " + " ".join(shlex.quote(x) for x in a.argv)
        runs = state.setdefault("run_commands", [])
        if not runs or runs[-1]["command"] != cmd:
            runs.append({"command": cmd, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": git_commit(True)})
        self.st.save()
        if a.tables_only:  # score now, fine-tune later: each selector's score table, no selection or fine-tune
            for sel in a.selectors:
                if not (task_free(sel) or lenmatch_reference(sel)):
                    self.table(split_rule(sel, a.rule)[0])
            return self.write_summary()
        self.run_model("base", None, tasks)
        for ft in a.finetune_seeds or [a.seed]:  # every row with the first training seed, then the next
            for s in a.random_seeds:
                self.run_model(f"random:{s}", self.selection(None, f"random:{s}"), tasks, ft)
            first = [t for t in tasks if t in a.priority_tasks]  # every selector on these tasks first, then the rest
            plan = [(sel, first) for sel in a.selectors] + [(sel, [t for t in tasks if t not in first])
                                                           for sel in a.selectors]
            for j, (sel, group) in enumerate(plan):
                if task_free(sel):  # one subset for every task, run once
                    if j < len(a.selectors):
                        self.run_model(sel, self.selection(None, sel), tasks, ft)
                    continue
                for t in group:
                    try:
                        self.run_model(f"{t}/{sel}", self.selection(t, sel), [t], ft)
                    except RuntimeError as e:
                        key = self.ft_key(f"{t}/{sel}", ft)
                        self.log(f"{key} FAILED: {e}")
                        state.setdefault("errors", {})[key] = str(e)[-2000:]
                        self.st.save()
        return self.write_summary()

    # --- summary -----------------------------------------------------------------------------------
    def cost(self, selector: str) -> dict:
        """Wall-clock of a selector's scoring (and of building its proxy) and its ratios to the target's: a store
        selector's to the target's store (build + one query; ``cost_reference``: ``"target store"``), any other's to
        the target's exact scoring (``"target scoring"``; a store selector too where the target's store has no record
        on its host). LESS is compared with the target's store too (a pool pass of gradients each), its LoRA warm-up
        counted as its build. A stage resumed over several attempts counts every attempt's seconds
        (:func:`ledger.attempts_wall`); where an attempt's were not recorded the ratio is a lower bound
        (``cost_lower_bound``). A ratio needs every stage in it to have run on one host: a GPU's seconds over a CPU's are no
        cost ratio (``None``, and ``hosts_differ``); stages recorded before hosts were count as the same."""
        selector = split_rule(selector, self.args.rule)[0]
        st, own = self.fid_stages, self.st.state["stages"]
        tgt_rec = st.get("score:target", {})
        tgt = tgt_rec.get("wall_s")
        recs: list[dict] = []  # the stage records the cost is made of
        partial: list[dict] = []  # those resumed with an attempt's seconds unrecorded

        def wall(r: dict, default: float | None = None) -> float | None:
            w, complete = attempts_wall(r)
            if not complete:
                partial.append(r)
            return default if w is None else w
        if selector in self.sources:
            v = self.sources[selector]
            recs = [st.get(f"score:{v}", {})]
            score = wall(recs[0])
            if v not in ("target", "target_unwarmed"):  # the proxy's build (shared by a +tval row)
                recs.append(run_on_host(st.get(f"build:{v.removesuffix(TARGET_VALIDATION)}", {}), recs[0]))
            build = wall(recs[1], 0.0) if len(recs) > 1 else 0.0
        elif is_rds(selector):
            recs = [own.get(f"score:{selector}", {})]
            score, build = wall(recs[0]), 0.0
        elif is_store(selector):
            # building the store is the pool pass; each new validation set is one query; a proxy's build counts too
            src = store_source(selector)
            model = store_model(self.sources, split_store_source(src)[0])
            recs = [own.get(f"store:{model}", {}), own.get(f"query:{src}", {})]
            b, q = (wall(r) for r in recs)
            score = b + q if b is not None and q is not None else None
            if model != "target":
                recs.append(run_on_host(st.get(f"build:{self.sources[model].removesuffix(TARGET_VALIDATION)}", {}), recs[0]))
            build = wall(recs[2], 0.0) if len(recs) > 2 else 0.0
        elif is_less(selector):  # scoring the 4 checkpoints; its LoRA warm-up is what it builds (as a proxy's build)
            recs = [own.get("score:less", {})]
            recs.append(run_on_host(own.get("less:warmup", {}), recs[0]))
            score, build = wall(recs[0]), wall(recs[1], 0.0)
        elif lenmatch_reference(selector):  # a control (needs the target's selection), not a selector
            score, build = None, None
        else:
            score, build = 0.0, 0.0
        host_set = lambda rs: {host_key(r) for r in rs} - {None}  # noqa: E731
        differ, reference = len(host_set([tgt_rec, *recs])) > 1, "target scoring"
        if is_store(selector) or is_less(selector):
            # like for like: a store is compared with the target's own store on its host (build + its first query:
            # the same pool pass and one validation set), not with the target's exact scoring (another method);
            # the exact scoring only where the target's store has no record on this row's host
            ref = [own.get("store:target", {}), own.get("query:target", {})]
            if all(r.get("wall_s") is not None for r in ref) and len(host_set([*ref, *recs])) <= 1:
                tgt, differ, reference = sum(r["wall_s"] for r in ref), False, "target store"
        ratio = (score / tgt) if (score is not None and tgt and not differ) else None
        total = ((score + build) / tgt) if (score is not None and tgt and not differ) else None
        return {"scoring_wall_s": score, "build_wall_s": build, "scoring_cost_ratio": ratio,
                "total_cost_ratio": total, **({"hosts_differ": True} if differ else {}),
                **({"cost_reference": reference} if ratio is not None else {}),
                **({"cost_lower_bound": True} if partial and ratio is not None else {})}

    def selection_path(self, task: str | None, selector: str) -> Path:
        """Where :meth:`selection` writes ``selector``'s subset for ``task`` (``None``: the task-free subset)."""
        return self.out / "selections" / f"{dir_name(selector if task is None else f'{task}/{selector}')}.jsonl"

    def selected_ids(self, task: str, selector: str) -> list[str] | None:
        """The ids of the subset a row fine-tuned on (``None`` for the base row or before its selection exists)."""
        path = self.selection_path(None if task_free(selector) else task, selector)
        if selector == "base" or not path.exists():
            return None
        return [json.loads(line)["id"] for line in open(path)]

    def selected_tokens(self, task: str, selector: str) -> float | None:
        """Mean response tokens of the subset a row fine-tuned on (``None`` for the base row)."""
        ids = self.selected_ids(task, selector)
        if ids is None:
            return None
        n = self.response_tokens()
        return float(np.mean([n[i] for i in ids]))

    def selected_origin_share(self, task: str, selector: str) -> float | None:
        """The share of the subset a row fine-tuned on drawn from the pool categories ``task``'s held-out examples
        come from (TyDiQA: XQuAD); ``None`` for the base row."""
        ids = self.selected_ids(task, selector)
        if ids is None:
            return None
        if not hasattr(self, "_sample_category"):
            self._sample_category = {r["id"]: r.get("category") for r in map(json.loads, open(self.sample))}
        return sum(self._sample_category[i] in self.heldout_origins[task] for i in ids) / len(ids)

    def model_fingerprint(self, key: str) -> str | None:
        """The fingerprint a model evaluated under ``key`` has with the current settings (k, rule, fine-tuning,
        score tables); ``None`` when ``key`` names no selector of this run."""
        if key == "base":
            return self.target_fp
        stage = f"finetune:{key}"
        key, ft_seed = split_finetune_seed(key)
        task, _, sel = key.rpartition("/")
        known = sel.startswith("random:") or sel in self.args.selectors
        if not known or (task and task not in self.args.tasks) or (not task and not task_free(sel)):
            return None
        memo = self.__dict__.setdefault("_model_fp", {})  # one select per key and process: settings do not change
        if (key, ft_seed) not in memo:
            fp = json.dumps(self.finetune_fingerprint(self.selection(task or None, sel), ft_seed), sort_keys=True)
            rec = self.st.state["stages"].get(stage)  # the same settings recorded in other words: their text
            memo[key, ft_seed] = rec["fingerprint"] if rec is not None and same_settings(rec["fingerprint"], fp) \
                else fp
        return memo[key, ft_seed]

    def store_vs_exact(self, source: str = "target") -> dict | None:
        """How a model's gradient store (selector ``store`` / ``store:<proxy>``, the suites' default form) ranks the
        sample against the same model's exact TracIn table from the fidelity run (Spearman): pooled (cosine to the
        mean validation gradient: the same quantity, projected vs exact) and per task (mean over the subtask columns
        vs the exact table's task columns: also a different aggregation). ``None`` before the store was queried or
        without an exact table."""
        from scipy.stats import spearmanr

        from iprox_lightning.io import read_table

        q_path = self.store_paths(source)[1] / "scores.parquet"
        e_path = self.fid / "scores" / dir_name(self.sources.get(source, source)) / "scores.parquet"
        if not q_path.exists() or not e_path.exists():
            return None
        q, e = (read_table(p)[1].to_pandas().set_index("id") for p in (q_path, e_path))
        ids = sorted(set(q.index) & set(e.index))
        out = {"n": len(ids), "k": self.args.store_k,
               "pooled": float(spearmanr(q.loc[ids, "score"], e.loc[ids, "score"])[0])}
        for t in self.args.tasks:
            qc = [c for c in q.columns if c.startswith(f"score/{t}.")]
            ec = [c for c in e.columns if c == f"score/{t}" or c.startswith(f"score/{t}.")]
            if qc and ec:
                out[t] = {"subtasks": len(qc), "spearman_mean": float(spearmanr(q.loc[ids, qc].mean(axis=1),
                                                                                  e.loc[ids, ec].mean(axis=1))[0])}
        return out

    def proxy_stores_vs_exact(self) -> dict:
        """:meth:`store_vs_exact` of every proxy store this command names (its default-form query)."""
        out = {}
        for src in self.proxy_store_queries():
            model = split_store_source(src)[0]
            if model not in out and (r := self.store_vs_exact(model)) is not None:
                out[model] = r
        return out

    def proxy_store_queries(self) -> list[str]:
        """The distinct proxy store queries this command's selectors name (``iprox@0.5``, ``iprox@0.5@bbh-direct``;
        the target's own store is no proxy), in the selectors' order."""
        out: list[str] = []
        for sel in self.args.selectors:
            base = split_rule(sel, self.args.rule)[0]
            if is_store(base):
                src = store_source(base)
                if split_store_source(src)[0] != "target" and src not in out:
                    out.append(src)
        return out

    def proxy_store_fidelity(self) -> dict:
        """Per proxy store query (selectors ``store:<proxy>``, with its validation form if any), how its per-subtask
        scores rank the sample against the warmed target's store queried with the same form (the same projection
        size and validation columns), per task: Spearman under the rules ``max`` (LESS) and ``mean`` over the task's
        subtask columns; ``mean`` among the 10% shortest responses only (``mean_within_shortest``, ties at the cut
        kept: the package's ``spearman_within_shortest``, where a ranking cannot agree by preferring short answers);
        and the overlap of the two ``balanced`` selections of size k (the share of the target's subset the proxy
        picks). Empty before a proxy store was queried."""
        from scipy.stats import spearmanr

        from iprox_lightning.analysis import per_task_retention
        from iprox_lightning.io import read_table
        from iprox_lightning.selection import rule_order

        out: dict[str, dict] = {}
        n_tok = self.response_tokens()
        for src in self.proxy_store_queries():
            form = split_store_source(src)[1]
            path = self.store_paths(src)[1] / "scores.parquet"
            t_path = self.store_paths("target" if form is None else f"target@{form}")[1] / "scores.parquet"
            if not path.exists() or not t_path.exists():
                continue
            q, ref = (read_table(x)[1].to_pandas().set_index("id") for x in (path, t_path))
            ids = sorted(set(q.index) & set(ref.index) & set(n_tok))
            row: dict[str, Any] = {"n": len(ids), "k": self.k,
                                   "pooled": float(spearmanr(q.loc[ids, "score"], ref.loc[ids, "score"])[0])}
            for t in self.args.tasks:
                cq, cr = (task_columns({c: df.loc[ids, c].to_numpy() for c in df.columns}, t) for df in (q, ref))
                row[t] = {"max": float(spearmanr(np.stack(list(cq.values())).max(0),
                                                 np.stack(list(cr.values())).max(0))[0])}
                mq, mr = ({i: {t: float(v)} for i, v in zip(ids, np.stack(list(c.values())).mean(0))} for c in (cq, cr))
                m = per_task_retention(mq, mr, n_tok, tasks=[t], topk=())[t]
                row[t].update(mean=m["spearman"], mean_within_shortest=m["spearman_within_shortest"],
                              shortest_n=m["shortest_n"])
                picks = [set(rule_order("balanced", ids, c, t)[0][:self.k].tolist()) for c in (cq, cr)]
                row[t]["balanced_overlap"] = len(picks[0] & picks[1]) / self.k
            out[src] = row
        return out

    def write_summary(self) -> dict:
        """``OUT/summary.json`` (``meta`` + one row per task, selector and metric), ``summary.md`` generated from it,
        and the Markdown spliced into ``--docs``."""
        a = self.args
        evals = [json.loads(p.read_text()) for p in sorted(self.evals_dir.glob("*.json"))]
        rows, noise, matched, short, fresh = [], {}, {}, {}, {}
        skipped: dict[str, set] = {"stale": set(), "unlisted": set()}
        model_fp = {ev["key"]: self.model_fingerprint(ev["key"]) for ev in evals}
        for task in a.tasks:
            per_seed = self.task_evaluations(task, evals, model_fp, skipped)
            # a selection fine-tuned with several training seeds counts once, with its per-example mean over them
            per_model = {sel: {m: np.mean([v[m] for v in by.values()], axis=0) for m in METRICS}
                         for sel, by in per_seed.items()}
            for m, hib in METRICS.items():
                rows += self.task_rows(task, m, hib, per_seed, per_model, noise)
                for ref, res in length_matched_controls(per_model, m, hib, a.bootstrap, a.seed).items():
                    matched.setdefault(f"{task}/{m}", {})[ref] = res
                for ref, res in shortlist_controls(per_model, m, hib, a.bootstrap, a.seed).items():
                    short.setdefault(f"{task}/{m}", {})[ref] = res
                for ref, res in fresh_controls(per_model, m, hib, a.bootstrap, a.seed).items():
                    fresh.setdefault(f"{task}/{m}", {})[ref] = res
        stale, unlisted = skipped["stale"], skipped["unlisted"]
        summary = {"meta": self.summary_meta(rows, evals, noise, matched, stale, unlisted), "rows": rows}
        if short:
            summary["meta"]["shortlist_matched"] = short
        if fresh:
            summary["meta"]["fresh_matched"] = fresh
        if stale:
            self.log(f"not reported (evaluated with other settings than this command's; re-run without --summary-only "
                     f"to refresh them): {', '.join(sorted(stale))}")
        if unlisted and not self.__dict__.get("_said_unlisted"):  # once per process: the summary is rewritten often
            self._said_unlisted = True
            self.log(f"{len(unlisted)} cached evaluation(s) of selectors or tasks this command does not name are left "
                     "out of the summary (meta.not_listed; name them in --selectors / --tasks to report them)")
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        md = markdown(summary)
        (self.out / "summary.md").write_text(md)
        for doc in a.docs or []:
            splice_effect_docs(Path(doc), md, *docs_markers(self.out))
        head = headline_markdown(summary, a.headline_forms)
        (self.out / "headline.md").write_text(head + "\n")
        for doc in a.headline or []:
            splice_docs(Path(doc), head, *headline_markers(self.out))
        return summary

    def task_evaluations(self, task: str, evals: list[dict], model_fp: Mapping[str, str | None],
                         skipped: dict[str, set]) -> dict[str, dict[int, dict[str, np.ndarray]]]:
        """The cached evaluations on ``task``'s held-out examples that this command reports: selector -> training
        seed -> metric -> per-example values. Evaluations of selectors / tasks it does not name (``unlisted``) or
        made with other settings (``stale``: k, rule, fine-tuning, scores) go into ``skipped``, never into a row."""
        a = self.args
        ids = [r["id"] for r in self.heldout[task]]
        per_seed: dict[str, dict[int, dict[str, np.ndarray]]] = {}
        for ev in evals:
            rec = ev["tasks"].get(task)
            if not rec or rec.get("heldout_digest") != self.heldout_digest[task]:
                continue  # not evaluated on this task, or on other held-out examples (re-run to refresh)
            fp = model_fp[ev["key"]]
            if fp is None:
                skipped["unlisted"].add(ev["key"])
                continue
            if rec.get("fingerprint") != json_digest([fp, self.heldout_digest[task], a.eval_max_length]):
                skipped["stale"].add(ev["key"])
                continue
            ex = {e["id"]: e for e in rec["examples"]}
            sel, ft = split_finetune_seed(ev["selector"])
            per_seed.setdefault(sel, {})[a.seed if ft is None else ft] = {
                m: np.asarray([float(ex[i][m]) for i in ids]) for m in METRICS}
        return per_seed

    def task_rows(self, task: str, m: str, hib: bool, per_seed: Mapping[str, Mapping[int, Mapping[str, np.ndarray]]],
                  per_model: Mapping[str, Mapping[str, np.ndarray]], noise: dict) -> list[dict]:
        """One row per model evaluated on ``task`` under metric ``m`` (base, random seeds, then the selectors in the
        command's order): value with its CI, the paired gain over the random seeds' mean, cost, selected lengths; the
        random seeds' spread goes into ``noise``."""
        a = self.args
        n = len(self.heldout[task])
        seeds = sorted(k for k in per_model if k.startswith("random:") and split_shortlist(k)[1] is None
                       and not split_fresh(k)[1])  # not ~short / ~fresh: those are controls of their own rows
        rand = np.mean([per_model[s][m] for s in seeds], axis=0) if seeds else None
        if seeds:
            means = [float(per_model[s][m].mean()) for s in seeds]
            noise[f"{task}/{m}"] = {"seeds": len(seeds), "seed_means": means, "spread": float(max(means) - min(means)),
                                    "sd": float(np.std(means, ddof=1)) if len(means) > 1 else None}
        rows = []
        order = [x for x in ("base", *seeds, *a.selectors) if x in per_model]  # no base yet: --tables-only
        for sel in order + sorted(set(per_model) - set(order)):
            v = per_model[sel][m]
            row = {"task": task, "selector": sel, "rule": "-" if sel == "base" else (
                "pooled" if task_free(sel) else split_rule(sel, a.rule)[1]), "heldout_n": n, "metric": m,
                "higher_is_better": hib, "value": float(v.mean()),
                "ci": percentile_interval(lambda ix: float(v[ix].mean()), len(v), a.bootstrap, a.seed)}
            by_ft = per_seed.get(sel, {})
            if sel != "base":  # the training-seed noise of this row: its value under each seed
                row["finetune_seeds"] = sorted(by_ft)
                row["finetune_seed_values"] = [float(by_ft[f][m].mean()) for f in sorted(by_ft)]
            if rand is not None:
                # the CI is over held-out examples only; which random subset was drawn matters as much:
                # compare with every seed's mean too (the noise floor)
                diff, ci, gains = paired_gain(v, [per_model[x][m] for x in seeds], hib, a.bootstrap, a.seed)
                row["diff_vs_random"], row["diff_ci"] = diff, ci
                row["diff_vs_best_random_seed"] = min(gains)
                row["beats_every_random_seed"] = bool(min(gains) > 0)
            row.update(self.cost(sel) if sel != "base" else {})
            row["selected_response_tokens"] = self.selected_tokens(task, sel)
            if self.heldout_origins.get(task):
                row["selected_heldout_origin_share"] = self.selected_origin_share(task, sel)
            rows.append(row)
        return rows

    def summary_meta(self, rows: list[dict], evals: list[dict], noise: dict, matched: dict, stale: set,
                     unlisted: set) -> dict:
        a = self.args
        return {
            "target": Path(a.model).name, "target_warmed_up": self.warmed_up, "pool_sample": len(self.sample_ids),
            "k": self.k, "k_fraction": self.k / len(self.sample_ids), "rule": a.rule, "commit": git_commit(True),
            "tasks": list(a.tasks), "random_seeds": list(a.random_seeds),
            "finetune_seeds": sorted({f for r in rows for f in r.get("finetune_seeds", [])}),
            "finetune_noise": finetune_noise(rows),
            "heldout": {t: {"n": len(r), "digest": self.heldout_digest[t],
                            "source": {"mmlu": "MMLU test questions, zero-shot",
                                       "bbh": "BBH task examples, zero-shot direct answer",
                                       "tydiqa": "pool XQuAD examples outside the sample and splits (TyDiQA "
                                                 "GoldP dev not available)"}.get(t, "fresh built-in examples")}
                        for t, r in self.heldout.items()},
            "finetune": {"epochs": a.epochs, "lr": a.lr, "max_length": a.max_length, "batch_size": a.batch_size,
                         "config": "configs/finetune.yaml"},
            "sources": {s: v for s, v in self.sources.items()},
            "noise_floor": noise, "length_matched": matched, "length_vs_effect": length_vs_effect(rows),
            "heldout_origins": {t: sorted(c) for t, c in self.heldout_origins.items() if c},
            "heldout_origin_vs_effect": length_vs_effect(rows, "selected_heldout_origin_share"),
            "fidelity_dir": str(self.fid.relative_to(ROOT)) if self.fid.is_relative_to(ROOT) else str(self.fid),
            "hosts": recorded_hosts(self.st.state), "threads": a.threads,
            "summary_written_on": host_info(), "commands": self.st.state.get("run_commands", []),
            "stage_wall_s": {k: v.get("wall_s") for k, v in self.st.state["stages"].items()},
            "eval_wall_s": {ev["key"]: {t: r.get("wall_s") for t, r in ev["tasks"].items()} for ev in evals},
            "not_reported": sorted(stale), "not_listed": sorted(unlisted), "store_vs_exact": self.store_vs_exact(),
            "proxy_stores_vs_exact": self.proxy_stores_vs_exact(),
            "proxy_store_fidelity": self.proxy_store_fidelity()}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--fidelity", default=str(ROOT / "bench" / "results" / "fidelity_v2"),
                    help="the fidelity_v2 output dir (warmed target, sample, validation, score tables)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--pool", default=str(DEFAULT_POOL))
    ap.add_argument("--eval-dir", default=str(DEFAULT_EVAL))
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--selectors", nargs="+", default=DEFAULT_SELECTORS)
    ap.add_argument("--priority-tasks", nargs="*", default=["mmlu", "bbh"],
                    help="run every selector on these tasks before the other tasks (results come in that order)")
    ap.add_argument("--source", action="append", default=[], metavar="SELECTOR=VARIANT",
                    help="score table of a selector: a fidelity_v2 variant key (default: DEFAULT_SOURCES)")
    ap.add_argument("--random-seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--finetune-seeds", nargs="+", type=int, default=None,
                    help="training seeds (batch order) each selection is fine-tuned with, in order (default: --seed); "
                         "a row's value is its per-example mean over the seeds run so far")
    ap.add_argument("--rule", default="mean", help="selection rule over a task's columns (iprox_lightning.selection.rules); "
                    "a selector may name its own after '+', e.g. store+max")
    ap.add_argument("--store-k", type=int, default=16, help="projection rows per side of each layer (selector 'store')")
    ap.add_argument("--k", type=float, default=0.1, help="fraction (< 1) or count of the sample to select")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-length", type=int, default=128, help="tokens per fine-tuning / RDS example (as scored)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-max-length", type=int, default=384)
    ap.add_argument("--eval-batch-size", type=int, default=16)
    ap.add_argument("--mmlu-per-subject", type=int, default=3)
    ap.add_argument("--bbh-per-task", type=int, default=6)
    ap.add_argument("--tydiqa-per-language", type=int, default=10)
    ap.add_argument("--builtin-per-task", type=int, default=50, help="held-out examples per family (built-in demo)")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--keep-models", action="store_true", help="keep the fine-tuned weights (0.5 GB each)")
    ap.add_argument("--in-process", action="store_true",
                    help="run each stage's train.py command in this process, not as a subprocess (tests)")
    ap.add_argument("--summary-only", action="store_true", help="only rewrite summary/tables from the cached evaluations")
    ap.add_argument("--recorded-tables", action="store_true",
                    help="rank from the store queries' recorded score tables (as --summary-only reads them), so rows "
                         "can be fine-tuned and evaluated where the stores and proxies were not kept")
    ap.add_argument("--tables-only", action="store_true",
                    help="only make the selectors' score tables (scores, stores and their queries; no fine-tuning), "
                         "then the summary: a proxy store's fidelity to the target's store without its effect rows")
    ap.add_argument("--docs", nargs="*", default=None,
                    help="also write the tables into these Markdown pages between their effect markers")
    ap.add_argument("--headline", nargs="*", default=None,
                    help="also write the one-line-per-selector table (OUT/headline.md) into these Markdown pages "
                         "between their effect-headline markers")
    ap.add_argument("--headline-forms", nargs="*", default=[], choices=sorted(VALIDATION_FORMS),
                    help="validation forms the headline prefers for their task when a selector was queried in them "
                         "(bbh-direct: BBH's direct-answer exemplars, the form of its held-out metric)")
    args = ap.parse_args(argv)
    if not args.summary_only:
        check_local_inputs(ap, args)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return Effect(args).run()


if __name__ == "__main__":
    main()
