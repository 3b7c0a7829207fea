"""DDP, compiled DDP, FSDP2 and SequenceParallel on CUDA with NCCL, checked against one GPU.

Run with one process per GPU (benchmarks/gpu_check.sh does, when more than one is lent):

    torchrun --standalone --nproc-per-node=2 benchmarks/gpu_dist_check.py
    torchrun --standalone --nproc-per-node=2 benchmarks/gpu_dist_check.py --cpu  # smoke

The models and data are the CPU tests' (tests/_dist_worker.py), in float64 on CUDA; every
rank compares its gradients / outputs with the single-process full-batch run it also does,
prints one PASS/FAIL line per check, and the exit status is 1 if any check failed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests import _dist_worker as w  # noqa: E402


def grads_of(model, ids, target):
    model.zero_grad(set_to_none=True)
    w.classifier_loss(model, ids, target).backward()
    return {n.replace("_orig_mod.", "").replace("module.", ""): w._full(p.grad)
            for n, p in model.named_parameters() if p.grad is not None}


def close(got, want, atol):
    return all(torch.allclose(got[n].cpu(), want[n].cpu(), atol=atol, rtol=0) for n in want)


def main() -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mmattn.distributed import SequenceParallel, all_reduce_grads

    cpu = "--cpu" in sys.argv  # a smoke run of this script itself: gloo on the CPU
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if not cpu:
        torch.cuda.set_device(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, w.VOCAB, (2 * world, 7), generator=gen)
    ids[1::2, 4:] = 0
    target = torch.randn(2 * world, 3, generator=gen, dtype=w.DTYPE)
    ids, target = ids.to(device), target.to(device)
    rows = slice(2 * rank, 2 * rank + 2)
    want = grads_of(w.build_classifier().to(device), ids, target)
    results = {}

    for unused in (False, True):
        model = DDP(w.build_classifier(unused).to(device), find_unused_parameters=unused)
        results[f"ddp find_unused={unused}"] = close(grads_of(model, ids[rows], target[rows]),
                                                    want, 1e-6)
    model = torch.compile(DDP(w.build_classifier().to(device)),
                          backend="aot_eager" if cpu else "inductor")
    results["compiled ddp"] = close(grads_of(model, ids[rows], target[rows]), want, 1e-6)
    model = w.build_classifier().to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results["fsdp2"] = close(grads_of(model, ids[rows], target[rows]), want, 1e-6)

    sp_world = min(world, 4)  # 24 positions: at least 6 per rank
    group = dist.new_group(list(range(sp_world)))
    for case in w.SP_CASES if rank < sp_world else ():
        attn, x, mask, grad = w.build_sp(case)
        attn, x, grad = attn.to(device), x.to(device), grad.to(device)
        mask = None if mask is None else mask.to(device)
        ref_x = x.clone().requires_grad_()
        ref, _ = attn(ref_x, key_padding_mask=mask, is_causal=w.sp_causal(case))
        ref.backward(grad)
        ref_params = {n: p.grad.clone() for n, p in attn.named_parameters()}
        attn.zero_grad(set_to_none=True)
        n = w.SP_LENGTH // sp_world
        part = slice(rank * n, (rank + 1) * n)
        shard = x[:, part].clone().requires_grad_()
        out, _ = SequenceParallel(attn, group=group)(
            shard, key_padding_mask=None if mask is None else mask[:, part],
            is_causal=w.sp_causal(case),
        )
        out.backward(grad[:, part])
        all_reduce_grads(attn, group=group)
        ok = torch.allclose(out, ref[:, part], atol=1e-5, rtol=0)
        ok &= torch.allclose(shard.grad, ref_x.grad[:, part], atol=1e-5, rtol=0)
        ok &= close({n: p.grad for n, p in attn.named_parameters()}, ref_params, 1e-5)
        results[f"sequence parallel {case}"] = bool(ok)

    for name, ok in results.items():
        print(f"rank {rank}: {'PASS' if ok else 'FAIL'} {name}", flush=True)
    dist.destroy_process_group()
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
