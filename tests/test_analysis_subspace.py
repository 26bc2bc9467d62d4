"""SA / 1-NND vs brute-force numpy; per-example gradients vs autograd `.grad`; the Kronecker projection."""
import math

import numpy as np
import pytest
import scipy.linalg
import torch

from iprox_lightning.analysis.subspace import (
    KroneckerProjector,
    gradient_parameters,
    mean_nn_distance,
    nearest_neighbor_distances,
    per_example_gradients,
    subspace_affinity,
    subspace_basis,
)
from iprox_lightning.engine.batch import per_example_loss
from iprox_lightning.engine.lowrank import LowRankLinear
from iprox_lightning.models.tiny import tiny_causal_lm


def _span(basis_cols, n, rng):
    """n random vectors spanning exactly the columns of basis_cols [d, k]."""
    return torch.tensor((basis_cols @ rng.normal(size=(basis_cols.shape[1], n))).T)


def test_sa_identical_orthogonal_and_angle():
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.normal(size=(20, 6)))
    A = _span(Q[:, :3], 10, rng)
    B = _span(Q[:, :3], 7, rng)  # same 3-d subspace, other vectors
    C = _span(Q[:, 3:6], 9, rng)  # orthogonal subspace
    assert subspace_affinity(A, B, energy=1.0) == pytest.approx(1.0, abs=1e-9)
    assert subspace_affinity(A, C, energy=1.0) == pytest.approx(0.0, abs=1e-9)
    # a subspace containing the other: affinity 1 (normalised by the smaller dimension)
    D = _span(Q[:, :5], 12, rng)
    assert subspace_affinity(A, D, energy=1.0) == pytest.approx(1.0, abs=1e-9)
    # two lines at angle theta: cos(theta)
    theta = 0.3
    u = Q[:, 0]
    v = math.cos(theta) * Q[:, 0] + math.sin(theta) * Q[:, 1]
    assert subspace_affinity(torch.tensor(u[None] * 2.0), torch.tensor(v[None] * -5.0)) == pytest.approx(math.cos(theta))


def test_sa_vs_principal_angles():
    rng = np.random.default_rng(1)
    G1 = torch.tensor(rng.normal(size=(6, 15)))
    G2 = torch.tensor(rng.normal(size=(4, 15)))
    angles = scipy.linalg.subspace_angles(G1.numpy().T, G2.numpy().T)
    ref = math.sqrt(np.mean(np.cos(angles) ** 2))
    assert subspace_affinity(G1, G2, energy=1.0) == pytest.approx(ref, abs=1e-10)
    # with a fixed rank: top right-singular vectors by numpy
    U1 = np.linalg.svd(G1.numpy())[2][:2].T
    U2 = np.linalg.svd(G2.numpy())[2][:3].T
    ref2 = np.linalg.norm(U1.T @ U2) / math.sqrt(2)
    assert subspace_basis(G1, rank=2).shape == (15, 2)
    got = float(np.linalg.norm(subspace_basis(G1, rank=2).numpy().T @ subspace_basis(G2, rank=3).numpy()) / math.sqrt(2))
    assert got == pytest.approx(ref2, abs=1e-10)


def test_energy_rank_selection():
    # singular values 4, 2, 1 -> energies 16/21, 20/21, 1
    V, _ = np.linalg.qr(np.random.default_rng(2).normal(size=(8, 3)))
    G = torch.tensor(np.diag([4.0, 2.0, 1.0]) @ V.T)
    assert subspace_basis(G, energy=0.7).shape[1] == 1
    assert subspace_basis(G, energy=0.9).shape[1] == 2
    assert subspace_basis(G, energy=0.99).shape[1] == 3
    assert subspace_basis(G, rank=10).shape[1] == 3  # capped by the numerical rank
    with pytest.raises(ValueError, match="all zeros"):
        subspace_basis(torch.zeros(3, 4))


