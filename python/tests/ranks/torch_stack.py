"""One rank of the torch-stack tests: what a training script written for
torch's current distributed stack calls, run twice in one process, on the
"collectives" backend and on Gloo, the results compared. Sections (argv,
default all): funcol (functional collectives, eager and under
torch.compile with Inductor), dtensor (redistribution, tensor and sequence
parallel), mesh2d (2-D meshes from new_group and from split_group, FSDP
over TP; 4 ranks), fsdp (FSDP2 with and without resharding, bf16
parameters reduced in fp32; FSDP1), pipeline (a 2-stage GPipe schedule).
Prints "ok SECTION RANK" for each section that matched Gloo."""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import collectives.torch  # noqa: F401  (registers the backend)

dist.init_process_group("collectives")
rank, n = dist.get_rank(), dist.get_world_size()
ours = dist.group.WORLD
gloo = dist.new_group(backend="gloo")
GROUPS = {"collectives": ours, "gloo": gloo}
failures = []
# torch 2.15 renamed the tensor forms "_single" (the old names warn).
all_gather_single = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)
all_gather_single_coalesced = getattr(funcol, "all_gather_single_coalesced", funcol.all_gather_into_tensor_coalesced)
reduce_scatter_single_coalesced = getattr(funcol, "reduce_scatter_single_coalesced", funcol.reduce_scatter_tensor_coalesced)


def close(label, got, want, rtol=1e-5, atol=1e-6):
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
        failures.append(f"{label}: {got.flatten()[:6].tolist()} != {want.flatten()[:6].tolist()}")


def both(label, f, **tolerance):
    """Runs f(group) on each backend; the results (a tensor or a list of
    them) must agree."""
    out = {name: f(g) for name, g in GROUPS.items()}
    a, b = out["collectives"], out["gloo"]
    for i, (x, y) in enumerate(zip(a, b) if isinstance(a, (list, tuple)) else [(a, b)]):
        close(f"{label} [{i}]", x, y, **tolerance)


