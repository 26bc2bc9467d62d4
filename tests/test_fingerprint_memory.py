"""A model's weight hash (``io/fingerprint.module_identity``, what a score directory's / a store's provenance records for
a model given as a module) reads each tensor's bytes in place. Before, ``.numpy().tobytes()`` copied each one: the
copy of the largest weight (the embedding, 1.96 GiB at the 8B width) was the store build's peak at the wide shape
(``bench/plan_scoring.py store --shape wide``: measured 7.50 GiB against the plan's 5.75, ratio 0.77; after, see
``bench/results/plan/store_wide-2l.json``)."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from iprox_lightning.io.fingerprint import module_identity, tensors_digest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from plan_memory import PeakSampler  # noqa: E402  (bench/: the RssAnon sampler the plan benches use)


def _reference(module) -> str:
    """The recorded definition: name, shape, dtype and a copy of the bytes of each tensor, in state-dict order."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def test_module_identity_hashes_the_same_bytes_as_before():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    assert module_identity(net) == _reference(net)
    t = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(4, dtype=torch.bfloat16)}
    h = hashlib.sha256()
    for k in ("a", "b"):
        h.update(f"{k}|{t[k].dtype}|{tuple(t[k].shape)}|".encode() + t[k].reshape(-1).view(torch.uint8).numpy().tobytes())
    assert tensors_digest(t) == h.hexdigest()


def test_module_identity_does_not_copy_the_weights():
    big = torch.nn.Linear(8192, 8192, bias=False)  # 256 MiB
    torch.nn.init.normal_(big.weight)
    sampler = PeakSampler(0.0005)
    module_identity(big)
    grown = sampler.stop() - sampler.base
    # a copy would add 256 MiB for the ~0.3 s the hash takes; the interpreter's own growth is a few MiB
    assert grown < 64 * 2**20, grown / 2**20