def test_one_nnd_hand_case_and_brute_force():
    pts = torch.tensor([[0.0], [1.0], [3.0], [7.0]])
    assert nearest_neighbor_distances(pts).tolist() == [1.0, 1.0, 2.0, 4.0]
    assert mean_nn_distance(pts) == pytest.approx(2.0)
    rng = np.random.default_rng(3)
    X = rng.normal(size=(37, 6))
    X[5] = X[9]  # a duplicate: distance 0 for both
    ref = np.mean([min(np.linalg.norm(X[i] - X[j]) for j in range(len(X)) if j != i) for i in range(len(X))])
    assert mean_nn_distance(torch.tensor(X), chunk_size=8) == pytest.approx(ref, rel=1e-12)
    Xn = X / np.linalg.norm(X, axis=1, keepdims=True)
    refn = np.mean([min(np.linalg.norm(Xn[i] - Xn[j]) for j in range(len(X)) if j != i) for i in range(len(X))])
    assert mean_nn_distance(torch.tensor(X), normalize=True) == pytest.approx(refn, rel=1e-12)
    with pytest.raises(ValueError):
        mean_nn_distance(torch.zeros(1, 3))


def test_kronecker_projection_is_explicit_kron_and_unbiased():
    proj = KroneckerProjector({"w": (6, 5)}, dim=3, seed=7)
    P, Q = proj.factors["w"]
    G = torch.randn(6, 5, dtype=torch.float64)
    explicit = torch.kron(P, Q) @ G.reshape(-1)  # row-major vec(P G Q^T) = (P ⊗ Q) vec(G)
    torch.testing.assert_close(proj.project("w", G), explicit)
    assert proj.out_dim("w", (6, 5)) == 9
    # same seed -> same factors; identity side when dim >= size
    torch.testing.assert_close(KroneckerProjector({"w": (6, 5)}, 3, 7).factors["w"][0], P)
    big = KroneckerProjector({"w": (6, 5)}, dim=8, seed=0)
    torch.testing.assert_close(big.project("w", G), G.reshape(-1))
    # E <proj g1, proj g2> = <g1, g2>: average over many seeds
    G2 = G + 0.5 * torch.randn(6, 5, dtype=torch.float64)
    est = np.mean([float(KroneckerProjector({"w": (6, 5)}, 3, s).project("w", G) @
                         KroneckerProjector({"w": (6, 5)}, 3, s).project("w", G2)) for s in range(1500)])
    assert est == pytest.approx(float((G * G2).sum()), rel=0.1)


def _batch(n=3, T=10, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    labels = ids.clone()
    labels[:, :4] = -100  # prompt
    labels[mask == 0] = -100
    labels[2, :] = -100  # no response token -> zero gradient row
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "id": [f"e{i}" for i in range(n)]}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_per_example_gradients_vs_grad_accumulation(arch):
    model = tiny_causal_lm(arch)
    if arch == "llama":  # one factorised layer: gradients w.r.t. A and B
        lin = model.model.layers[0].mlp.up_proj
        model.model.layers[0].mlp.up_proj = LowRankLinear(lin.in_features, lin.out_features, 4)
    batch = _batch()
    ids, G = per_example_gradients(model, [batch], progress=False)
    assert ids == ["e0", "e1", "e2"]
    params = gradient_parameters(model)
    assert G.shape == (3, sum(p.numel() for p in params.values()))
    assert torch.count_nonzero(G[2]) == 0
    for i in range(2):  # brute force: the padded row alone, loss.backward(), read .grad
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["input_ids"][i : i + 1], attention_mask=batch["attention_mask"][i : i + 1]).logits
        per_example_loss(logits, batch["labels"][i : i + 1])[0][0].backward()
        ref = []
        for name, p in params.items():
            g = p.grad
            if arch == "gpt2":
                g = g.T  # Conv1D stores [in, out]
            ref.append(g.reshape(-1))
        torch.testing.assert_close(G[i], torch.cat(ref), rtol=1e-4, atol=1e-6)


def test_per_example_gradients_projection_consistent():
    model = tiny_causal_lm("qwen2")
    batch = _batch(seed=1)
    _, G = per_example_gradients(model, [batch], progress=False)
    _, Gp = per_example_gradients(model, [batch], projection_dim=4, seed=3, progress=False)
    params = gradient_parameters(model)
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    proj = KroneckerProjector(shapes, 4, seed=3)
    assert Gp.shape == (3, sum(proj.out_dim(n, s) for n, s in shapes.items()))
    off, parts = 0, []
    for n, s in shapes.items():
        numel = s[0] * s[1]
        parts.append(proj.project(n, G[0, off : off + numel].double().reshape(s)))
        off += numel
    torch.testing.assert_close(Gp[0], torch.cat(parts).float(), rtol=1e-4, atol=1e-6)
