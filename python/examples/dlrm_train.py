"""Training TorchRec's DLRM, the recommendation model this library is for,
on the collectives backend and on Gloo in the same job:

    torchrun --nproc-per-node 2 python/examples/dlrm_train.py
    torchrun --nproc-per-node 4 python/examples/dlrm_train.py --steps 200 --json dlrm.json

DistributedModelParallel shards the embedding tables across the ranks and
wraps the dense part in DDP: each step, the sparse features go to the ranks
owning their tables and the pooled embeddings come back (AllToAll, uneven
splits, forward and backward), and the dense gradients, data-parallel
tables' included, are all-reduced. The planner is constrained so that the
tables are sharded four ways, a quarter of them each: table-wise,
column-wise, table-column-wise and data-parallel, the types TorchRec's
sharder offers on CPU (`--sharding` takes row-wise too).

The same model (the initial weights of one seeded unsharded DLRM), the
same optimizer (SGD, fused into the embedding kernels' backward for the
sharded tables) and the same synthetic batches (variable-length sparse
features, seeded per rank and step) are trained once per backend, each on
a process group of its own, the steps interleaved so both see the same
machine. Rank 0 prints the loss per step on each backend and the step
times (medians, warm-up steps left out). "dlrm ok" (else exit status 1) if
the losses agree on every rank and step to float round-off (rtol 1e-5,
atol 1e-6; all-reduces may add in another order), so do the final weights,
and the step-0 losses match the unsharded model's on the same batches.

Needs torchrec and fbgemm-gpu-cpu (for the torch they were built against).
"""

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import collectives.torch  # noqa: F401  (registers the "collectives" backend)


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


parser = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
parser.add_argument("--steps", type=int, default=100, help="training steps per backend")
parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timings")
parser.add_argument("--batch", type=int, default=128, help="samples per rank per step")
parser.add_argument("--tables", type=int, default=8, help="embedding tables, split evenly among the sharding types")
parser.add_argument("--rows", type=int, default=4000, help="rows per table")
parser.add_argument("--dim", type=int, default=16, help="embedding dimension (a multiple of 4: column blocks of dim/4)")
parser.add_argument("--dense", type=int, default=13, help="dense features per sample")
parser.add_argument("--backends", default="gloo,collectives", help="comma-separated; the losses of all are compared")
parser.add_argument(
    "--sharding",
    default="table_wise,column_wise,table_column_wise,data_parallel",
    help="comma-separated sharding types, the tables split evenly among them in order; also row_wise",
)
parser.add_argument(
    "--lr",
    type=float,
    default=0.5,
    help="SGD learning rate; at 1.0 training turns unstable after 150 steps or so, which magnifies round-off "
    "(from 4 ranks on, Gloo's all-reduce adds in another order) until the losses part",
)
parser.add_argument("--json", metavar="FILE", help="write the losses and step times here (rank 0)")
args = parser.parse_args()
backends = args.backends.split(",")
KINDS = ["table_wise", "column_wise", "table_column_wise", "data_parallel", "row_wise"]
if not set(args.sharding.split(",")) <= set(KINDS):
    parser.error(f"--sharding: choose from {', '.join(KINDS)}")
sharding = [ShardingType(t) for t in args.sharding.split(",")]
if args.tables % len(sharding) or args.dim % 4 or args.warmup >= args.steps:
    parser.error("--tables must be a multiple of the sharding types, --dim of 4, and --warmup less than --steps")

torch.set_num_threads(1)  # ranks share the cores
# TorchRec and fbgemm warn about what does not apply here: a Topology made by
# hand, no cache on data-parallel tables, fbgemm's dense (data-parallel)
# lookup said to have no autograd kernel (it has one: those tables train),
# torch functions TorchRec calls deprecated.
logging.getLogger().setLevel(logging.ERROR)
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*(autograd kernel was not registered|broadcast_buffers|is deprecated)")
# The default group only sets up and checks; each model gets a group of its own.
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
groups = {name: dist.new_group(backend=name) for name in backends}

