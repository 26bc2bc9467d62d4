"""The one-call GPU check (issue 54): what a bf16 run on one H100 / H200 costs and whether every stage runs there.

One JSON per run under ``bench/results/gpu/`` (host, GPU, torch / CUDA versions, commit), rewritten after every part,
so a run cut short still leaves what it measured. Parts, each with its own time budget (``--budget-<part>``) and its
own process (a crash, an out-of-memory error or a hang costs that part only; a part that runs out of time is killed
and recorded ``timed_out`` with what it had written; one that the total budget cannot fit is ``skipped`` with the
reason; one that raises is ``failed`` with the error's type and message, and the run carries on):

* ``engine:<shape>`` (``--shapes``; Llama-3.2-1B and -3B, random init from configs built in code, ``--dtype``
  bfloat16): ``bench/speed.py``'s rotating loop on the device: the scoring engine's tokens/s (one forward + one
  backward with the per-layer features), the plain forward+backward floors, proxies at ρ 0.3 / 0.5 / 0.7 built by
  the product's Stage-1 code (``compress_model``, random factors: the proxy's shapes, no SVD time) and their
  time ratio to the target (and the analytic FLOP ratio beside it), the gradient store's per-batch build work
  (tokens/s, target and proxies), and the peak CUDA memory of every stage.
* ``build``: Stage 1 and Stage 2 of build_proxy at the Llama-3.2-1B shape (``--build-shape``, random init) in one
  ``fit`` of the product's ``IPSVDCallback`` and ``ProxyAlignModule`` on the device; per stage the measured peak
  (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, reset between them; ``RssAnon`` on a CPU) beside
  the plan's (``build_proxy_plan`` for the same settings).
* ``score``: scoring at the Llama-3.2-1B width (``--score-shape``, two random-init blocks: ``--score-layers``) with
  the product's ``InfluenceScoringModule`` in a Lightning ``predict``: partitioned EK-FAC (``kfac_partitions``) and
  TracIn with the validation gradients held in bfloat16 on the host; per run the measured peak (CUDA allocated /
  reserved, reset before each run; ``RssAnon`` on a CPU) beside the plan's scoring stage (``scoring_plan``).
* ``pipeline``: the product's ``pipeline`` command on SmolLM2-135M (the GGUF, or, where it is absent, a random
  SmolLM2-135M-shape model: the JSON says which) over ~2k pool examples, ``bf16-mixed``, on the GPU: warm-up ->
  build_proxy (IPSVD + alignment) -> score (target, proxy) -> select; seconds, tokens/s and peak CUDA memory per
  stage, the proxy's retention; then ``build_store`` of the warmed target (bf16 weights) if the budget allows.
* ``fsdp``: Lightning's ``FSDPStrategy`` (FSDP1) on one GPU: a warm-up and a scoring run through the stage
  commands (``python train.py fit --config configs/warmup.yaml`` / ``predict --config configs/score.yaml``). It
  needs CUDA; on a CPU (``--tiny``) the same two commands run with the default strategy, recorded as such.

The default parts (``engine:llama-1b``, ``build``, ``score``, ``pipeline``) fit the default 540 s; the pipeline part's
budget is the H100's recorded stage times (``H100_SECONDS``) plus its own overhead, the score part's its share of the
recorded scoring plus its eigendecompositions and start-up (``SCORE_BUDGET_S``); ``fsdp`` runs when named
(``--parts fsdp``; with ``--tiny`` always: 80 s more than the defaults leave), and ``--shapes llama-1b llama-3b``
adds the 3B engine (110 s more: raise ``--budget`` or run it alone with ``--parts``).

Usage::

    bash bench/gpu_check.sh                          # on the GPU machine: nvidia-smi, versions, then this script
    python bench/gpu_check.py --tiny                 # on a CPU: tiny shapes, every part (tests/test_gpu_check.py)
    python bench/gpu_check.py --prepare .gpu_check   # beforehand, on a machine with ../shared and PyPI: the inputs
                                                     # that travel to the GPU machine (docs/GUIDE.md)

The inputs it looks for (``--inputs``, default ``.gpu_check/``, which ``--prepare`` writes): ``pool.jsonl`` (a
stratified 2,048-example sample of ``../shared/data/pool``), ``validation.jsonl`` (three tasks from held-out pool
rows), ``smollm2/`` (SmolLM2's tokenizer and config, no weights: the GGUF is too large to travel), ``wheels/`` (the
packages the GPU machine lacks), ``commit.txt``. Without them it falls back to ``../shared`` and then to the built-in
data, and says so in the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO), str(REPO / "bench")):  # this checkout's package and bench/speed.py, wherever it is run from
    if _p not in sys.path:
        sys.path.insert(0, _p)

SCHEMA = 1
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FSDP_NEEDS_CUDA = "Lightning's FSDPStrategy requires a CUDA accelerator"
VALIDATION_TASKS = {"gsm8k": "gsm8k_train", "strategyqa": "strategyqa", "xquad": "xquad_en"}
"""--prepare's validation tasks: task name -> the pool category its held-out rows come from."""
PREPARE_POOL_SIZE = 2048
"""--prepare's pool sample size (the check's ~2k pool examples)."""
WHEELS = ("jsonargparse", "docstring-parser", "typeshed-client", "gguf")
"""Packages the project imports that the GPU machine's image lacks (its package list: /work/.library/device/KINDS.md);
--prepare downloads their wheels at the versions installed here (pure Python)."""

# what --tiny changes (options given on the command line win): tiny shapes and the built-in data on a CPU, every part
# in about a minute (the GPU defaults are the parser's)
TINY = dict(shapes=["tiny"], batches=2, batch_size=4, seq_len=32, store_k=4, pool_size=120, max_length=64,
            pipeline_batch_size=8, construction_fraction=0.1, val_per_task=4, fsdp_pool=40, budget=540.0,
            budget_engine=120.0, budget_pipeline=150.0, budget_fsdp=120.0, budget_build=120.0, build_shape="tiny",
            build_max_length=64, build_batch_size=2, build_probe_tokens=128, build_steps=2, budget_score=120.0,
            score_shape="tiny", score_layers=0, score_max_length=32, score_batch_size=2, score_kfac_examples=8,
            score_pool=8, score_val_per_task=2)

