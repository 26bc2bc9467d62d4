"""Side by side with the peers on this CPU: our EK-FAC fit and scoring pass against kronfluence's, our gradient store
build and query against bergson's index build and ``Attributor``, on identical inputs, interleaved, in one process.

One tiny Llama built from a ``LlamaConfig`` (seeded; about 5.1M parameters), one fixed token set (``--train``
training and ``--query`` query examples of the built-in character tokenizer, every example the same length so no
padding differs), the same tracked layers (every q/k/v/o/gate/up/down projection), the same batch sizes. Each
repeat runs every stage of ours and of the peer in turn (ours first on even repeats, the peer first on odd ones); a
ratio is the median of ours over the median of the peer's (< 1: ours faster). What each side runs:

* ``ekfac_fit`` — ours: ``InfluenceMetric.fit`` of ``influence_metric("ekfac")`` (K-FAC factors, eigenbases,
  corrected eigenvalues); kronfluence: ``Analyzer.fit_all_factors`` (strategy ``ekfac``, empirical Fisher, as ours).
* ``ekfac_scores`` — ours: ``InfluenceScorer``'s validation gradients, ``finalize`` and ``score_batch`` over the
  training batches (the fitted metric; ``normalize=False``: plain inner products of every query example with every
  training example, as kronfluence's); kronfluence: ``Analyzer.compute_pairwise_scores`` on its fitted factors.
* ``store_build`` — ours: ``python train.py build_store`` (k = 16, float32 shards) in process; bergson:
  ``collect_gradients`` into an index (``projection_dim`` 16, float32 like its float32 model), the model already in
  memory.
* ``store_query`` — ours: ``python train.py query`` of the query set (each query example its own column, the
  store's validation cache cleared first, so the query's gradients are computed); bergson: ``Attributor`` opened on
  its index (``unit_norm``) and ``trace`` over the query batches (scores of every index row).

    # with a Python that imports both peers; the recorded run (about 10 minutes on the loaded 2-core host):
    python bench/peers.py --out bench/results/peers --train 128 --query 16 --repeats 3 --threads 1

Writes ``OUT/results.json`` (per stage: seconds of every repeat, medians, the ratio; torch, kronfluence and bergson
versions, threads); ``python bench/tables.py`` puts its table in ``docs/BENCHMARKS.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import platform
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's package, not another one installed

import torch  # noqa: E402

STAGES = ("ekfac_fit", "ekfac_scores", "store_build", "store_query")
PEER_OF = {"ekfac_fit": "kronfluence", "ekfac_scores": "kronfluence", "store_build": "bergson",
           "store_query": "bergson"}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------------- inputs
def build_inputs(work: Path, n_train: int, n_query: int, prompt_len: int, response_len: int, seed: int,
                 batch_size: int = 8) -> dict:
    """The model directory (config + weights + tokenizer), the pool and query files and their token batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from iprox_lightning.data import SFTDataModule, write_records_jsonl
    from iprox_lightning.models import builtin_tokenizer

    tok = builtin_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=960, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    mdir = work / "model"
    model.save_pretrained(mdir)
    tok.save_pretrained(mdir)
    rng = random.Random(seed)
    chars = "abcdefghijklmnopqrstuvwxyz"
    text = lambda n: "".join(rng.choice(chars) for _ in range(n))  # noqa: E731
    pool = [{"id": f"p{j:05d}", "instruction": text(prompt_len), "context": "", "response": text(response_len),
             "category": "pool"} for j in range(n_train)]
    query = [{"id": f"q{j:03d}", "instruction": text(prompt_len), "context": "", "response": text(response_len),
              "category": f"q{j:03d}"} for j in range(n_query)]
    write_records_jsonl(pool, work / "pool.jsonl")
    write_records_jsonl(query, work / "query.jsonl")
    max_length = prompt_len + response_len + 32
    dm = SFTDataModule(pool=str(work / "pool.jsonl"), validation=str(work / "query.jsonl"), tokenizer=str(mdir),
                       max_length=max_length, batch_size=batch_size)
    train = list(dm.records_dataloader(pool))
    val = list(dm.records_dataloader(query, batch_size=n_query))
    lengths = {int(b["attention_mask"].sum(1).min()) for b in train + val} | \
        {int(b["attention_mask"].sum(1).max()) for b in train + val}
    assert len(lengths) == 1, f"examples of different lengths: {lengths}"
    return {"model_dir": mdir, "model": model, "batch_size": batch_size, "n_train": n_train, "train": train,
            "val": val, "max_length": max_length,
            "parameters": sum(p.numel() for p in model.parameters()), "tokens_per_example": lengths.pop()}


def tracked_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in TARGETS]


