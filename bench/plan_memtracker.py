"""Cross-check ``train.py plan``'s warm-up state (weights, gradients, AdamW) with PyTorch's ``MemTracker`` on fake tensors.

``torch.distributed._tools.mem_tracker.MemTracker`` under ``FakeTensorMode`` (nothing allocated) tracks one training
step of a named shape. What it cannot run, and so what this check leaves out (the numbers are the stage's state only):

* the project's stage code: ``batch.scored_logits`` selects the scored tokens with a boolean mask (``aten.nonzero``,
  a data-dependent shape that ``FakeTensorMode`` refuses: ``DynamicOutputShapeException``), so the step here is the
  Hugging Face loss over every token;
* frozen parameters: ``MemTracker`` registers a gradient hook on every parameter and refuses one without
  ``requires_grad``; the embeddings and LM head are made trainable for it (their gradients, reported as
  ``frozen_grads``, are MemTracker's extra) and left out of the optimizer, as the warm-up does;
* activations: on CPU fake tensors it attributes none (``ACT`` and ``TEMP`` stay 0), so the plan's activations are
  checked by the tests against a real run's saved tensors instead (``tests/test_plan_memory.py``);
* a second iteration: it refuses a module called again (``NotImplementedError``), so one step is tracked.

  python bench/plan_memtracker.py --shapes smollm2-135m llama-3.2-1b llama-3.2-3b llama-3.1-8b \
      --out bench/results/plan/memtracker.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def track(name: str, seq_len: int, batch_size: int) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    from iprox_lightning.analysis import Activations, ModelSizes, RunSettings, load_config, training_plan
    from iprox_lightning.training import decay_param_groups, freeze_embeddings_and_head

    cfg = load_config(name)
    t0 = time.time()
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        freeze_embeddings_and_head(model)
        model.train()
        groups = decay_param_groups(model, 0.01)
        model.requires_grad_(True)  # MemTracker hooks every parameter's gradient (see the module docstring)
        opt = torch.optim.AdamW(groups, lr=1e-5, foreach=False)
        mt = MemTracker()
        mt.track_external(model, opt)
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        with mt:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
        peak = {str(k).split(".")[-1]: v for d, m in mt.get_tracker_snapshot("peak").items() for k, v in m.items()}
    sizes = ModelSizes.from_config(cfg)
    acts = Activations(outside=0, per_layer=0, layer_input=0)
    plan = training_plan(sizes, acts, RunSettings(max_length=seq_len, batch_size=batch_size, device_kind="cpu"),
                           stage="warm-up", n_examples=1).parts
    return {"shape": name, "seconds": time.time() - t0, "memtracker_peak": peak,
            "frozen_grads": sizes.frozen * 4, "plan": {"weights": plan["weights"], "gradients": sizes.trainable * 4,
                                                       "adamw": plan["adamw"]},
            "ratios": {"weights": peak["PARAM"] / plan["weights"],
                       "gradients": (peak["GRAD"] - sizes.frozen * 4) / (sizes.trainable * 4),
                       "adamw": peak["OPT"] / plan["adamw"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-3.2-1b"])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for name in a.shapes:
        rows.append(track(name, a.seq_len, a.batch_size))
        print(name, {k: round(v, 4) for k, v in rows[-1]["ratios"].items()}, flush=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