H100_SECONDS = {"warmup": 56.6, "build_proxy": 125.2, "score:target": 17.5, "score:proxy": 24.2}
"""The pipeline's stages as one H100 80 GB ran them (SmolLM2-135M, a 2,000-example pool, stage by stage:
``bench/results/fidelity_gpu2048/state.json``, each stage's ``wall_s`` and ``host``): the pipeline part's budget."""
PIPELINE_OVERHEAD_S = 40.0
"""The pipeline part's own start, its inputs and ``select`` beside the recorded stages (on a CPU, --tiny: ~25 s)."""
PIPELINE_BUDGET_S = round(sum(H100_SECONDS.values()) + PIPELINE_OVERHEAD_S)
SCORE_WORK_SHARE = 1 / 4
"""The score part's scored examples against the pipeline's target scoring (``score:target``: 2,000 examples): at its
defaults 2 x 2 factor passes of 32 examples (EK-FAC, two partitions), 24 validation and 32 pool examples per method,
~250 examples of 512 tokens, at about twice SmolLM2-135M's cost per token (the 1B width, two blocks and the 128k
head against 30 blocks of 576)."""
SCORE_EIGH_S = 30.0
"""The score part's float64 eigendecompositions at its defaults: six of 8192 x 8192 (gate / up outputs, down input,
two blocks) and 22 of at most 2048, one at a time on the device (a few seconds each for the largest: an estimate, no
H100 record)."""
SCORE_OVERHEAD_S = 25.0
"""The part's start-up (imports, CUDA context, the random model on the host) and two Lightning predict runs."""
SCORE_BUDGET_S = round(SCORE_WORK_SHARE * H100_SECONDS["score:target"] + SCORE_EIGH_S + SCORE_OVERHEAD_S)


# ----------------------------------------------------------------------------------------------- arguments

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and the built-in data (a CPU, seconds)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--results-dir", default=str(REPO / "bench" / "results" / "gpu"))
    ap.add_argument("--copy-to", default=None, help="also copy the JSON and each part's log here ($OUT on the GPU "
                                                     "machine: what comes back from it)")
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a new one under /tmp)")
    ap.add_argument("--inputs", default=str(REPO / ".gpu_check"), help="what --prepare wrote")
    ap.add_argument("--parts", nargs="*", default=None, help="run only these parts (names as in the JSON)")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds for all parts together (the device tool's 600 s command, less the start-up)")
    ap.add_argument("--budget-engine", type=float, default=None,
                    help="seconds per engine shape (default: 80 for llama-1b, 110 for llama-3b, 80 otherwise)")
    ap.add_argument("--budget-pipeline", type=float, default=PIPELINE_BUDGET_S,
                    help=f"default {PIPELINE_BUDGET_S:.0f}: the H100's recorded stage times (H100_SECONDS) + "
                         f"{PIPELINE_OVERHEAD_S:.0f} s")
    ap.add_argument("--budget-build", type=float, default=100.0)
    ap.add_argument("--budget-score", type=float, default=SCORE_BUDGET_S,
                    help=f"default {SCORE_BUDGET_S:.0f} (SCORE_BUDGET_S: its work against the H100's recorded scoring)")
    ap.add_argument("--budget-fsdp", type=float, default=80.0)
    ap.add_argument("--min-part-s", type=float, default=20.0, help="a part starts only with this much time left")
    # engine
    ap.add_argument("--shapes", nargs="*", default=["llama-1b"],
                    help="engine shapes (llama-3b as well: --shapes llama-1b llama-3b, 110 s more)")
    ap.add_argument("--dtype", default="bfloat16", help="the engine part's model dtype")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rhos", type=float, nargs="*", default=[0.3, 0.5, 0.7])
    ap.add_argument("--store-k", type=int, default=16)
    # pipeline and fsdp
    ap.add_argument("--precision", default="bf16-mixed", help="the Trainer precision of the pipeline and fsdp parts")
    ap.add_argument("--smollm2", default=None, help=f"the SmolLM2 model: a path, or 'random' for a random-init "
                                                    f"SmolLM2-135M-shape model (default: {GGUF_NAME} in --inputs, "
                                                    "shared/models or ../shared/models, else 'random')")
    ap.add_argument("--pool", default=None, help="pool JSONL (default: --inputs/pool.jsonl, else a sample of "
                                                 "../shared/data/pool/instructions.jsonl, else the built-in pool)")
    ap.add_argument("--pool-size", type=int, default=2048)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--pipeline-batch-size", type=int, default=16)
    ap.add_argument("--construction-fraction", type=float, default=0.05)
    ap.add_argument("--val-per-task", type=int, default=8)
    ap.add_argument("--sparsity", type=float, default=0.5)
    # build (Stage 1 and Stage 2 of build_proxy against the plan)
    ap.add_argument("--build-shape", default="llama-3.2-1b", help="a shape of bench/plan_memory.py's STAGE1_SHAPES")
    ap.add_argument("--build-max-length", type=int, default=512)
    ap.add_argument("--build-batch-size", type=int, default=4, help="the build batch (the paper's 4)")
    ap.add_argument("--build-probe-tokens", type=int, default=1024, help="IPSVDCallback num_probe_tokens (shipped)")
    ap.add_argument("--build-steps", type=int, default=3, help="Stage 2 alignment steps")
    # score (partitioned EK-FAC and TracIn with the validation-gradient holdings against the plan)
    ap.add_argument("--score-shape", default="llama-3.2-1b", help="a shape of bench/plan_memory.py's STAGE1_SHAPES")
    ap.add_argument("--score-layers", type=int, default=2,
                    help="decoder layers of the score shape (the 1B width with 2 blocks: 6 float64 eigendecompositions "
                         "of 8192 x 8192; 0: the shape's)")
    ap.add_argument("--score-max-length", type=int, default=512)
    ap.add_argument("--score-batch-size", type=int, default=4)
    ap.add_argument("--score-kfac-examples", type=int, default=32)
    ap.add_argument("--score-partitions", type=int, default=2, help="EK-FAC's kfac_partitions")
    ap.add_argument("--score-pool", type=int, default=32, help="pool examples scored per method")
    ap.add_argument("--score-tasks", type=int, default=3, help="validation tasks (score columns)")
    ap.add_argument("--score-val-per-task", type=int, default=8)
    ap.add_argument("--fsdp-pool", type=int, default=256, help="pool examples of the fsdp part (the first of the pool)")
    ap.add_argument("--prepare", default=None, metavar="DIR", help="write the inputs that travel to DIR and exit")
    # internal: one part in a child process
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                 if a.startswith("--")}
        for key, value in TINY.items():
            if key not in given:
                setattr(args, key, value)
        args.device = args.device or "cpu"
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    import speed

    if unknown := [s for s in args.shapes if s not in speed.SHAPES]:
        ap.error(f"--shapes: unknown {unknown}; shapes: {', '.join(speed.SHAPES)}")
    every = [f"engine:{s}" for s in args.shapes] + ["build", "score", "pipeline", "fsdp"]
    if args.parts is not None and (unknown := [p for p in args.parts if p not in every]):
        ap.error(f"--parts: unknown {unknown}; parts: {', '.join(every)}")
    if args.smollm2 not in (None, "random") and not Path(args.smollm2).exists():
        ap.error(f"--smollm2: {args.smollm2} not found (a path, or 'random')")
    return args