def example_losses(model, batch) -> torch.Tensor:
    """Per-example mean token cross-entropy over the response tokens (our SFT loss), ``[B]``."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"][:, 1:]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100,
                                           reduction="none")
    n = (labels != -100).sum(1).clamp(min=1)
    return ce.sum(1) / n


# ----------------------------------------------------------------------------------- ours
class Ours:
    def __init__(self, inp: dict, work: Path):
        from iprox_lightning.scoring import influence_metric, tracked_modules, virtual_linears

        self.inp, self.work = inp, work
        self.model = inp["model"]
        self.modules = tracked_modules(self.model)
        self.keys = [v.key for v in virtual_linears(self.modules)]
        assert sorted(self.modules) == sorted(tracked_names(self.model)), "tracked layers differ"
        self.metric = None
        self.make_metric = lambda: influence_metric("ekfac", kfac_examples=inp["n_train"])

    def ekfac_fit(self):
        metric = self.make_metric()
        metric.fit(self.model, self.modules, self.keys, self.inp["train"], dtype=torch.float32)
        self.metric = metric

    def ekfac_scores(self):
        from iprox_lightning.scoring import InfluenceScorer, ScoringConfig

        # plain inner products of every query example with every training example, as kronfluence's pairwise scores
        # (each query example is its own task; no cosine normalisation, which kronfluence does not do either)
        scorer = InfluenceScorer(self.model, ScoringConfig(method="ekfac", normalize=False), metric=self.metric)
        scorer.collect_validation(self.inp["val"])
        scorer.finalize()
        self.scores = [scorer.score_batch(b) for b in self.inp["train"]]

    def _cli(self, *args):
        from iprox_lightning.cli import main

        with contextlib.redirect_stdout(io.StringIO()):
            rc = main([str(a) for a in args])
        assert not isinstance(rc, int) or rc == 0, f"{args[0]} failed: {rc}"

    def store_build(self):
        self._cli("build_store", "--model", self.inp["model_dir"], "--output_dir", self.work / "store",
                  "--pool", self.work / "pool.jsonl", "--k", 16, "--store_dtype", "float32",
                  "--batch_size", self.inp["batch_size"],
                  "--max_length", self.inp["max_length"], "--overwrite", "true", "--progress", "false",
                  "--accelerator", "cpu")

    def store_query(self):
        shutil.rmtree(self.work / "store" / "cache", ignore_errors=True)  # compute the query's gradients
        self._cli("query", "--store", self.work / "store", "--validation", self.work / "query.jsonl",
                  "--output_dir", self.work / "query_out", "--batch_size", len(self.inp["val"][0]["id"]),
                  "--overwrite", "true")


# ----------------------------------------------------------------------------------- kronfluence
class Kronfluence:
    def __init__(self, inp: dict, work: Path):
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.task import Task

        names = tracked_names(inp["model"])

        class LMTask(Task):
            def compute_train_loss(self, batch, model, sample=False):
                assert not sample  # empirical Fisher, as ours
                return example_losses(model, batch).sum()

            def compute_measurement(self, batch, model):
                return example_losses(model, batch).sum()

            def get_influence_tracked_modules(self):
                return names

            def get_attention_mask(self, batch):
                return batch["attention_mask"]

        self.task = LMTask()
        self.model = prepare_model(copy.deepcopy(inp["model"]), self.task)  # it wraps the tracked modules in place
        self.analyzer = Analyzer(analysis_name="peers", model=self.model, task=self.task, cpu=True,
                                 disable_tqdm=True, disable_model_save=True, output_dir=str(work / "kronfluence"))
        keys = ("input_ids", "attention_mask", "labels")
        self.train = [{k: b[k][j] for k in keys} for b in inp["train"] for j in range(len(b["id"]))]
        self.query = [{k: b[k][j] for k in keys} for b in inp["val"] for j in range(len(b["id"]))]
        self.bs, self.qbs = len(inp["train"][0]["id"]), len(self.query)

    def ekfac_fit(self):
        from kronfluence.arguments import FactorArguments

        with contextlib.redirect_stdout(io.StringIO()):
            self.analyzer.fit_all_factors(factors_name="ekfac", dataset=self.train, per_device_batch_size=self.bs,
                                          factor_args=FactorArguments(strategy="ekfac", use_empirical_fisher=True),
                                          overwrite_output_dir=True)

    def ekfac_scores(self):
        with contextlib.redirect_stdout(io.StringIO()):
            self.analyzer.compute_pairwise_scores(scores_name="scores", factors_name="ekfac", query_dataset=self.query,
                                                  train_dataset=self.train, per_device_query_batch_size=self.qbs,
                                                  per_device_train_batch_size=self.bs, overwrite_output_dir=True)


# ----------------------------------------------------------------------------------- bergson
class Bergson:
    def __init__(self, inp: dict, work: Path):
        from datasets import Dataset

        self.inp, self.work = inp, work
        self.model = copy.deepcopy(inp["model"])
        prefix = self.model.base_model_prefix + "."  # bergson hooks the base model: names relative to it
        self.names = {n.removeprefix(prefix) for n in tracked_names(self.model)}
        rows = [(b["input_ids"][j].tolist(), b["labels"][j].tolist()) for b in inp["train"]
                for j in range(len(b["id"]))]
        self.ds = Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows],
                                     "length": [len(r[0]) for r in rows]})
        bs = len(inp["train"][0]["id"])
        self.batches = [list(range(j, min(j + bs, len(rows)))) for j in range(0, len(rows), bs)]
        self.index = work / "bergson_index"

    def store_build(self):
        from bergson import IndexConfig, collect_gradients
        from bergson.utils.worker_utils import processor_for

        shutil.rmtree(self.index, ignore_errors=True)
        cfg = IndexConfig(run_path=str(self.index), projection_dim=16, loss_reduction="mean", precision="fp32")
        shutil.rmtree(cfg.partial_run_path, ignore_errors=True)
        cfg.partial_run_path.mkdir(parents=True)
        processor = processor_for(cfg)
        processor.save(cfg.partial_run_path)
        with contextlib.redirect_stderr(io.StringIO()):
            collect_gradients(self.model, self.ds, processor, cfg, batches=self.batches, target_modules=self.names)
        shutil.move(str(cfg.partial_run_path), str(self.index))

    def store_query(self):
        from bergson import Attributor

        attr = Attributor(str(self.index), device="cpu", unit_norm=True)
        out = []
        for b in self.inp["val"]:
            with attr.trace(self.model.base_model, None, modules=self.names) as res:
                example_losses(self.model, b).sum().backward()
            self.model.zero_grad(set_to_none=True)
            out.append(res.scores)
        self.scores = out


# ----------------------------------------------------------------------------------- run
def versions() -> dict:
    from importlib.metadata import version

    out = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    for name in ("kronfluence", "bergson", "transformers"):
        try:
            out[name] = version(name)
        except Exception:  # noqa: BLE001 - a peer not installed: its stages are skipped
            out[name] = None
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(a, on_repeat=None) -> dict:
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    inp = build_inputs(work, a.train, a.query, a.prompt_len, a.response_len, a.seed, a.batch_size)
    ver = versions()
    ours = Ours(inp, work)
    peers = {"kronfluence": Kronfluence(inp, work) if ver["kronfluence"] else None,
             "bergson": Bergson(inp, work) if ver["bergson"] else None}
    stages = [s for s in a.stages if peers[PEER_OF[s]] is not None]
    secs = {s: {"ours": [], "peer": []} for s in stages}
    meta = {"command": "python bench/peers.py " + " ".join(a.argv), "versions": ver, "threads": a.threads,
            "parameters": inp["parameters"], "train": a.train, "query": a.query,
            "tokens_per_example": inp["tokens_per_example"], "repeats": a.repeats, "batch_size": a.batch_size,
            "projection_k": 16, "store_dtype": "float32", "tracked_layers": len(tracked_names(inp["model"]))}
    # one untimed warm-up of every stage (imports, first-call allocations), then the timed repeats
    for r in range(-1, a.repeats):
        for s in stages:
            sides = [("ours", ours), ("peer", peers[PEER_OF[s]])]
            for who, obj in (sides if r % 2 == 0 else sides[::-1]):
                t = timed(getattr(obj, s))
                print(f"{'warm-up' if r < 0 else f'repeat {r}'}: {s} {who} {t:.2f} s", flush=True)
                if r >= 0:
                    secs[s][who].append(t)
        if r >= 0 and on_repeat is not None:  # a stopped run keeps the repeats it finished
            on_repeat(summarise(meta, secs, stages, r + 1))
    return summarise(meta, secs, stages, a.repeats)


def summarise(meta: dict, secs: dict, stages: list, done: int) -> dict:
    rows = []
    for s in stages:
        mo, mp = statistics.median(secs[s]["ours"]), statistics.median(secs[s]["peer"])
        rows.append({"stage": s, "peer": PEER_OF[s], "ours_s": secs[s]["ours"], "peer_s": secs[s]["peer"],
                     "ours_median_s": mo, "peer_median_s": mp, "ratio": mo / mp})
    return {"meta": {**meta, "repeats_done": done}, "rows": rows}


def markdown(results: dict) -> str:
    m, v = results["meta"], results["meta"]["versions"]
    threads = f"{m['threads']} thread" + "s" * (m["threads"] != 1)
    lines = [f"| stage (tiny Llama {m['parameters'] / 1e6:.1f}M, {m['train']} × {m['query']} examples of "
             f"{m['tokens_per_example']} tokens, batches of {m.get('batch_size', 8)}, {threads}, median of "
             f"{m['repeats']}) | peer | ours s | peer s | ours / peer |", "|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['stage']} | {r['peer']} {v[r['peer']]} | {r['ours_median_s']:.2f} | "
                     f"{r['peer_median_s']:.2f} | {r['ratio']:.2f} |")
    return "\n".join(lines) + f"\n\ntorch {v['torch']}, transformers {v['transformers']}.\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/peers")
    ap.add_argument("--work", default="/tmp/iprox_peers", help="scratch directory (model, stores, peers' outputs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--query", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="training examples per batch, both sides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write = lambda res: (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")  # noqa: E731
    results = run(a, on_repeat=write)
    write(results)
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
