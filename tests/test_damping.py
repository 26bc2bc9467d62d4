"""The one damping rule, and that IPSVD and K-FAC both follow it (a zero trace included)."""
import pytest
import torch

from iprox_lightning.engine.damping import damping_value
from iprox_lightning.compression.ipsvd import damping_values
from iprox_lightning.scoring.metrics import damped_eigh


def test_damping_value():
    assert damping_value(8.0, 4, 1e-2, "relative") == pytest.approx(2e-2)  # fraction of the mean eigenvalue
    assert damping_value(0.0, 4, 1e-2, "relative") == 1e-2  # zero trace: λ = damping
    assert damping_value(8.0, 4, 1e-2, "absolute") == 1e-2
    with pytest.raises(ValueError, match="damping must be > 0"):
        damping_value(8.0, 4, 0.0, "relative")
    with pytest.raises(ValueError, match="damping_mode must be one of"):
        damping_value(8.0, 4, 1e-2, "rel")


@pytest.mark.parametrize("mode", ["relative", "absolute"])
@pytest.mark.parametrize("zero_delta", [False, True])
def test_ipsvd_and_kfac_damp_alike(mode, zero_delta):
    g = torch.Generator().manual_seed(0)
    H = torch.randn(5, 9, generator=g, dtype=torch.float64)
    Delta = torch.zeros(3, 9, dtype=torch.float64) if zero_delta else torch.randn(3, 9, generator=g, dtype=torch.float64)
    lam_h, lam_d = damping_values(H, Delta, 1e-2, mode)
    for X, lam in ((H, lam_h), (Delta, lam_d)):
        C = X @ X.t() / X.shape[1]
        want = 1e-2 * float(torch.trace(C)) / C.shape[0] if mode == "relative" and float(torch.trace(C)) > 0 else 1e-2
        assert lam == pytest.approx(want, rel=1e-12)
        Q, e, lam_kfac = damped_eigh(C, 1e-2, mode)  # the K-FAC factor of the same second moment
        assert lam_kfac == pytest.approx(lam, rel=1e-12)
        torch.testing.assert_close(Q @ torch.diag(e) @ Q.t(), C + lam * torch.eye(len(C), dtype=C.dtype))
