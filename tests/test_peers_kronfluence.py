"""Cross-check against kronfluence 1.0.1's own code (issue 56): on a tiny float64 Llama, kronfluence's pairwise scores
equal this library's inner products ``⟨g(z), H⁻¹ g(q)⟩`` (``normalize=False``, one validation task per query) at
matched settings — the settings ``docs/GUIDE.md`` ("To match kronfluence / bergson / LESS") names:
``loss_reduction="sum"``, ``damping=0.1`` relative (kronfluence's heuristic damping, ``damping_factor=None``),
``damping_target="product"`` for K-FAC, ``fisher="sampled"`` (the Task below draws its labels with this library's
``sample_targets`` and the same per-batch seeds, so both fit on the same labels) or ``"empirical"``
(``use_empirical_fisher=True``).

kronfluence's metadata requires torchvision, which it never imports; pip then replaces a CPU-only torch 2.13 with
torch 2.14 + CUDA, or (pinned) installs a torchvision that cannot import next to it and breaks transformers. So it is
installed without its dependencies: ``pip install --no-deps kronfluence==1.0.1 einconv==0.1.0`` (einops and
opt-einsum come with the ``test`` extra; ``.ci/run`` does both)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

kronfluence = pytest.importorskip(
    "kronfluence", reason="kronfluence is not installed: pip install --no-deps kronfluence==1.0.1 einconv==0.1.0 "
    "(einops, opt-einsum: the test extra)")
from kronfluence.analyzer import Analyzer, prepare_model  # noqa: E402
from kronfluence.arguments import FactorArguments, ScoreArguments  # noqa: E402
from kronfluence.task import Task  # noqa: E402

from iprox_lightning.engine.batch import sample_targets, shifted_token_mask  # noqa: E402
from iprox_lightning.engine.target_layers import find_target_linears  # noqa: E402
from iprox_lightning.models.tiny import tiny_causal_lm  # noqa: E402
from iprox_lightning.scoring import influence_scores  # noqa: E402
from iprox_lightning.scoring.metrics import FISHER_SEED  # noqa: E402

from test_scoring_influence import TINY, batches, collate, make_examples  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TRAIN = make_examples(8, seed=21)
QUERY = make_examples(4, seed=22, tasks=[f"q{i}" for i in range(4)])  # one task per query: per-query scores
FACTOR = make_examples(12, seed=23)
BS = 4
F64 = torch.float64
# both sides in float64; measured largest difference / largest |score|: 1e-16..9e-16 with this machine's and ATen's
# generic kernels, up to 3.2e-8 under ATEN_CPU_CAPABILITY=avx2 (its float64 eigh and matmuls); 1e-6 holds on any x86
RTOL = 1e-6


class LMTask(Task):
    """kronfluence's task for this library's SFT loss: the ``reduction`` of each example's response-token
    cross-entropies summed over the batch; sampled labels drawn as :func:`sample_targets` with the batch's seed."""

    def __init__(self, modules, reduction):
        super().__init__()
        self.modules, self.reduction = modules, reduction

    def _loss(self, batch, model, sample):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        mask = shifted_token_mask(batch["labels"])
        logits = logits[mask]
        if sample:
            targets = sample_targets(logits.detach(), FISHER_SEED + int(batch["batch"][0]))
        else:
            targets = batch["labels"][:, 1:][mask[:, :-1]]
        ce = F.cross_entropy(logits, targets, reduction="none")
        if self.reduction == "sum":
            return ce.sum()
        rows = torch.arange(mask.shape[0]).unsqueeze(1).expand_as(mask)[mask]
        n = torch.bincount(rows, minlength=mask.shape[0]).clamp(min=1)
        return (ce.new_zeros(mask.shape[0]).index_add(0, rows, ce) / n).sum()

    def compute_train_loss(self, batch, model, sample=False):
        return self._loss(batch, model, sample)

    def compute_measurement(self, batch, model):
        return self._loss(batch, model, False)

    def get_influence_tracked_modules(self):
        return self.modules

    def get_attention_mask(self, batch):
        return batch["attention_mask"]


class Rows(torch.utils.data.Dataset):
    """The examples padded to one length, each with its batch index (kronfluence batches them in order)."""

    def __init__(self, examples):
        self.b = collate(examples, 1)
        self.n = len(examples)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": self.b["input_ids"][i], "attention_mask": self.b["attention_mask"][i],
                "labels": self.b["labels"][i], "batch": torch.tensor(i // BS)}


def kronfluence_scores(model, strategy, reduction, fisher, tmp_path):
    net = copy.deepcopy(model)
    task = LMTask(list(find_target_linears(net)), reduction)
    net = prepare_model(net, task)
    an = Analyzer("peers", net, task, cpu=True, disable_tqdm=True, output_dir=str(tmp_path))
    fa = FactorArguments(strategy=strategy, use_empirical_fisher=fisher == "empirical",
                         activation_covariance_dtype=F64, gradient_covariance_dtype=F64, eigendecomposition_dtype=F64,
                         per_sample_gradient_dtype=F64, lambda_dtype=F64)
    an.fit_all_factors("f", Rows(FACTOR), per_device_batch_size=BS, factor_args=fa, overwrite_output_dir=True)
    sa = ScoreArguments(damping_factor=None, per_sample_gradient_dtype=F64, precondition_dtype=F64, score_dtype=F64)
    an.compute_pairwise_scores("s", "f", Rows(QUERY), Rows(TRAIN), per_device_query_batch_size=BS,
                               per_device_train_batch_size=BS, score_args=sa, overwrite_output_dir=True)
    return an.load_pairwise_scores("s")["all_modules"].double().numpy()  # [query, train]


@pytest.mark.parametrize("method,strategy,reduction,fisher,target", [
    ("tracin", "identity", "sum", "empirical", "factors"),
    ("kfac", "kfac", "sum", "sampled", "product"),
    ("ekfac", "ekfac", "sum", "sampled", "factors"),
    ("ekfac", "ekfac", "mean", "empirical", "factors"),
])
def test_scores_equal_kronfluence_at_matched_settings(tmp_path, method, strategy, reduction, fisher, target):
    model = tiny_causal_lm("llama", seed=0, dtype=F64, **TINY)
    want = kronfluence_scores(model, strategy, reduction, fisher, tmp_path).T  # [train, query]
    ours = influence_scores(model, batches(TRAIN, BS), batches(QUERY, BS), metric=method, damping=0.1,
                            kfac_examples=len(FACTOR), factor_dataloader=batches(FACTOR, BS), normalize=False,
                            progress=False, loss_reduction=reduction, fisher=fisher, damping_target=target)
    assert ours.task_names == [f"q{i}" for i in range(len(QUERY))]
    scale = np.abs(want).max()
    diff = np.abs(ours.task_scores - want).max() / scale
    print(f"{method} ({reduction}, {fisher}, {target}): largest difference / largest score {diff:.1e}")
    assert diff <= RTOL