def data(*shape, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(*shape, generator=g)


def everywhere(*shape, seed=0):
    """The same random tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- functional collectives ----


def funcol_section():
    x = data(4, 6)
    both("funcol all_reduce", lambda g: funcol.all_reduce(x, "sum", g).wait())
    both("funcol all_reduce avg", lambda g: funcol.all_reduce(x, "avg", g))
    both("funcol all_gather_tensor", lambda g: all_gather_single(x, 0, g))
    both("funcol all_gather_tensor dim 1", lambda g: all_gather_single(x, 1, g))
    both("funcol reduce_scatter_tensor", lambda g: reduce_scatter_single(data(2 * n, 3), "sum", 0, g))
    both("funcol all_to_all_single", lambda g: funcol.all_to_all_single(data(2 * n, 3), None, None, g))
    # Uneven: rank r sends j + 1 rows to j.
    rows_in = [j + 1 for j in range(n)]
    rows_out = [rank + 1] * n
    both("funcol all_to_all_single uneven",
         lambda g: funcol.all_to_all_single(data(sum(rows_in), 3), rows_out, rows_in, g))
    both("funcol all_reduce_coalesced", lambda g: funcol.all_reduce_coalesced([x, data(3, seed=1)], "max", g))
    both("funcol all_gather_into_tensor_coalesced",
         lambda g: all_gather_single_coalesced([x, data(5, seed=2)], g))
    both("funcol reduce_scatter_tensor_coalesced",
         lambda g: reduce_scatter_single_coalesced([data(n * 2, seed=3), data(n, 4, seed=4)], "sum", [0, 0], g))
    both("funcol all_reduce_inplace", lambda g: funcol.all_reduce_inplace(x.clone(), "sum", g))
    both("funcol native wait_tensor", lambda g: torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x, "sum", g.group_name)))

    def step(t, g):
        y = funcol.all_reduce(t * 2, "sum", g)
        z = all_gather_single(y.sin(), 0, g)
        w = reduce_scatter_single(z, "avg", 0, g)
        return funcol.all_to_all_single(w + 1, None, None, g) * 3

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    both("torch.compile (inductor) of funcol", lambda g: compiled(data(n * 2, 4, seed=5), g))
    both("eager = compiled", lambda g: step(data(n * 2, 4, seed=5), g) if g is gloo else compiled(data(n * 2, 4, seed=5), g))


# ---- DTensor ----


def mlp(dim=16, seed=7):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))


def dtensor_section():
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    meshes = {name: DeviceMesh.from_group(g, "cpu") for name, g in GROUPS.items()}
    full = everywhere(4 * n, 6, seed=11)

    def redistribute(g):
        mesh = meshes["collectives" if g is ours else "gloo"]
        d = distribute_tensor(full, mesh, [Shard(0)])
        out = [d.redistribute(mesh, [Replicate()]).to_local(),
               d.redistribute(mesh, [Shard(1)]).to_local()]
        p = d.redistribute(mesh, [Replicate()]) * 1.0
        from torch.distributed.tensor import DTensor
        partial = DTensor.from_local(full.clone() * (rank + 1), mesh, [Partial()])
        out += [partial.redistribute(mesh, [Replicate()]).to_local(),
                partial.redistribute(mesh, [Shard(0)]).to_local(),
                p.full_tensor()]
        return out

    both("dtensor redistribute", redistribute)

    def tensor_parallel(g):
        mesh = meshes["collectives" if g is ours else "gloo"]
        model = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = everywhere(8, 16, seed=12)  # TP: the same input on every rank
        y = model(x)
        y.sum().backward()
        return [y, model[0].weight.grad.full_tensor(), model[2].weight.grad.full_tensor()]

    both("tensor parallel", tensor_parallel, rtol=1e-4, atol=1e-5)

    def sequence_parallel(g):
        mesh = meshes["collectives" if g is ours else "gloo"]
        torch.manual_seed(3)
        model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        # The norm runs on sequence shards (dim 1), the linears tensor-parallel.
        plan = {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
                "3": RowwiseParallel(output_layouts=Shard(1))}
        model = parallelize_module(model, mesh, plan)
        x = everywhere(2, 4 * n, 16, seed=13)
        y = model(x[:, rank * 4:(rank + 1) * 4])
        y.pow(2).sum().backward()
        return [y.to_local() if hasattr(y, "to_local") else y, model[1].weight.grad.full_tensor()]

    both("sequence parallel", sequence_parallel, rtol=1e-4, atol=1e-5)


# ---- 2-D meshes (4 ranks) ----


def mesh2d_section():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    assert n == 4, "mesh2d needs 4 ranks"
    made = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # new_group, on the default (ours)
    # The same mesh from groups that dist.split_group made (the library's split).
    dp_split = dist.split_group(ours, split_ranks=[[0, 2], [1, 3]])
    tp_split = dist.split_group(ours, split_ranks=[[0, 1], [2, 3]])
    grid = torch.arange(4).reshape(2, 2)
    split = DeviceMesh.from_group([dp_split, tp_split], "cpu", mesh=grid, mesh_dim_names=("dp", "tp"))
    gloo_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={"dp": "gloo", "tp": "gloo"}) \
        if "backend_override" in init_device_mesh.__code__.co_varnames else None
    if gloo_mesh is None:
        dp_g = [dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")][rank % 2]
        tp_g = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")][rank // 2]
        gloo_mesh = DeviceMesh.from_group([dp_g, tp_g], "cpu", mesh=grid, mesh_dim_names=("dp", "tp"))
    assert dist.get_backend(made["tp"].get_group()) == "collectives"
    assert dist.get_backend(split["dp"].get_group()) == "collectives"

    def train(mesh):
        model = parallelize_module(mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(3):
            x = everywhere(8, 16, seed=20 + step + 10 * (rank // 2))  # the same within a TP pair
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses)

    want = train(gloo_mesh)
    close("2-D mesh from new_group: FSDP over TP", train(made), want, rtol=1e-4, atol=1e-5)
    close("2-D mesh from split_group: FSDP over TP", train(split), want, rtol=1e-4, atol=1e-5)
    # Sub-groups work on their own.
    for name, mesh in (("new_group", made), ("split_group", split)):
        t = torch.full((3,), float(rank))
        dist.all_reduce(t, group=mesh["dp"].get_group())
        close(f"{name} dp all_reduce", t, torch.full((3,), float(2 * (rank % 2) + 2)))


# ---- FSDP ----


def fsdp_section():
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard

    def train(g, reshard, mp=None, steps=4):
        mesh = DeviceMesh.from_group(g, "cpu")
        model = mlp(32)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp or MixedPrecisionPolicy())
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp or MixedPrecisionPolicy())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            loss = model(data(8, 32, seed=30 + step)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return [torch.stack(losses)] + [p.full_tensor() for p in model.parameters()]

    both("FSDP2 reshard_after_forward", lambda g: train(g, True), rtol=1e-4, atol=1e-5)
    both("FSDP2 no reshard", lambda g: train(g, False), rtol=1e-4, atol=1e-5)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    both("FSDP2 bf16 params, fp32 reduction", lambda g: train(g, True, mp), rtol=2e-2, atol=2e-3)

    def fsdp1(g):
        model = FullyShardedDataParallel(mlp(32), process_group=g, device_id=torch.device("cpu"), use_orig_params=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            loss = model(data(8, 32, seed=40 + step)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses)

    both("FSDP1", fsdp1, rtol=1e-4, atol=1e-5)


# ---- pipelining ----


def pipeline_section():
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if n < 2:
        return

    def train(g):
        torch.manual_seed(5)
        full = nn.Sequential(*[nn.Linear(16, 16) for _ in range(2 * n)])
        per = len(full) // n
        stage_mod = nn.Sequential(*list(full)[rank * per:(rank + 1) * per])
        stage = PipelineStage(stage_mod, rank, n, torch.device("cpu"), group=g)
        losses = []
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda y, t: (y - t).pow(2).mean())
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(9))
        target = torch.randn(8, 16, generator=torch.Generator().manual_seed(10))
        if rank == 0:
            schedule.step(x)
        elif rank == n - 1:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        grads = [p.grad.clone() for p in stage_mod.parameters()]
        return ([torch.stack(losses)] if losses else []) + grads

    both("pipelining GPipe", train, rtol=1e-4, atol=1e-5)


SECTIONS = {
    "funcol": funcol_section,
    "dtensor": dtensor_section,
    "mesh2d": mesh2d_section,
    "fsdp": fsdp_section,
    "pipeline": pipeline_section,
}
for name in sys.argv[1:] or [s for s in SECTIONS if s != "mesh2d" or n == 4]:
    before = len(failures)
    SECTIONS[name]()
    dist.barrier()
    if len(failures) == before:
        sys.stdout.write(f"ok {name} {rank}\n")
if failures:
    print(f"rank {rank}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), file=sys.stderr)
    sys.exit(1)
dist.destroy_process_group()
