"""Scoring with the proxy and the query of a proxy's store against ``train.py plan`` on the CPU (issue 64 item 4's 8B
x1 rows): per run, a child process builds a random-init target of a shape (``bench/plan_memory.py``'s
``STAGE1_SHAPES``; ``--layers`` decoder layers) and its proxy at the plan's ranks (:func:`iprox_lightning.analysis.
memory.proxy_model`: every tracked linear a ``LowRankLinear`` keeping ``1 - sparsity`` of its weights, built on the
meta device so no dense copy exists), runs the product's code on random token batches and samples its anonymous
resident memory (``RssAnon`` every 5 ms, ``plan_memory.PeakSampler``) from after the models are built (the baseline:
before them) to the end:

* ``score_proxy``: what ``InfluenceScoringModule(model=<proxy>, validation_model=<target>)`` runs: the scorer's
  preparation on the target (``InfluenceScorer.fit(..., validation_model=target)``), the target dropped (as the
  module drops it), then the pool scored with the proxy; against ``scoring with the proxy (tracin)``;
* ``query``: what ``train.py query --validation_model <target>`` runs on a proxy's store: the store's projections on
  the proxy (``GradientProjector(..., pairs_from=target)``), the validation batches' projected gradients summed per
  task (``task_sums``), the models dropped, then the stored vectors (float16, ``write_every_n_batches · B`` rows per
  shard, random here: the query reads them as stored) streamed through ``query_table``; against
  ``query (proxy store)``.

  flock /tmp/iprox-model.lock python bench/plan_proxy.py --shape small --out bench/results/plan/proxy_small.json

Each run is appended to the JSON's ``runs`` with its command line; ``tests/test_plan_proxy_measured.py`` checks
every recorded run against today's plan (±20%, no model run).
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

KINDS = ("score_proxy", "query")
STAGES = {"score_proxy": "scoring with the proxy (tracin)", "query": "query (proxy store)"}


def build_proxy(target, ranks: dict):
    """A proxy of ``target``: every layer named in ``ranks`` a random ``LowRankLinear`` of that rank, the other
    tensors copies of the target's; built on the meta device then allocated once (no dense copy of a factorised
    layer ever exists)."""
    import torch
    from transformers import AutoModelForCausalLM

    from iprox_lightning.engine import LowRankLinear

    with torch.device("meta"):
        proxy = AutoModelForCausalLM.from_config(target.config, attn_implementation="eager")
        for name, r in ranks.items():
            old = proxy.get_submodule(name)
            parent, _, leaf = name.rpartition(".")
            setattr(proxy.get_submodule(parent), leaf,
                    LowRankLinear(old.in_features, old.out_features, r, bias=old.bias is not None))
    proxy = proxy.to_empty(device="cpu")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        own = dict(target.named_parameters())
        for n, p in proxy.named_parameters():
            if n in own and own[n].shape == p.shape:
                p.copy_(own[n])
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        tb = dict(target.named_buffers())
        for n, b in proxy.named_buffers():
            b.copy_(tb[n])
    proxy.tie_weights()  # to_empty allocates a tied head apart from the embeddings: tied again, as a loaded proxy is
    return proxy.eval()


def _ranks(config, sparsity: float) -> dict:
    from iprox_lightning.analysis import ModelSizes, proxy_sizes

    shape, _ = proxy_sizes(ModelSizes.from_config(config), sparsity)
    return {l.name: l.rank for l in shape.linears if l.rank is not None}


def child(args: dict) -> None:
    import gc

    import lightning as L  # noqa: F401  (the imports a stage makes, before the baseline)
    import torch
    from transformers import AutoModelForCausalLM
    import transformers.models.llama.modeling_llama  # noqa: F401

    from iprox_lightning.scoring import InfluenceScorer, ScoringConfig  # noqa: F401
    from iprox_lightning.scoring import GradientProjector, query_table, task_sums  # noqa: F401
    from plan_memory import PeakSampler, stage1_config, vm_hwm
    from plan_scoring import batches

    torch.set_num_threads(args["threads"])
    config = stage1_config(args["shape"], args["layers"])
    ranks = _ranks(config, args["sparsity"])
    B, T = args["batch_size"], args["max_length"]
    pool = batches(config, args["pool"], B, T, "p", seed=1)
    val = batches(config, 2 * args["columns"], B, T, "v", columns=args["columns"], seed=2)
    sampler = PeakSampler(0.005)
    t0 = time.time()
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    proxy = build_proxy(target, ranks)
    gc.collect()
    sampler.stop()  # the construction's transients are not the stage's: the peak from here, over the same baseline
    sampler = PeakSampler(0.005, base=sampler.base)
    if args["kind"] == "score_proxy":
        from iprox_lightning.scoring import InfluenceScorer, ScoringConfig

        scorer = InfluenceScorer(proxy, ScoringConfig(method="tracin", per_task=True))
        scorer.fit(val, validation_model=target)
        del target  # InfluenceScoringModule.on_predict_start: the module's reference goes (the scorer's went in fit)
        gc.collect()
        n = sum(len(scorer.score_batch(b)["id"]) for b in pool)
        assert n == args["pool"]
    else:
        from iprox_lightning.scoring import GradientProjector, query_table, task_sums

        projector = GradientProjector(proxy, k=args["k"], pairs_from=target)
        names, S, counts = task_sums(projector.project_batch(b) for b in val)
        dim = projector.dim
        del projector, target, proxy  # the query's models and projector: dropped before the table
        gc.collect()
        rows = B * args["write_every_n_batches"]

        def shards():  # as iter_shards yields them: one shard read at a time
            g = torch.Generator().manual_seed(5)
            for j in range(0, args["pool"], rows):
                n = min(rows, args["pool"] - j)
                yield {"ids": [f"p{j + r}" for r in range(n)], "tasks": [None] * n,
                       "vectors": torch.randn(n, dim, generator=g).to(torch.float16),
                       "n_tokens": torch.full((n,), T // 2), "zero_grad": torch.zeros(n, dtype=torch.bool),
                       "nonfinite": torch.zeros(n, dtype=torch.bool)}

        table = query_table(shards(), names, S)
        assert len(table) == args["pool"] and len(names) == args["columns"]
    peak = sampler.stop()
    print(json.dumps({"baseline": sampler.base, "peak": peak, "vm_hwm": vm_hwm(), "seconds": time.time() - t0}))


def run_settings(args: dict):
    from iprox_lightning.analysis import RunSettings

    T = args["max_length"]
    share = (T - int(T * 0.5)) / T  # plan_scoring.PROMPT_SHARE: the scored positions over all
    return RunSettings(max_length=T, batch_size=args["batch_size"], precision="32-true", device_kind="cpu",
                       response_share=share, pool_size=args["pool"], tasks=args["columns"], store_k=args["k"],
                       write_every_n_batches=args["write_every_n_batches"], sparsity=args["sparsity"],
                       validation_examples=2 * args["columns"])


@functools.lru_cache(maxsize=None)
def _counts(shape: str, layers: int | None, max_length: int):
    from iprox_lightning.analysis import ModelSizes, RunSettings, run_activations
    from plan_memory import stage1_config

    config = stage1_config(shape, layers)
    return config, ModelSizes.from_config(config, name=shape), run_activations(config, RunSettings(
        max_length=max_length, precision="32-true"))


def planned(args: dict) -> dict:
    """The row ``train.py plan`` prints for the run (``plan_stages``; on a CPU the device is the host)."""
    from iprox_lightning.analysis import plan_stages

    config, sizes, (acts, acts32) = _counts(args["shape"], args["layers"], args["max_length"])
    stage = {s.stage: s for s in plan_stages(sizes, config, run_settings(args), acts=acts, acts32=acts32)}
    return stage[STAGES[args["kind"]]].to_dict()


def measure(args: dict, timeout: float | None = None) -> dict:
    from plan_memory import measured_child

    run = measured_child(str(Path(__file__).resolve()), args, args["kind"], planned(args), threads=args["threads"],
                         timeout=timeout)
    return {"args": args, **run}


def main() -> None:
    from plan_memory import append_run

    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--shape", default="small")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--pool", type=int, default=8)
    ap.add_argument("--columns", type=int, default=3, help="validation tasks (2 examples each)")
    ap.add_argument("--k", type=int, default=16, help="query: the store's projection rows per side")
    ap.add_argument("--write-every-n-batches", type=int, default=50)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON file; each run is appended under 'runs'")
    a = ap.parse_args()
    out = Path(a.out)
    code = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for kind in a.kinds:
        args = {"kind": kind, "shape": a.shape, "layers": a.layers, "max_length": a.max_length,
                "batch_size": a.batch_size, "pool": a.pool, "columns": a.columns, "k": a.k,
                "write_every_n_batches": a.write_every_n_batches, "sparsity": a.sparsity, "threads": a.threads}
        t0 = time.time()
        result = measure(args)
        result.update(seconds=time.time() - t0, code=code,
                      command_line="python bench/plan_proxy.py " + " ".join(sys.argv[1:]))
        print(kind, end=" ")
        append_run(out, result)


if __name__ == "__main__":
    main()