OPT_IN_PARTS = ("fsdp",)
"""Parts that run only when named in ``--parts`` (the defaults fit one 540 s device command without them)."""


def part_names(args) -> list[str]:
    names = [f"engine:{s}" for s in args.shapes] + ["build", "score", "pipeline", "fsdp"]
    if args.parts is None:
        return [n for n in names if n not in OPT_IN_PARTS or args.tiny]
    return [n for n in names if n in args.parts]


def part_budget(args, name: str) -> float:
    if name.startswith("engine:"):
        if args.budget_engine is not None:
            return args.budget_engine
        return {"llama-1b": 80.0, "llama-3b": 110.0}.get(name.split(":", 1)[1], 80.0)
    return {"build": args.budget_build, "score": args.budget_score, "pipeline": args.budget_pipeline,
            "fsdp": args.budget_fsdp}[name]


# ----------------------------------------------------------------------------------------------- records

def write_json(path: Path, obj) -> None:
    """``obj`` as JSON at ``path``, written whole (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def error_record(e: BaseException) -> dict:
    """An exception as the JSON records it: type, message, the last lines of its traceback. A ``SystemExit`` (a
    command's argument parser refusing its input) printed its message before exiting: the part's ``log_tail``."""
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    message = (f"exit status {e.code}: the command's own error message is in log_tail" if isinstance(e, SystemExit)
               else str(e)[:2000])
    return {"type": type(e).__name__, "message": message, "traceback_tail": "".join(tb)[-3000:]}


def commit_info(inputs: Path | None = None) -> dict:
    """The commit of this checkout: ``git`` where the checkout has its history, else ``$GPU_CHECK_COMMIT`` (the GPU
    machine gets a copy of the working tree without ``.git``), else the ``commit.txt`` --prepare wrote in
    ``inputs``."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=20)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=20).stdout.strip()
            return {"commit": head.stdout.strip(), "source": "git", "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        pass
    if os.environ.get("GPU_CHECK_COMMIT"):
        return {"commit": os.environ["GPU_CHECK_COMMIT"], "source": "GPU_CHECK_COMMIT", "dirty": None}
    if inputs is not None and (inputs / "commit.txt").exists():
        return {"commit": (inputs / "commit.txt").read_text().strip(), "source": f"{inputs / 'commit.txt'} (--prepare)",
                "dirty": None}
    return {"commit": None, "source": "unknown (no git, no GPU_CHECK_COMMIT)", "dirty": None}


def environment(args) -> dict:
    """Host, GPU, versions."""
    import lightning
    import torch
    import transformers

    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
               "multiprocessors": props.multi_processor_count, "count": torch.cuda.device_count()}
    return {
        "host": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformers": transformers.__version__, "lightning": lightning.__version__,
        "gpu": gpu, "device": args.device, "bf16_supported": bool(torch.cuda.is_available()
                                                                  and torch.cuda.is_bf16_supported()),
    }


class PartRecord:
    """One part's record in its child process: ``result`` grows step by step and is written after each step."""

    def __init__(self, path: Path):
        self.path = path
        self.result: dict = {}
        self.status = "running"
        self.error = None

    def update(self, **fields) -> None:
        self.result.update(fields)
        self.write()

    def write(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
        write_json(self.path, {"status": self.status, "error": self.error, "peak_rss_bytes": usage,
                               "result": self.result})


def peak_memory_note(device: str) -> str | None:
    return None if device == "cuda" else ("not measured on a CPU: torch.cuda.max_memory_allocated counts CUDA memory "
                                          "only (peak_rss_bytes is the part process's peak resident memory)")


# ----------------------------------------------------------------------------------------------- orchestration

def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.prepare:
        return prepare(Path(args.prepare))
    if args.part:
        return run_part(args)
    return run_all(args, argv if argv is not None else sys.argv[1:])


def run_all(args, argv: list[str]) -> dict:
    """Every part in its own process, in order, each within its budget and what is left of the total; the JSON
    written after each."""
    t_start = time.time()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    workdir = Path(args.workdir or f"/tmp/iprox_gpu_check_{stamp}_{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    env = environment(args)
    out = Path(args.results_dir) / f"gpu_check_{stamp}_{env['host']}.json".replace(os.sep, "_")
    record = {"schema": SCHEMA, "started_utc": stamp, "finished_utc": None, "tiny": args.tiny,
              **env, "commit": commit_info(Path(args.inputs)), "workdir": str(workdir),
              "args": {k: v for k, v in vars(args).items() if k not in ("part", "part_out", "deadline")},
              "budget_s": args.budget, "parts": {}}
    save = _saver(out, args.copy_to, record)
    save()
    print(f"[gpu_check] {env['gpu']['name'] if env['gpu'] else 'no GPU'}, torch {env['torch']} (CUDA {env['cuda']}), "
          f"budget {args.budget:.0f} s -> {out}", flush=True)
    deadline = t_start + args.budget
    for name in part_names(args):
        budget = part_budget(args, name)
        left = deadline - time.time()
        entry: dict = {"budget_s": budget}
        if left < args.min_part_s:
            entry.update(status="skipped", reason=f"budget spent: {left:.0f} s of the {args.budget:.0f} s total left, "
                                                  f"a part needs at least {args.min_part_s:.0f} s")
        else:
            entry.update(run_child(args, argv, name, workdir, min(budget, left)))
        record["parts"][name] = entry
        save(logs=[workdir / "logs" / f"{_safe(name)}.log"])
        print(f"[gpu_check] {name}: {entry['status']}"
              + (f" in {entry['seconds']:.1f} s" if "seconds" in entry else "")
              + (f" ({entry['reason']})" if entry.get("reason") else "")
              + (f": {entry['error']['type']}: {entry['error']['message'][:300]}" if entry.get("error") else ""),
              flush=True)
    record["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    record["seconds"] = time.time() - t_start
    save()
    print(f"[gpu_check] done in {record['seconds']:.0f} s: "
          + ", ".join(f"{k} {v['status']}" for k, v in record["parts"].items()) + f"\n[gpu_check] result: {out}",
          flush=True)
    return record


def _safe(name: str) -> str:
    """A file name of letters, digits, '.', '_' and '-' (what comes back from the GPU machine)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _saver(out: Path, copy_to: str | None, record: dict):
    def save(logs=()):
        write_json(out, record)
        if copy_to:
            dest = Path(copy_to)
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(out, dest / out.name)
            for log in logs:
                if log.exists():
                    shutil.copy(log, dest / log.name)
    return save


def run_child(args, argv: list[str], name: str, workdir: Path, timeout: float) -> dict:
    """Run part ``name`` in a child process (its own session, killed as a group when ``timeout`` runs out); its
    record as it last wrote it, with the status the parent saw."""
    part_out = workdir / "parts" / f"{_safe(name)}.json"
    log_path = workdir / "logs" / f"{_safe(name)}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    part_out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--part", name, "--part-out", str(part_out),
           "--workdir", str(workdir), "--deadline", str(time.time() + timeout)]
    print(f"[gpu_check] {name}: started, budget {timeout:.0f} s, log {log_path}", flush=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc = child.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the child's own session: it and anything it started
            rc = child.wait()
            timed_out = True
    entry = json.loads(part_out.read_text()) if part_out.exists() else {"status": "failed", "error": None, "result": {}}
    entry["seconds"] = time.time() - t0
    entry["returncode"] = rc
    if timed_out:
        entry["status"] = "timed_out"
        entry["reason"] = f"killed after its budget of {timeout:.0f} s; the result holds what it had recorded"
    elif entry["status"] == "running" or entry.get("error") is None and entry["status"] != "ok":
        # the process died without finishing its record (a crash, a kill for memory), not an exception
        entry["status"] = "failed"
        entry["error"] = {"type": "ProcessDied", "message": f"exit status {rc} before the part finished (log_tail)"}
    if entry["status"] != "ok":
        entry["log_tail"] = _tail(log_path, 40)
        print(entry["log_tail"], flush=True)
    return entry


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_part(args) -> dict:
    """In the child: run one part, recording its result as it goes; an exception is recorded, not raised."""
    rec = PartRecord(Path(args.part_out))
    rec.write()
    workdir = Path(args.workdir)
    if args.tiny:  # tiny models: one thread (as pipeline does for the built-in model; threads only add overhead)
        import torch

        torch.set_num_threads(1)
    try:
        if args.part.startswith("engine:"):
            engine_part(args, args.part.split(":", 1)[1], rec)
        elif args.part == "build":
            build_part(args, rec)
        elif args.part == "score":
            score_part(args, rec)
        elif args.part == "pipeline":
            pipeline_part(args, workdir, rec)
        elif args.part == "fsdp":
            fsdp_part(args, workdir, rec)
        else:
            raise ValueError(f"unknown part {args.part!r}")
        rec.status = "ok"
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- recorded in the JSON; the next part runs
        rec.status, rec.error = "failed", error_record(e)
        print(f"[gpu_check] {args.part} failed: {rec.error['type']}: {rec.error['message']}", flush=True)
    rec.write()
    return {"status": rec.status, "error": rec.error, "result": rec.result}


def time_left(args) -> float:
    return float("inf") if args.deadline is None else args.deadline - time.time()


# ----------------------------------------------------------------------------------------------- engine part

def engine_part(args, shape: str, rec: PartRecord) -> None:
    """``bench/speed.py`` at ``shape`` on the device: engine, floors, proxies at ``--rhos``, store, memory."""
    import speed

    argv = ["--random-init", "--shape", shape, "--device", args.device, "--dtype", args.dtype,
            "--batches", str(args.batches), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--skip-less", "--proxy-factors", "random", "--store-k", str(args.store_k),
            "--proxy-rhos", *[f"{r:g}" for r in args.rhos], *(["--threads", "1"] if args.tiny else [])]
    rec.update(shape=shape, speed_args=argv)
    res = speed.main(argv)
    rec.update(**engine_summary(res, args.rhos), peak_memory_note=peak_memory_note(args.device), speed=res)


def engine_summary(res: dict, rhos) -> dict:
    """The numbers of a ``speed.main`` result the check reports, by name."""
    tps, ratios = res["tokens_per_s"], res["ratios"]
    proxies = {f"{r:g}": {
        "tokens_per_s": tps[f"p{r:g}"], "time_over_target": ratios[f"proxy{r:g}/target"],
        "flops_over_target": ratios[f"proxy{r:g}/target_flops"], "params": res["proxies"][f"p{r:g}"]["params"],
        "store_tokens_per_s": tps.get(f"s{r:g}"),
        "store_time_over_target": ratios.get(f"store_proxy{r:g}/store_target"),
    } for r in rhos}
    return {"params": res["params"], "tracked_params": res["tracked_params"], "tokens": res["tokens"],
            "device_name": res["device_name"],
            "tokens_per_s": {"engine": tps["a"], "fwd_bwd_tracked": tps["c1"], "fwd_bwd_all": tps["c2"],
                             "store_build": tps.get("s")},
            "engine_over_fwd_bwd_tracked": ratios["engine/fwd_bwd_tracked"], "proxies": proxies,
            "peak_memory_bytes": res["peak_cuda_bytes_per_stage"]}


# ----------------------------------------------------------------------------------------------- build part

def build_part(args, rec: PartRecord) -> None:
    """Stage 1 and Stage 2 of build_proxy at ``--build-shape`` (random init, built on the host as a loaded model is)
    on the device: the product's ``IPSVDCallback`` and ``ProxyAlignModule`` in one Lightning ``fit`` at
    ``--precision`` (``--build-steps`` alignment steps of ``--build-batch-size`` x ``--build-max-length`` random
    tokens, half of them scored), each stage's measured peak beside the plan's (``build_proxy_plan``, the same
    settings). On CUDA the peak is ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``), reset between
    the stages; on a CPU the process's peak ``RssAnon`` over its value before the model was built (sampled every
    5 ms: ``bench/plan_memory.py``'s ``PeakSampler``)."""
    import lightning as L
    import torch
    from transformers import AutoModelForCausalLM

    import plan_memory
    from iprox_lightning.analysis import ModelSizes, RunSettings, build_proxy_plan, saved_activation_bytes
    from iprox_lightning.callbacks import IPSVDCallback
    from iprox_lightning.modules import ProxyAlignModule

    cuda = args.device == "cuda"
    B, T, N = args.build_batch_size, args.build_max_length, args.build_probe_tokens
    config = plan_memory.stage1_config(args.build_shape, None)
    run = RunSettings(max_length=T, align_batch_size=B, precision=args.precision, devices=1,
                      device_kind="cuda" if cuda else "cpu", num_probe_tokens=N, sparsity=args.sparsity,
                      response_share=0.5)
    acts = saved_activation_bytes(config, seq_len=T, precision=run.precision)
    acts32 = saved_activation_bytes(config, seq_len=T, precision="32-true")
    plans = build_proxy_plan(ModelSizes.from_config(config, name=args.build_shape), acts, run, acts32)
    measure = ("torch.cuda.max_memory_allocated (max_memory_reserved beside it), reset between the stages" if cuda
               else "peak RssAnon of the part's process over its value before the model was built (CPU)")
    rec.update(shape=args.build_shape, precision=args.precision, batch_size=B, max_length=T, probe_tokens=N,
               steps=args.build_steps, sparsity=args.sparsity, measure=measure,
               settings={k: getattr(run, k) for k in ("max_length", "align_batch_size", "precision", "devices",
                                                       "device_kind", "num_probe_tokens", "sparsity",
                                                       "response_share")})
    stages: dict = {}

    def peak_now() -> tuple[int, int | None]:
        if cuda:
            return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        return sampler.stop() - base, None

    def record(name: str, plan, seconds: float) -> None:
        measured, reserved = peak_now()
        stages[name] = {"measured_bytes": measured, "reserved_bytes": reserved, "plan_bytes": plan.peak,
                        "plan_over_measured": plan.peak / measured if measured else None, "plan_parts": plan.parts,
                        "seconds": seconds}
        rec.update(stages=stages)

    sampler = base = None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        sampler = plan_memory.PeakSampler(0.005)
        base = sampler.base
    t0 = time.perf_counter()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    batch = plan_memory.random_sft_batch_maker(config.vocab_size, B, T)
    probe = [batch() for _ in range(-(-N // (B * T)))]
    train = [batch() for _ in range(args.build_steps)]

    class Data(L.LightningDataModule):
        def train_dataloader(self):  # the batches as they are (a list would be read as several loaders)
            return torch.utils.data.DataLoader(train, batch_size=None)

        def probe_dataloader(self):
            return probe

    class Peaks(L.Callback):  # after IPSVDCallback: its setup (Stage 1) has run
        def setup(self, trainer, pl_module, stage):
            nonlocal sampler
            record("stage1", plans[0], time.perf_counter() - t0)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            else:
                sampler = plan_memory.PeakSampler(0.005)
            self.t1 = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            if cuda:
                torch.cuda.synchronize()
            record("stage2", plans[1], time.perf_counter() - self.t1)

    module = ProxyAlignModule(target=model, log_layer_cosines=False, keep_best=False)
    del model
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=args.build_steps,
                        precision=args.precision, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[IPSVDCallback(sparsity=args.sparsity, num_probe_tokens=N, health_batches=0),
                                   Peaks()])
    trainer.fit(module, datamodule=Data())
    if set(stages) != {"stage1", "stage2"}:
        raise RuntimeError(f"the build ran {sorted(stages)} of Stage 1 and Stage 2")
    rec.update(stages=stages, seconds=time.perf_counter() - t0,
               proxy_params=sum(p.numel() for p in module.proxy.parameters()))


# ----------------------------------------------------------------------------------------------- score part

SCORE_RUNS = {
    "ekfac_partitioned": {"method": "ekfac", "kfac_partitions": None},  # None: --score-partitions
    "tracin_bf16_host": {"method": "tracin", "validation_gradients": {"dtype": "bfloat16", "device": "cpu"}},
}
"""The score part's runs: the ``InfluenceScoringModule`` settings of each (``ScoringConfig`` fields)."""


def score_runs(args) -> dict[str, dict]:
    return {name: {k: (args.score_partitions if v is None else v) for k, v in kw.items()}
            for name, kw in SCORE_RUNS.items()}


def score_plan_settings(args, cuda: bool, settings: dict) -> dict:
    """The plan's ``RunSettings`` fields of one score run (the plan's scoring stage, the same settings)."""
    return {"max_length": args.score_max_length, "batch_size": args.score_batch_size, "precision": args.precision,
            "devices": 1, "device_kind": "cuda" if cuda else "cpu", "tasks": args.score_tasks,
            "validation_examples": args.score_tasks * args.score_val_per_task, "response_share": 0.5,
            "kfac_examples": args.score_kfac_examples, "method": settings["method"],
            "kfac_partitions": settings.get("kfac_partitions", 1),
            "validation_gradients": settings.get("validation_gradients")}


def score_part(args, rec: PartRecord) -> None:
    """Scoring at ``--score-shape`` (random init, ``--score-layers`` blocks) on the device with the product's
    ``InfluenceScoringModule`` in a Lightning ``predict`` at ``--precision``: partitioned EK-FAC (``kfac_partitions``,
    its factors fitted on ``--score-kfac-examples`` pool examples) and TracIn with the validation gradients held in
    bfloat16 on the host (:data:`SCORE_RUNS`), ``--score-pool`` random examples scored against ``--score-tasks``
    tasks; per run the measured peak (CUDA: ``max_memory_allocated`` / ``max_memory_reserved``, reset before each run;
    a CPU: the part's peak ``RssAnon`` over its value before the model was built) beside the plan's scoring stage for
    the same settings (``scoring_plan``)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    import plan_memory
    from iprox_lightning.analysis import ModelSizes, RunSettings, saved_activation_bytes
    from iprox_lightning.analysis import scoring_plan
    from iprox_lightning.scoring import InfluenceScoringModule

    cuda = args.device == "cuda"
    B, T = args.score_batch_size, args.score_max_length
    config = plan_memory.stage1_config(args.score_shape, args.score_layers or None)
    sizes = ModelSizes.from_config(config, name=args.score_shape)
    acts = saved_activation_bytes(config, seq_len=T, precision=args.precision)
    measure = ("torch.cuda.max_memory_allocated (max_memory_reserved beside it), reset before each run" if cuda
               else "peak RssAnon of the part's process over its value before the model was built (CPU)")
    rec.update(shape=args.score_shape, layers=config.num_hidden_layers, precision=args.precision, batch_size=B,
               max_length=T, measure=measure, runs={})
    sampler = None if cuda else plan_memory.PeakSampler(0.005)
    base = None if cuda else sampler.base
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    batch = plan_memory.random_sft_batch_maker(config.vocab_size, B, T)
    tasks = [f"task{k}" for k in range(args.score_tasks)]

    def examples(n: int, name: str, task_names) -> list[dict]:
        out = []
        for j in range(-(-n // B)):
            b = batch()
            b["id"] = [f"{name}{j * B + i}" for i in range(B)]
            b["task"] = [task_names[(j * B + i) % len(task_names)] for i in range(B)]
            out.append(b)
        return out

    pool = examples(max(args.score_pool, args.score_kfac_examples), "pool", ["pool"])
    val = examples(args.score_tasks * args.score_val_per_task, "val", tasks)

    class Data(L.LightningDataModule):  # the batches as they are (a list would be read as several loaders)
        def predict_dataloader(self):
            return DataLoader(pool[:-(-args.score_pool // B)], batch_size=None)

        def dataloader(self, split):  # the factor data: the pool's first batches
            return DataLoader(pool, batch_size=None)

        def validation_dataloader(self):
            return DataLoader(val, batch_size=None)

    runs: dict = {}
    for name, settings in score_runs(args).items():
        if time_left(args) < 10:
            runs[name] = {"status": "skipped", "reason": f"{time_left(args):.0f} s of the part's budget left"}
            rec.update(runs=runs)
            continue
        plan = scoring_plan(sizes, acts, RunSettings(**score_plan_settings(args, cuda, settings)), settings["method"])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            sampler = plan_memory.PeakSampler(0.005)
        t1 = time.perf_counter()
        module = InfluenceScoringModule(model, kfac_examples=args.score_kfac_examples, **settings)
        trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision=args.precision, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        out = trainer.predict(module, datamodule=Data())
        if cuda:
            torch.cuda.synchronize()
            measured, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        else:
            measured, reserved = sampler.stop() - base, None
        scores = [float(x) for o in out for x in o["score"]]
        runs[name] = {"status": "ok", "settings": settings, "measured_bytes": measured, "reserved_bytes": reserved,
                      "plan_bytes": plan.peak, "plan_over_measured": plan.peak / measured if measured else None,
                      "plan_parts": plan.parts, "seconds": time.perf_counter() - t1, "scored": len(scores),
                      "scores_finite": all(math.isfinite(v) for v in scores),
                      "scorer": {k: v for k, v in module.scorer.settings().items()
                                 if k.startswith(("kfac_", "ekfac_", "val_", "column"))}}
        rec.update(runs=runs)
        del module, trainer, out
    rec.update(runs=runs, seconds=time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------- pipeline part


def resolve_inputs(args, workdir: Path, rec: PartRecord) -> dict:
    """The target, pool and validation of the pipeline and fsdp parts (and what they are, recorded): ``--tiny``: the
    built-in ones; else the SmolLM2 GGUF or a random SmolLM2-135M-shape model, the prepared pool sample or a fresh
    one, the prepared validation file or the built-in data. What is made is made once, in the run's ``workdir``."""
    inputs = Path(args.inputs)
    if args.tiny:
        src = {"target": "builtin", "pool": "builtin", "validation": "builtin",
               "model_source": "builtin (the demo's tiny Llama)", "pool_source": f"builtin, {args.pool_size} examples",
               "data_args": {"builtin_size": args.pool_size}}
        rec.update(inputs=src)
        return src
    src: dict = {"data_args": {}}
    if args.smollm2 == "random":
        model = None
    elif args.smollm2:
        model = Path(args.smollm2)
    else:
        model = next((p for p in (inputs / GGUF_NAME, REPO / "shared" / "models" / GGUF_NAME,
                                  REPO.parent / "shared" / "models" / GGUF_NAME) if p.exists()), None)
    if model is not None:
        src.update(target=str(model), model_source=f"SmolLM2-135M-Instruct ({model})")
    else:
        src.update(target=str(random_smollm2(inputs / "smollm2", workdir / "smollm2_random", args.device)),
                   model_source="random SmolLM2-135M-shape model (" + ("--smollm2 random" if args.smollm2 else
                                                                       "the GGUF is absent") + ": "
                                + ("SmolLM2's tokenizer and config from --inputs" if (inputs / "smollm2").is_dir()
                                   else "the built-in character tokenizer") + ")")
    shared_pool = REPO.parent / "shared" / "data" / "pool" / "instructions.jsonl"
    if args.pool:
        src.update(pool=args.pool, pool_source=f"--pool {args.pool}")
    elif (inputs / "pool.jsonl").exists():
        src.update(pool=str(inputs / "pool.jsonl"), pool_source=f"{inputs / 'pool.jsonl'} (--prepare's sample)")
    elif shared_pool.exists():
        sample = workdir / "pool_sample.jsonl"
        from iprox_lightning.cli import main as cli

        cli(["sample_pool", "--pool", str(shared_pool), "--n", str(args.pool_size), "--output", str(sample),
             "--by", "source", "--seed", "0", "--overwrite", "true"])
        src.update(pool=str(sample), pool_source=f"a {args.pool_size}-example sample of {shared_pool}")
    else:
        src.update(pool="builtin", pool_source=f"builtin, {args.pool_size} examples (no pool file found)")
        src["data_args"]["builtin_size"] = args.pool_size
    if (inputs / "validation.jsonl").exists() and src["pool"] != "builtin":
        src.update(validation=str(inputs / "validation.jsonl"))
    elif src["pool"] != "builtin" and shared_pool.exists():
        src.update(validation=str(write_validation(shared_pool, Path(src["pool"]), workdir / "validation.jsonl")))
    else:
        src.update(validation="builtin")
    rec.update(inputs=src)
    return src


def random_smollm2(tokenizer_dir: Path, out: Path, device: str) -> Path:
    """A random-init SmolLM2-135M-shape Llama saved (float32) with a tokenizer in ``out`` (kept: a later part reuses
    it): SmolLM2's config and tokenizer where ``tokenizer_dir`` holds them (--prepare), else
    ``speed.SHAPES['smollm-135m']`` and the built-in character tokenizer. Initialised on ``device``."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    import speed

    if (tokenizer_dir / "config.json").exists():
        config = AutoConfig.from_pretrained(tokenizer_dir)
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        from iprox_lightning.models import load_tokenizer

        tok = load_tokenizer("builtin")
        config = LlamaConfig(**speed.SHAPES["smollm-135m"], max_position_embeddings=2048,
                             pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # initialising on the CPU is the slow part
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def write_validation(pool_file: Path, exclude_from: Path, out: Path, per_task: int = 8) -> Path:
    """Validation records for :data:`VALIDATION_TASKS`: ``per_task`` rows of each task's pool category that are not
    in ``exclude_from`` (the scored pool), in file order, with ``category`` set to the task."""
    taken = {json.loads(line)["id"] for line in exclude_from.open()} if exclude_from.exists() else set()
    by_category = {cat: task for task, cat in VALIDATION_TASKS.items()}
    rows: dict[str, list] = {task: [] for task in VALIDATION_TASKS}
    with pool_file.open() as f:
        for line in f:
            r = json.loads(line)
            task = by_category.get(r.get("category"))
            if task and r["id"] not in taken and len(rows[task]) < per_task:
                rows[task].append({**r, "category": task})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for task in rows for r in rows[task]))
    return out


def precision_options(args, workdir: Path) -> tuple[list[str], str]:
    """``pipeline``'s options for ``--precision`` (every stage's trainer precision)."""
    return ["--precision", args.precision], "pipeline --precision"


def data_args(args, src: dict) -> dict:
    return {"max_length": args.max_length, "batch_size": args.pipeline_batch_size, "val_per_task": args.val_per_task,
            "construction_fraction": args.construction_fraction, **src["data_args"]}


def pipeline_part(args, workdir: Path, rec: PartRecord) -> None:
    """``python train.py pipeline`` (no fine-tuning) at ``--precision`` on the device, then ``build_store``; in
    ``<workdir>/pipeline``."""
    from iprox_lightning.cli import main as cli

    src = resolve_inputs(args, workdir, rec)
    workdir = workdir / "pipeline"
    workdir.mkdir(parents=True, exist_ok=True)
    precision_args, via = precision_options(args, workdir)
    run = workdir / "run"
    argv = ["pipeline", "--workdir", str(run), "--target", src["target"], "--pool", src["pool"],
            "--validation", src["validation"], "--sparsity", f"{args.sparsity:g}", "--finetune", "false",
            "--accelerator", "gpu" if args.device == "cuda" else "cpu", "--devices", "1", "--align_epochs", "1",
            "--data_args", json.dumps(data_args(args, src)), *precision_args]
    rec.update(command="python train.py " + " ".join(argv), precision=args.precision, precision_via=via,
               peak_memory_note=peak_memory_note(args.device))
    try:
        cli(argv)
    finally:  # what ran is recorded also when a later stage fails; peak CUDA memory per stage: the pipeline's record
        peaks_path = run / "peak_device_memory_per_stage.json"
        peaks = json.loads(peaks_path.read_text()) if peaks_path.exists() else None
        rec.update(**pipeline_results(run, peaks if args.device == "cuda" else None))
    if time_left(args) < 30:
        rec.update(store_build={"status": "skipped", "reason": f"{time_left(args):.0f} s of the part's budget left"})
        return
    rec.update(store_build=store_build(args, src, run, workdir / "store"))


def pipeline_results(run: Path, peaks: dict | None) -> dict:
    """Seconds, scored tokens/s, peak memory per stage and the proxy's retention of a pipeline run directory."""
    out: dict = {"peak_memory_bytes": peaks}
    times_path = run / "seconds_per_stage.json"
    seconds = json.loads(times_path.read_text()) if times_path.exists() else {}
    out["seconds_per_stage"] = seconds
    tokens = {}
    for who in ("target", "proxy"):
        table = run / "scores" / who / "scores.parquet"
        if table.exists():
            import pyarrow.parquet as pq

            t = pq.read_table(table, columns=["n_tokens", "nonfinite"]).to_pydict()
            n_tok = sum(t["n_tokens"])
            tokens[who] = {"rows": len(t["n_tokens"]), "scored_tokens": n_tok, "nonfinite": sum(t["nonfinite"]),
                           "scored_tokens_per_s": n_tok / seconds[f"score:{who}"] if seconds.get(f"score:{who}")
                           else None}
    out["scoring"] = tokens
    summary_path = run / "summary.json"
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        out["summary"] = {k: s.get(k) for k in ("target_params", "proxy_params", "proxy_manifest",
                                                "retention_proxy_vs_target", "retention_proxy_vs_target_worst_task",
                                                "selection_rule")}
        out["selected_rows"] = {p.stem: sum(1 for _ in p.open()) for p in sorted((run / "selected").glob("*.jsonl"))}
    return out


def store_build(args, src: dict, run: Path, out: Path) -> dict:
    """``python train.py build_store`` of the warmed target over the pool (``--dtype`` weights on the device)."""
    import torch

    import speed
    from iprox_lightning.cli import main as cli

    warm = run / "warmup" / "model"
    if not (warm / "config.json").exists():
        return {"status": "skipped", "reason": "no warmed target (the pipeline's warm-up did not finish)"}
    argv = ["build_store", "--model", str(warm), "--pool", src["pool"], "--tokenizer", str(warm),
            "--output_dir", str(out), "--k", str(args.store_k), "--max_length", str(args.max_length),
            "--batch_size", str(args.pipeline_batch_size), "--dtype", args.dtype, "--overwrite", "true",
            "--accelerator", "gpu" if args.device == "cuda" else "cpu", "--progress", "false"]
    if src["data_args"].get("builtin_size"):
        argv += ["--builtin_size", str(src["data_args"]["builtin_size"])]
    peaks: dict[str, int] = {}
    result = {"command": "python train.py " + " ".join(argv)}
    try:
        t0 = time.perf_counter()
        with speed.peak_memory(torch.device(args.device), peaks, "build_store"):
            cli(argv)
        seconds = time.perf_counter() - t0
        meta = json.loads((out / "store.json").read_text())  # rows, build_seconds: the build without loading
        result.update(status="ok", seconds=seconds, examples=meta["rows"], build_seconds=meta["build_seconds"],
                      examples_per_s=meta["rows"] / meta["build_seconds"], store_bytes=meta["bytes"],
                      peak_memory_bytes=peaks.get("build_store"))
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- recorded; the part's other results stand
        result.update(status="failed", error=error_record(e))
    return result


# ----------------------------------------------------------------------------------------------- fsdp part

def fsdp_part(args, workdir: Path, rec: PartRecord) -> None:
    """A warm-up and a scoring run through the stage commands with ``strategy: fsdp`` on one device (the default
    strategy on a CPU, where FSDPStrategy cannot run: recorded); in ``<workdir>/fsdp``."""
    import torch

    import speed
    from iprox_lightning.cli import main as cli

    strategy = "fsdp" if args.device == "cuda" else "auto"
    src = resolve_inputs(args, workdir, rec)
    workdir = workdir / "fsdp"
    workdir.mkdir(parents=True, exist_ok=True)
    pool = src["pool"]
    dargs = data_args(args, src)
    if pool == "builtin":
        dargs["builtin_size"] = min(args.fsdp_pool, dargs.get("builtin_size", args.fsdp_pool))
    else:  # the first --fsdp-pool examples: a warm-up on 5% of them, a scoring of all
        pool = str(workdir / "pool.jsonl")
        with open(src["pool"]) as f:
            Path(pool).write_text("".join(line for _, line in zip(range(args.fsdp_pool), f)))
    rec.update(strategy=strategy, precision=args.precision, peak_memory_note=peak_memory_note(args.device),
               **({} if strategy == "fsdp" else {"note": f"{FSDP_NEEDS_CUDA}: on {args.device} the part's "
                                                         "commands run with the default strategy"}))
    trainer = {"accelerator": "gpu" if args.device == "cuda" else "cpu", "devices": 1, "strategy": strategy,
               "precision": args.precision, "default_root_dir": str(workdir / "lightning"), "logger": False,
               "enable_model_summary": False, "enable_progress_bar": False}
    configs = REPO / "configs"
    builtin = ["--config", str(configs / "builtin" / "warmup.yaml")] if pool == "builtin" else []
    warm = workdir / "warmup" / "model"
    data = {**dargs, "pool": pool, "validation": src["validation"]}
    overlay = write_overlay(workdir / "warmup.yaml", {
        "trainer": {**trainer, "log_every_n_steps": 1},
        "model": {"init_args": {"model": src["target"], "save_dir": str(warm)}},
        "data": {"init_args": {**data, "tokenizer": src["target"], "train_split": "warmup"}}})
    steps = {}
    peaks: dict[str, int] = {}
    with speed.peak_memory(torch.device(args.device), peaks, "warmup"):
        steps["warmup"] = timed_command(cli, ["fit", "--config", str(configs / "warmup.yaml"), *builtin,
                                              "--config", str(overlay)])
    rec.update(steps=steps, peak_memory_bytes=dict(peaks) if args.device == "cuda" else None)
    scores = workdir / "scores"
    builtin = ["--config", str(configs / "builtin" / "score.yaml")] if pool == "builtin" else []
    overlay = write_overlay(workdir / "score.yaml", {
        "trainer": {**trainer, "callbacks": [{"class_path": "iprox_lightning.scoring.InfluenceWriter",
                                              "init_args": {"output_dir": str(scores)}}]},
        "model": {"init_args": {"model": str(warm), "method": "tracin"}},
        "data": {"init_args": {**data, "tokenizer": str(warm)}}})
    with speed.peak_memory(torch.device(args.device), peaks, "score"):
        steps["score"] = timed_command(cli, ["predict", "--config", str(configs / "score.yaml"), *builtin,
                                             "--config", str(overlay)])
    import pyarrow.parquet as pq

    t = pq.read_table(scores / "scores.parquet", columns=["n_tokens", "nonfinite"]).to_pydict()
    steps["score"].update(rows=len(t["n_tokens"]), nonfinite=sum(t["nonfinite"]),
                          scored_tokens_per_s=sum(t["n_tokens"]) / steps["score"]["seconds"])
    rec.update(steps=steps, peak_memory_bytes=peaks if args.device == "cuda" else None)


def write_overlay(path: Path, content: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(content, sort_keys=False))
    return path


def timed_command(cli, argv: list[str]) -> dict:
    t0 = time.perf_counter()
    cli(argv)
    return {"command": "python train.py " + " ".join(argv), "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------- --prepare

def prepare(out: Path) -> dict:
    """Write the inputs that travel to the GPU machine into ``out`` (run where ``../shared`` and PyPI are): the pool
    sample, the validation file, SmolLM2's tokenizer and config, the wheels the GPU machine lacks, the commit."""
    from importlib.metadata import version

    from iprox_lightning.cli import main as cli

    shared = REPO.parent / "shared"
    out.mkdir(parents=True, exist_ok=True)
    pool = shared / "data" / "pool" / "instructions.jsonl"
    cli(["sample_pool", "--pool", str(pool), "--n", str(PREPARE_POOL_SIZE), "--output", str(out / "pool.jsonl"),
         "--by", "source", "--seed", "0", "--overwrite", "true"])
    write_validation(pool, out / "pool.jsonl", out / "validation.jsonl")
    from iprox_lightning.models import load_tokenizer
    from transformers import AutoConfig

    gguf = shared / "models" / GGUF_NAME
    tok = load_tokenizer(str(gguf))
    tok.save_pretrained(out / "smollm2")
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.save_pretrained(out / "smollm2")
    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "py", "-d", str(wheels), *pins], check=True)
    commit = commit_info()
    (out / "commit.txt").write_text(f"{commit['commit']}\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    info = {"inputs": str(out), "bytes": size, "wheels": pins, "commit": commit["commit"]}
    print(json.dumps(info, indent=1))
    return info



if __name__ == "__main__":
    main()
