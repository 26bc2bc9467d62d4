"""The gradient store's math against brute force: the LoGra factored projection equals the projection of the
materialised per-example gradient; query scores equal TracIn cosines of brute-force projected gradients, and the
exact TracIn scores with identity projections; LESS max over subtasks; top-k nearest neighbours."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import tracin_scores
from iprox_lightning.scoring.projection import GradientProjector, gaussian_projection, make_projections
from iprox_lightning.scoring.query import nearest, query_table, task_sums

from test_scoring_influence import TINY, TRAIN, VAL, batches, make_proxy, ref_example, tracked_params  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")



# cosine scores (|value| <= 1) computed by two float64 routes through the model differ by up to 1.2e-9 under ATen's
# AVX2 kernels (1e-16 natively; cf. tests/data/isa_spread.json, self_consistency): 5e-7 holds on any x86 kernel set
KERNEL_ATOL = 5e-7

def _model():
    return tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)


def _shards(projector, examples, bs=4):
    out = []
    for b in batches(examples, bs):
        p = projector.project_batch(b)
        out.append({"ids": p["id"], "tasks": p["task"], "vectors": p["vectors"],
                    "n_tokens": torch.as_tensor(p["n_tokens"]), "zero_grad": torch.as_tensor(p["zero_grad"]),
                    "nonfinite": torch.as_tensor(p["nonfinite"])})
    return out


def _brute_vector(model, projections, ex):
    """Concatenated ``P_δ G P_hᵀ`` of the autograd per-example gradients ``G`` (batch size 1)."""
    layer_g, _ = ref_example(model, ex)
    parts = []
    for key, _, _ in tracked_params(model):
        p = projections[key]
        G = layer_g[key]
        G = G if p.P_out is None else p.P_out.double() @ G
        G = G if p.P_in is None else G @ p.P_in.double().t()
        parts.append(G.reshape(-1))
    return torch.cat(parts)


@pytest.mark.parametrize("proxy", [False, True])
def test_factored_projection_equals_projected_materialised_gradient(proxy):
    model = make_proxy() if proxy else _model()
    proj = GradientProjector(model, k=5, seed=3)
    assert any(p.P_in is not None and p.P_out is not None for p in proj.projections.values())
    got = torch.cat([s["vectors"] for s in _shards(proj, TRAIN)])  # padded batches of 4
    want = torch.stack([_brute_vector(model, proj.projections, e) for e in TRAIN])
    # float64 both ways; ATen's AVX2 kernels sum in another order: up to 7e-11 of the largest |value| (1e-15 natively)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9 * float(want.abs().max()))
    zero = torch.cat([torch.as_tensor(s["zero_grad"]) for s in _shards(proj, TRAIN)])
    assert zero.tolist() == [bool((w == 0).all()) for w in want] and zero.any()


def test_projections_are_seeded_and_identity_when_k_covers_the_dimension():
    a, b = gaussian_projection(4, 16, 7, "w", "in"), gaussian_projection(4, 16, 7, "w", "in")
    assert torch.equal(a, b) and not torch.equal(a, gaussian_projection(4, 16, 8, "w", "in"))
    assert not torch.equal(a, gaussian_projection(4, 16, 7, "w", "out"))
    assert gaussian_projection(16, 16, 7, "w", "in") is None
    assert abs(float(gaussian_projection(64, 4096, 0, "w", "in").pow(2).sum(0).mean()) - 1.0) < 0.05  # E‖Pv‖²=‖v‖²
    with pytest.raises(ValueError, match="projection size"):
        gaussian_projection(0, 16, 7, "w", "in")


def test_query_equals_brute_force_projected_tracin_and_exact_tracin_with_identity():
    model = _model()
    # projected: cosines of the brute-force projected gradients
    proj = GradientProjector(model, k=5, seed=1)
    names, S, counts = task_sums(proj.project_batch(b) for b in batches(VAL, 3))
    table = query_table(_shards(proj, TRAIN), names, S)
    vt = {e["id"]: _brute_vector(model, proj.projections, e) for e in VAL}
    tasks = sorted({e["task"] for e in VAL})
    assert names == tasks and counts.tolist() == [sum(e["task"] == t for e in VAL) for t in tasks]
    s = {t: sum(vt[e["id"]] for e in VAL if e["task"] == t) for t in tasks}
    sall = sum(s.values())
    cos = lambda a, b: 0.0 if a.norm() == 0 or b.norm() == 0 else float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    for e in TRAIN:
        x = _brute_vector(model, proj.projections, e)
        j = table.ids.index(e["id"])
        assert table.scores[j] == pytest.approx(cos(x, sall), rel=0, abs=KERNEL_ATOL)
        np.testing.assert_allclose(table.task_scores[j], [cos(x, s[t]) for t in tasks], rtol=0, atol=KERNEL_ATOL)
    # identity projections (k >= every dimension): the exact TracIn scores
    full = GradientProjector(model, k=10_000, seed=1)
    assert all(p.P_in is None and p.P_out is None for p in full.projections.values())
    names, S, _ = task_sums(full.project_batch(b) for b in batches(VAL, 3))
    got = query_table(_shards(full, TRAIN), names, S)
    exact = tracin_scores(model, batches(TRAIN, 4), batches(VAL, 3), progress=False)
    assert got.ids == exact.ids and got.task_names == exact.task_names
    np.testing.assert_allclose(got.scores, exact.scores, rtol=0, atol=KERNEL_ATOL)
    np.testing.assert_allclose(got.task_scores, exact.task_scores, rtol=0, atol=KERNEL_ATOL)
    np.testing.assert_allclose(got.score_max, exact.score_max, rtol=0, atol=KERNEL_ATOL)
    assert (got.zero_grad == exact.zero_grad).all() and got.zero_grad.any()


def test_less_max_over_subtasks_from_the_store():
    """Subtask columns ``suite.part``: ``select``'s rule max over a suite's parts is LESS's aggregate of the
    per-subtask cosines (each subtask costs one vector)."""
    from iprox_lightning.selection.rules import rule_order

    model = _model()
    proj = GradientProjector(model, k=6, seed=2)
    val = [{**e, "task": f"mmlu.{'ab'[j % 2]}" if j < 4 else "bbh.c"} for j, e in enumerate(VAL)]
    names, S, counts = task_sums(proj.project_batch(b) for b in batches(val, 4))
    assert names == ["bbh.c", "mmlu.a", "mmlu.b"] and S.shape == (3, proj.dim)
    table = query_table(_shards(proj, TRAIN), names, S)
    cols = {f"score/{t}": table.task_scores[:, k] for k, t in enumerate(names)}
    order, value = rule_order("max", table.ids, cols, "mmlu")
    np.testing.assert_array_equal(value, np.maximum(cols["score/mmlu.a"], cols["score/mmlu.b"]))
    want = sorted(range(len(table.ids)), key=lambda j: (-value[j], table.ids[j]))
    assert order.tolist() == want


def test_nearest_neighbours_equal_a_full_sort():
    model = _model()
    proj = GradientProjector(model, k=4, seed=0)
    shards = _shards(proj, TRAIN, bs=3)
    X = torch.cat([s["vectors"] for s in shards])
    ids = [i for s in shards for i in s["ids"]]
    ok = ~torch.cat([s["zero_grad"] for s in shards])
    Q = torch.cat([s["vectors"] for s in _shards(proj, VAL)])[:3]
    got_ids, got_sims = nearest(shards, Q, k=3)
    cos = torch.nn.functional.normalize(Q, dim=1) @ torch.nn.functional.normalize(X, dim=1).t()
    for q in range(len(Q)):
        ranked = sorted((j for j in range(len(ids)) if ok[j]), key=lambda j: (-float(cos[q, j]), j))[:3]
        assert got_ids[q] == [ids[j] for j in ranked]
        np.testing.assert_allclose(got_sims[q], [float(cos[q, j]) for j in ranked], rtol=1e-12)
    # an example is its own nearest neighbour
    self_ids, self_sims = nearest(shards, X[ok][:2], k=1)
    assert [r[0] for r in self_ids] == [i for i, o in zip(ids, ok) if o][:2]
    np.testing.assert_allclose(self_sims[:, 0], 1.0, rtol=1e-12)
    with pytest.raises(ValueError, match="k must be"):
        nearest(shards, Q, 0)


def test_projections_must_match_the_model():
    model = _model()
    other = make_projections(GradientProjector(make_proxy()).linears, 4, 0)
    with pytest.raises(ValueError, match="other layers"):
        GradientProjector(model, projections=other)


def test_pca_projections_are_the_leading_eigenvectors_of_the_second_moments():
    """``projection="pca"``: each side's rows are orthonormal eigenvectors of the layer's token second moment (brute
    force: numpy's eigh of ``Σ h hᵀ / n``) with its k largest eigenvalues, largest first — checked through
    ``P C Pᵀ = diag(top-k eigenvalues)``, which holds for any basis of a repeated eigenvalue; the store's vectors are
    then ``P_δ G P_hᵀ`` of the autograd gradients; k >= a dimension leaves that side whole."""
    from iprox_lightning.scoring.features import tracked_modules, virtual_linears
    from iprox_lightning.scoring.metrics import KFACFactors
    from iprox_lightning.scoring.projection import pca_projections
    from iprox_lightning.engine.tracking import backward_pairs

    model = _model()
    modules = tracked_modules(model)
    linears = virtual_linears(modules)
    fac = KFACFactors(modules)
    for b in batches(TRAIN, 4):
        backward_pairs(model, b, [fac])
    eig = fac.eigens([v.key for v in linears])
    k = 3
    proj = pca_projections(linears, k, eig)
    for v in linears:
        p = proj[v.key]
        for P, S in ((p.P_in, fac.sum_hh[v.key]), (p.P_out, fac.sum_dd[v.key])):
            C = (S / fac.tokens[v.key]).numpy()
            w = np.sort(np.linalg.eigvalsh(0.5 * (C + C.T)))[::-1][:k]
            P = P.double().numpy()
            assert P.shape == (k, C.shape[0])
            np.testing.assert_allclose(P @ P.T, np.eye(k), atol=1e-6)  # float32 rows
            np.testing.assert_allclose(P @ C @ P.T, np.diag(w), rtol=0, atol=1e-5 * w[0])
    got = torch.cat([s["vectors"] for s in _shards(GradientProjector(model, projections=proj), TRAIN)])
    want = torch.stack([_brute_vector(model, proj, e) for e in TRAIN])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9 * float(want.abs().max()))
    assert all(p.P_in is None and p.P_out is None for p in pca_projections(linears, 10_000, eig).values())
    with pytest.raises(ValueError, match="no second moments"):
        pca_projections(linears, k, {})


def test_topk_rows_equal_a_stable_full_sort_with_ties():
    from iprox_lightning.scoring.query import topk_rows

    g = torch.Generator().manual_seed(0)
    for n, k in ((7, 3), (20, 5), (5, 9), (30, 1)):
        values = torch.randint(0, 4, (6, n), generator=g).double()  # many ties
        values[0, :] = 1.0  # a row of one value
        values[1, ::2] = float("-inf")
        index = torch.stack([torch.randperm(n, generator=g) for _ in range(6)])
        v, i = topk_rows(values, index, k)
        for r in range(6):
            want = sorted(range(n), key=lambda j: (-float(values[r, j]), int(index[r, j])))[:k]
            assert i[r].tolist() == [int(index[r, j]) for j in want]
            assert v[r].tolist() == [float(values[r, j]) for j in want]


def test_nearest_is_blocked_and_never_holds_all_cosines(monkeypatch):
    """Blocks of stored rows with a running top-k give the unblocked answer; no step sees more than ``k + block``
    candidates per query, whatever the store's size."""
    import iprox_lightning.scoring.query as q

    g = torch.Generator().manual_seed(3)
    X = torch.randn(50, 6, generator=g)
    # equal cosines, the earlier stored row first: rows of norm 2 with entries ±1, 0, so that their cosine with the
    # query X[3] is exactly 1 whatever the summation order (every partial sum of 0.25s is exact)
    X[3] = X[7] = torch.tensor([1.0, -1.0, 1.0, 0.0, 1.0, 0.0])
    shards = [{"ids": [f"e{j}" for j in range(a, a + 25)], "vectors": X[a:a + 25],
               "zero_grad": torch.zeros(25, dtype=torch.bool), "nonfinite": torch.zeros(25, dtype=torch.bool)}
              for a in (0, 25)]
    Q = torch.cat([X[3:4], torch.randn(3, 6, generator=g)])
    want = nearest(shards, Q, k=4, block_rows=10**6)
    widths = []
    real = q.topk_rows
    monkeypatch.setattr(q, "topk_rows", lambda v, i, k: (widths.append(v.shape[1]), real(v, i, k))[1])
    got = q.nearest(shards, Q, k=4, block_rows=3)
    assert got[0] == want[0]
    # not bit-equal: a [4, 3] block and the [4, 25] shard are different GEMM shapes, for which BLAS picks different
    # kernels and summation orders (on AMD EPYC they differ in the last bit); float64 cosines of unit vectors over
    # D = 6 terms differ by at most a few D·eps ~ 1.3e-15
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-14)
    assert (got[1][0, :2] == 1.0).all()  # the exact tie stays exact
    assert got[0][0][:2] == ["e3", "e7"]
    assert max(widths) <= 4 + 3
