"""Experiment (issue 63, item 2): can Stage 2's double backward run on a proxy that FSDP2 gathers one block at a time
(``fully_shard(..., reshard_after_forward=True)``, the default reshard after backward), instead of gathered whole for
the step as ``alignment/fsdp.shard_proxy`` does today?

A toy proxy (3 residual blocks of a low-rank ``tanh(x Bᵀ Aᵀ)``, 2 gloo ranks) takes ``g = autograd.grad(loss, factors,
create_graph=True)``, then ``Σ (1 − cos(g, t))`` and its backward, against the same step unsharded:

* ``plain``: the create_graph backward's graph holds the gathered factors the forward used, whose storage FSDP2 frees
  at reshard -> ``setStorage: ... out of bounds for storage of size 0`` (what the last session measured);
* ``hooks``: ``torch.autograd.graph.saved_tensors_hooks`` around the forward and the create_graph backward pack a saved
  tensor that lives in a gathered factor's storage as a handle (module, name, size, stride, offset) and unpack it by
  gathering the factor again (``DTensor.full_tensor()``, a collective: the same order on every rank) -> the loss and
  the factors' gradients equal the unsharded step's.

So the double backward does not make per-block gathering impossible. Not done in the product (see the report in
bench/results/plan/stage2_proxy_reshard.txt): the teacher pass and the projections also read the factors after the
block's forward (they would gather them the same way), checkpointed blocks recompute outside FSDP2's hooks, and
bf16-mixed's autocast copies of the factors are saved tensors of their own.

  OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 bench/stage2_proxy_reshard.py plain
  OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 bench/stage2_proxy_reshard.py hooks
"""
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh

class LR(nn.Module):
    def __init__(s, d, r):
        super().__init__(); s.A = nn.Parameter(torch.randn(d, r) / r**.5); s.B = nn.Parameter(torch.randn(r, d) / d**.5)
    def forward(s, x): return torch.tanh(x @ s.B.t() @ s.A.t())
class Block(nn.Module):
    def __init__(s, d, r): super().__init__(); s.l = LR(d, r)
    def forward(s, x): return x + s.l(x)
class Net(nn.Module):
    def __init__(s, d=16, r=4, n=3): super().__init__(); s.blocks = nn.ModuleList([Block(d, r) for _ in range(n)])
    def forward(s, x):
        for b in s.blocks: x = b(x)
        return x.pow(2).mean()

def step(net, x, target, hooks=None):
    captured = []
    hs = [m.register_forward_pre_hook(lambda m, a: captured.append((m.A, m.B))) for m in net.modules() if isinstance(m, LR)]
    ctx = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx:
        loss = net(x)
        flat = [t for pair in captured for t in pair]
        g = torch.autograd.grad(loss, flat, create_graph=True)
    for h in hs: h.remove()
    cos = sum(1 - torch.nn.functional.cosine_similarity(a.reshape(1, -1), t.reshape(1, -1)).sum() for a, t in zip(g, target))
    cos.backward()
    return float(cos)

def main():
    dist.init_process_group("gloo"); rank = dist.get_rank()
    torch.manual_seed(0); ref = Net(); x = torch.randn(2, 8, 16); target = [torch.randn_like(p) for p in ref.parameters()]
    import copy
    mode = sys.argv[1]
    net = copy.deepcopy(ref)
    v_ref = step(ref, x, target)
    gref = [p.grad.clone() for p in ref.parameters()]
    mesh = init_device_mesh("cpu", (2,))
    for b in net.blocks: fully_shard(b, mesh=mesh, reshard_after_forward=True)
    fully_shard(net, mesh=mesh, reshard_after_forward=True)
    hooks = None
    if mode == "hooks":
        owners = {}  # unsharded factor storage -> (module, name), recorded at each block's pre-forward (after FSDP's)
        for m in net.modules():
            if isinstance(m, LR):
                m.register_forward_pre_hook(lambda m, a: owners.update({m.A.untyped_storage()._cdata: (m, "A"), m.B.untyped_storage()._cdata: (m, "B")}))
        def pack(t):
            key = t.untyped_storage()._cdata
            if key in owners:
                m, name = owners[key]
                return ("factor", m, name, t.size(), t.stride(), t.storage_offset())
            return t
        def unpack(p):
            if isinstance(p, tuple) and p and p[0] == "factor":
                _, m, name, size, stride, off = p
                from torch.distributed.tensor import DTensor
                full = getattr(m, name)
                if isinstance(full, DTensor):
                    full = full.full_tensor()  # re-gathered (a collective: the same order on every rank)
                elif full.untyped_storage().size() == 0:
                    raise RuntimeError("freed and not sharded")
                return full.detach().as_strided(size, stride, off).clone()
            return p
        hooks = (pack, unpack)
    try:
        v = step(net, x, target, hooks)
        g = [p.grad.full_tensor() for p in net.parameters()]
        err = max(float((a - b).abs().max()) for a, b in zip(g, gref))
        print(f"rank{rank} {mode}: loss {v:.6f} vs {v_ref:.6f}, max grad err {err:.2e}", flush=True)
    except Exception as e:
        print(f"rank{rank} {mode}: {type(e).__name__}: {str(e)[:300]}", flush=True)

main()