tables = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
    for i in range(args.tables)
]
features = [f"f{i}" for i in range(args.tables)]
sharding_of = {t.name: sharding[i * len(sharding) // args.tables] for i, t in enumerate(tables)}


def dlrm(device: str) -> DLRM:
    # DLRM wants the bottom (dense) MLP to end at the embedding dimension.
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device(device))
    return DLRM(ebc, dense_in_features=args.dense, dense_arch_layer_sizes=[64, args.dim], over_arch_layer_sizes=[64, 32, 1])


# One unsharded model, seeded, the same on every rank: both runs start from its weights.
torch.manual_seed(0)
reference = dlrm("cpu").state_dict()


def load(model: DistributedModelParallel) -> None:
    """Copies the reference weights into the model: a shard takes its rows
    and columns of its table (its offsets); the rest is whole on every rank."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            full = reference[name]
            if isinstance(t, ShardedTensor):  # a sharded table: this rank's pieces
                for shard in t.local_shards():
                    (r, c), (h, w) = shard.metadata.shard_offsets, shard.tensor.shape
                    shard.tensor.copy_(full[r : r + h, c : c + w])
            else:
                t.copy_(full)


class Sharder(EmbeddingBagCollectionSharder):
    """TorchRec's, with row-wise sharding on CPU as well: TorchRec lists it
    for GPUs only, but its CPU path trains (ids AllToAll; partial poolings
    ReduceScatter forward, AllGather backward). Table-row-wise and grid are
    left out: TorchRec makes their per-host groups once per process, on the
    first model's backend, and a second model would reuse them."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return super().sharding_types(compute_device_type) + [ShardingType.ROW_WISE.value]


def sharded(group):
    """The model sharded on `group`, its optimizer and its plan."""
    env = ShardingEnv.from_process_group(group)
    # SGD applied by the embedding kernels in the backward (TorchRec's
    # "fused" optimizer): the sharded tables' gradients are never materialized.
    sharder = Sharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": args.lr})
    # min_partition: the column blocks of (table-)column-wise tables, so that
    # they are split across up to four ranks even at a small --dim.
    constraints = {
        name: ParameterConstraints(sharding_types=[st.value], min_partition=args.dim // 4)
        for name, st in sharding_of.items()
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=n, compute_device="cpu", local_world_size=n),
        batch_size=args.batch,
        constraints=constraints,
        # Memory is no concern at this size (and the default, heuristic reservation warns).
        storage_reservation=FixedPercentageStorageReservation(0.15),
    )
    module = dlrm("meta")  # DMP materializes only this rank's shards
    plan = planner.collective_plan(module, [sharder], group)  # rank 0 plans, broadcast on `group`
    model = DistributedModelParallel(module, env=env, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    load(model)
    # The rest (dense layers, data-parallel tables), gradients all-reduced by DDP.
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=args.lr),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense]), plan


def batch(step: int):
    """This rank's batch at `step`, seeded by both: the same for every run."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    b, k = args.batch, args.tables
    dense = torch.randn(b, args.dense, generator=g)
    # 0 to 6 ids per sample and feature (some bags empty), power-law ids:
    # a few hot rows, as in click logs.
    lengths = torch.randint(0, 7, (k * b,), generator=g)
    u = torch.rand(int(lengths.sum()), generator=g)
    ids = (args.rows * u**3).long().clamp_(max=args.rows - 1)
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=features, values=ids, lengths=lengths)
    # A label the model can learn: from the dense features and the first
    # feature's ids.
    ids0 = ids[: int(lengths[:b].sum())]
    bag = torch.repeat_interleave(torch.arange(b), lengths[:b])
    hot = torch.zeros(b).index_add_(0, bag, (ids0 < args.rows // 10).float())
    logit = dense[:, 0] - dense[:, 1] + hot - 1
    label = (torch.rand(b, generator=g) < torch.sigmoid(2 * logit)).float()
    return dense, sparse, label


data = [batch(s) for s in range(args.steps)]
runs = {}
for name, group in groups.items():
    model, opt, plan = sharded(group)
    runs[name] = {"model": model, "opt": opt, "plan": str(plan), "loss": [], "time": []}
plans = {run["plan"] for run in runs.values()}
assert len(plans) == 1, "the planner sharded the model differently on the two groups"
if rank == 0:
    print("\n".join(f"# {line}" for line in plans.pop().splitlines() if line))

for step in range(args.steps):
    dense, sparse, label = data[step]
    for name, run in runs.items():
        dist.barrier(group=groups[name])
        t0 = time.perf_counter()
        # Forward: the ids go to the ranks owning their tables (or columns),
        # the pooled embeddings come back (AllToAll); backward the same
        # reversed, the fused optimizer updating the shards as it goes, and
        # DDP all-reduces the dense gradients.
        logits = run["model"](dense, sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label)
        run["opt"].zero_grad()
        loss.backward()
        run["opt"].step()
        run["time"].append(time.perf_counter() - t0)
        run["loss"].append(loss.item())

# The unsharded model on this rank's first batch: the step-0 loss every run
# must match (the exchange delivered the right embeddings, not only the same
# ones on both backends).
unsharded = dlrm("cpu")
unsharded.load_state_dict(reference)
with torch.no_grad():
    dense, sparse, label = data[0]
    loss0 = torch.nn.functional.binary_cross_entropy_with_logits(unsharded(dense, sparse).squeeze(-1), label).item()


def gather(values) -> torch.Tensor:
    """Every rank's `values`, ranks x len (on the default group)."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    return torch.stack(every)


