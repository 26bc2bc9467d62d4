"""Our gradient store against bergson's index on the same projection (issue 56): bergson's per-module projections
are deterministic (``create_module_projection_matrix(name, role, m, n, …, seed)``), so a ``GradientProjector`` given
them (``projections=``, as a store reloads its own) must write the rows bergson's ``collect_gradients`` writes, and
the store's query (``query_table``: cosine of every row with each query example's gradient) must give the scores of
bergson's ``Attributor(unit_norm=True).trace``. A peft model's rows (issue 66) likewise: bergson's PEFT gradient
collection over the adapters, our store over the adapters it tracks by default.

bergson is not a test dependency: its metadata pins a CUDA torch that would replace this project's CPU torch, so it
installs only with ``--no-deps`` plus its pure-Python requirements, which CI does (``.ci/run``, pinned). Without it this
module is skipped; with it (``pip install --no-deps bergson`` and ``jaxtyping wadler-lindig petname simple-parsing natsort
ml-dtypes peft docstring-parser``) it runs in seconds."""
from __future__ import annotations

import logging

import pytest
import torch


def _root_logging() -> tuple[list, int]:
    return list(logging.root.handlers), logging.root.level


def _restore_root_logging(state: tuple[list, int]) -> None:
    logging.root.handlers[:] = state[0]
    logging.root.setLevel(state[1])


# importing bergson adds a stdout handler to the root logger and sets it to INFO (bergson 2.5.1): undone at once, so the
# other tests of the session (collected after this import) keep their quiet output
_LOGGING = _root_logging()
bergson = pytest.importorskip(
    "bergson", reason="bergson is not installed (it needs pip install --no-deps next to a CPU torch: .ci/run's line)")
_restore_root_logging(_LOGGING)


@pytest.fixture(autouse=True)
def _keep_root_logging():
    """bergson's submodules imported inside a test may configure the root logger again: restored after each test."""
    state = _root_logging()
    yield
    _restore_root_logging(state)

from iprox_lightning.models.tiny import tiny_causal_lm  # noqa: E402
from iprox_lightning.scoring.features import tracked_modules, virtual_linears  # noqa: E402
from iprox_lightning.scoring.projection import GradientProjector, LayerProjection  # noqa: E402
from iprox_lightning.scoring.query import query_table  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
P = 4  # bergson's projection_dim: rows per side of every tracked weight (our k)


def _examples(n, seed, length=12, prompt=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY["vocab_size"], (n, length), generator=g)
    labels = ids.clone()
    labels[:, :prompt] = -100
    return ids, labels


def _batch(ids, labels, names):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels, "id": list(names),
            "task": list(names)}


def test_store_rows_and_query_scores_equal_bergsons_index_on_its_projection(tmp_path):
    from datasets import Dataset

    from bergson import Attributor, IndexConfig, collect_gradients
    from bergson.collector.collector import create_module_projection_matrix
    from bergson.data import load_gradients
    from bergson.utils.worker_utils import processor_for

    torch.manual_seed(0)
    model = tiny_causal_lm("llama", seed=0, dtype=torch.float32, **TINY).eval()
    modules = tracked_modules(model)
    prefix = model.base_model_prefix + "."
    names = {n.removeprefix(prefix) for n in modules}  # bergson hooks the base model: names relative to it
    ids, labels = _examples(10, seed=1)
    q_ids, q_labels = _examples(3, seed=2)

    # bergson's index: per-module double-sided projection, per-example mean token loss (ours), float32
    cfg = IndexConfig(run_path=str(tmp_path / "index"), projection_dim=P, loss_reduction="mean", precision="fp32")
    cfg.partial_run_path.mkdir(parents=True)
    processor = processor_for(cfg)
    processor.save(cfg.partial_run_path)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist(), "length": [ids.shape[1]] * len(ids)})
    collect_gradients(model, ds, processor, cfg, batches=[list(range(0, 5)), list(range(5, 10))], target_modules=names)
    cfg.partial_run_path.rename(cfg.run_path)
    index = torch.from_numpy(load_gradients(cfg.run_path).copy()).reshape(len(ids), -1)

    # our projector on bergson's matrices (left: [p, out], right: [p, in] — our P_out, P_in)
    proj = {}
    for v in virtual_linears(modules):
        name = v.key.removeprefix(prefix).removesuffix(".weight")  # bergson's module name
        mat = lambda role, m: create_module_projection_matrix(  # noqa: E731
            name, role, P, m, torch.float32, torch.device("cpu"), processor.projection_type,
            processor.projection_scale, processor.projection_seed)
        proj[v.key] = LayerProjection(v.key, v.out_features, v.in_features, mat("left", v.out_features),
                                      mat("right", v.in_features))
    projector = GradientProjector(model, projections=proj)
    rows = [projector.project_batch(_batch(ids[j:j + 5], labels[j:j + 5], [f"p{i}" for i in range(j, j + 5)]))
            for j in (0, 5)]
    ours = torch.cat([r["vectors"] for r in rows])
    assert ours.shape == index.shape
    # same modules in the same order (bergson's grad_sizes follow the model's module order, as our layout)
    torch.testing.assert_close(ours, index, rtol=1e-4, atol=1e-5 * float(index.abs().max()))

    # the store's query: cosine of every stored row with each query example's projected gradient
    q = projector.project_batch(_batch(q_ids, q_labels, [f"q{i}" for i in range(3)]))["vectors"]
    shards = [{"ids": r["id"], "tasks": r["task"], "vectors": r["vectors"], "n_tokens": torch.as_tensor(r["n_tokens"]),
               "zero_grad": torch.as_tensor(r["zero_grad"]), "nonfinite": torch.as_tensor(r["nonfinite"])}
              for r in rows]
    table = query_table(shards, [f"q{i}" for i in range(3)], q / q.norm(dim=1, keepdim=True))
    attr = Attributor(cfg.run_path, device="cpu", unit_norm=True)
    with attr.trace(model.base_model, None, modules=names) as res:
        out = model(input_ids=q_ids).logits.float()
        ce = torch.nn.functional.cross_entropy(out[:, :-1].transpose(1, 2), q_labels[:, 1:], reduction="none",
                                               ignore_index=-100)
        (ce.sum(1) / (q_labels[:, 1:] != -100).sum(1)).sum().backward()
    model.zero_grad(set_to_none=True)
    # trace returns each query's top-k (k None: every row), best first: back to index order, [rows, queries]
    theirs = torch.zeros_like(res.scores).scatter_(1, res.indices, res.scores).T
    order = sorted(range(len(ids)), key=lambda j: f"p{j}")  # the table's rows are sorted by id
    torch.testing.assert_close(torch.as_tensor(table.task_scores, dtype=torch.float32), theirs[order],
                               rtol=1e-4, atol=1e-5)