losses = {k: gather(run["loss"]) for k, run in runs.items()}
loss0s = gather([loss0])[:, 0]
# A step takes as long as its slowest rank.
step_ms = {k: (gather(run["time"]).max(0).values[args.warmup :] * 1e3).tolist() for k, run in runs.items()}


def pieces(t) -> list[torch.Tensor]:
    """What this rank holds of a weight: its shards, or the whole."""
    return [s.tensor for s in t.local_shards()] if isinstance(t, ShardedTensor) else [t]


# The final weights of each run against the first's, piece by piece on each rank.
first = backends[0]
wdiff = {}
for k in backends[1:]:
    a, b = runs[first]["model"].state_dict(), runs[k]["model"].state_dict()
    d = max(((x - y).abs().max().item() for name in a for x, y in zip(pieces(a[name]), pieces(b[name]))), default=0.0)
    worst = torch.tensor([d])
    dist.all_reduce(worst, dist.ReduceOp.MAX)
    wdiff[k] = worst.item()

ok = True
if rank == 0:
    print(f"# DLRM, {n} ranks, {args.tables} tables {args.rows} x {args.dim}, batch {args.batch}/rank, {args.steps} steps")
    print("# step  " + "  ".join(f"{k + ' loss':>18}" for k in backends) + "   (mean over ranks)")
    for s in range(args.steps):
        print(f"  {s:4d}  " + "  ".join(f"{losses[k][:, s].mean().item():18.6f}" for k in backends))
    for k in backends:
        d = (losses[k][:, 0] - loss0s).abs().max().item()
        good = torch.allclose(losses[k][:, 0], loss0s, rtol=1e-5, atol=1e-6)
        print(f"# {k}: step-0 loss against the unsharded model, largest difference {d:.2e} (any rank)")
        ok &= good
    for k in backends[1:]:
        d = (losses[k] - losses[first]).abs().max().item()
        # Float round-off only: sums (all-reduce, pooling) may add in another order.
        good = torch.allclose(losses[k], losses[first], rtol=1e-5, atol=1e-6) and wdiff[k] < 1e-5
        print(f"# {k} against {first}: largest loss difference {d:.2e} (any rank, any step), weights {wdiff[k]:.2e}")
        ok &= good
    print(f"# time per step, steps {args.warmup}..{args.steps - 1}, slowest rank:")
    print(f"#   {'backend':12s} {'median ms':>10s} {'mean ms':>10s}")
    for k in backends:
        print(f"#   {k:12s} {statistics.median(step_ms[k]):10.2f} {statistics.mean(step_ms[k]):10.2f}")
    ratio = None
    if "gloo" in step_ms and "collectives" in step_ms:
        ratio = statistics.median(step_ms["collectives"]) / statistics.median(step_ms["gloo"])
        print(f"# step time collectives / gloo (medians): {ratio:.2f}")
    print("dlrm ok" if ok else "dlrm FAILED", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ranks": n,
                    "args": vars(args),
                    "sharding": {t: st.value for t, st in sharding_of.items()},
                    "median_step_ms": {k: statistics.median(v) for k, v in step_ms.items()},
                    "mean_step_ms": {k: statistics.mean(v) for k, v in step_ms.items()},
                    "collectives_over_gloo": ratio,
                    "step_ms": step_ms,  # after warm-up, slowest rank
                    "losses": {k: v.tolist() for k, v in losses.items()},  # ranks x steps
                    "weight_difference": wdiff,
                    "ok": ok,
                },
                f,
                indent=1,
            )
verdict = torch.tensor([int(ok)])
dist.broadcast(verdict, 0)
# The models hold their groups (DDP): dropped first, then the groups torn
# down in order on every rank, not by the interpreter at exit (see ddp_train.py).
del model, opt, run
runs.clear()
gc.collect()
for group in groups.values():
    dist.destroy_process_group(group)
    dist.barrier()
dist.destroy_process_group()
sys.exit(0 if verdict.item() else 1)