def test_store_rows_equal_bergsons_peft_gradient_collection_on_its_projection(tmp_path):
    """A peft model (LoRA adapters on q, v, down): bergson collects the adapters' gradients (the modules its
    ``setup_model_and_peft`` names, ``extract_peft_target_modules``); our store, given its projections, writes the
    same rows over the same modules, tracked without patterns (a peft model's default: its adapters)."""
    from datasets import Dataset

    from bergson import IndexConfig, collect_gradients
    from bergson.collector.collector import create_module_projection_matrix
    from bergson.data import load_gradients
    from bergson.utils.worker_utils import extract_peft_target_modules, processor_for

    from iprox_lightning.models.lora import LoraSettings, add_adapters

    torch.manual_seed(0)
    model = add_adapters(tiny_causal_lm("llama", seed=0, dtype=torch.float32, **TINY),
                         LoraSettings(r=2, alpha=4, target_modules=("q_proj", "v_proj", "down_proj"))).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # peft starts lora_B at zero (every lora_A gradient zero): drawn at random
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    names = extract_peft_target_modules(model)  # relative to model.base_model, which bergson hooks
    modules = tracked_modules(model)
    assert {n.removeprefix("base_model.") for n in modules} == names and len(names) == 2 * 3 * TINY["num_layers"]
    ids, labels = _examples(8, seed=1)

    cfg = IndexConfig(run_path=str(tmp_path / "index"), projection_dim=P, loss_reduction="mean", precision="fp32")
    cfg.partial_run_path.mkdir(parents=True)
    processor = processor_for(cfg)
    processor.save(cfg.partial_run_path)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist(), "length": [ids.shape[1]] * len(ids)})
    collect_gradients(model, ds, processor, cfg, batches=[list(range(0, 4)), list(range(4, 8))], target_modules=names)
    cfg.partial_run_path.rename(cfg.run_path)
    index = torch.from_numpy(load_gradients(cfg.run_path).copy()).reshape(len(ids), -1)

    proj = {}
    for v in virtual_linears(modules):
        name = v.key.removeprefix("base_model.").removesuffix(".weight")  # bergson's module name
        mat = lambda role, m: create_module_projection_matrix(  # noqa: E731
            name, role, P, m, torch.float32, torch.device("cpu"), processor.projection_type,
            processor.projection_scale, processor.projection_seed)
        proj[v.key] = LayerProjection(v.key, v.out_features, v.in_features, mat("left", v.out_features),
                                      mat("right", v.in_features))
    projector = GradientProjector(model, projections=proj)
    ours = torch.cat([projector.project_batch(_batch(ids[j:j + 4], labels[j:j + 4], [f"p{i}" for i in range(j, j + 4)]))
                      ["vectors"] for j in (0, 4)])
    assert ours.shape == index.shape and float(index.abs().max()) > 0
    # float32 sums of the same terms in other orders (as the dense test)
    torch.testing.assert_close(ours, index, rtol=1e-4, atol=1e-5 * float(index.abs().max()))
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)  # the base stays frozen
