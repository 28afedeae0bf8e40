"""Training TorchRec's DLRM, the recommendation model this library is for,
on the collectives backend and on Gloo in the same job:

    torchrun --nproc-per-node 2 python/examples/dlrm_train.py
    torchrun --nproc-per-node 4 python/examples/dlrm_train.py --steps 40 --json dlrm.json

DistributedModelParallel shards the embedding tables across the ranks and
wraps the dense part in DDP: each step, the sparse features go to the ranks
owning their tables and the pooled embeddings come back (AllToAll, uneven
splits, forward and backward), and the dense gradients, data-parallel
tables' included, are all-reduced. The planner is constrained so that the
tables are sharded four ways, a quarter of them each: table-wise,
column-wise, table-column-wise and data-parallel (the types TorchRec's
sharder offers on CPU; row-wise ones are GPU-only).

The same model (same initial weights, taken from one seeded unsharded
DLRM), the same optimizer (row-wise Adagrad fused into the embedding
kernels' backward, Adagrad on the dense part) and the same synthetic
batches (variable-length sparse features, seeded per rank and step) are
trained once per backend, each on its own process group, the steps
interleaved so both see the same machine. Rank 0 prints the loss per step
on each backend and the median step time (warm-up steps left out); the
losses must agree, on every rank, to float round-off ("dlrm ok", else exit
status 1).
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import collectives.torch  # noqa: F401  (registers the "collectives" backend)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=30, help="training steps per backend")
parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timings")
parser.add_argument("--batch", type=int, default=128, help="samples per rank per step")
parser.add_argument("--tables", type=int, default=8, help="embedding tables (a multiple of 4: one quarter per sharding type)")
parser.add_argument("--rows", type=int, default=4000, help="rows per table")
parser.add_argument("--dim", type=int, default=16, help="embedding dimension (a multiple of 4)")
parser.add_argument("--dense", type=int, default=13, help="dense features per sample")
parser.add_argument("--backends", default="gloo,collectives", help="comma-separated; the losses of all are compared")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--json", metavar="FILE", help="write the losses and step times here (rank 0)")
args = parser.parse_args()
backends = args.backends.split(",")
if args.tables % 4 or args.dim % 4 or args.warmup >= args.steps:
    parser.error("--tables and --dim must be multiples of 4, and --warmup less than --steps")

torch.set_num_threads(1)  # ranks share the cores
# The default group only sets up and checks; each model gets a group of its own.
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
groups = {name: dist.new_group(backend=name) for name in backends}

SHARDING = [ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE, ShardingType.DATA_PARALLEL]
tables = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
    for i in range(args.tables)
]
features = [f"f{i}" for i in range(args.tables)]
sharding_of = {t.name: SHARDING[i * 4 // args.tables] for i, t in enumerate(tables)}


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
            if hasattr(t, "local_shards"):  # ShardedTensor: table-, column-wise
                for shard in t.local_shards():
                    (r, c), (h, w) = shard.metadata.shard_offsets, shard.tensor.shape
                    shard.tensor.copy_(full[r : r + h, c : c + w])
            else:
                t.copy_(full)


def sharded(group) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    env = ShardingEnv.from_process_group(group)
    # Row-wise Adagrad, applied by the embedding kernels in the backward
    # (TorchRec's "fused" optimizer): the sharded tables' gradients are never
    # materialized.
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": args.lr, "eps": 1e-8}
    )
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
    )
    module = dlrm("meta")  # DMP materializes only this rank's shards
    plan = planner.collective_plan(module, [sharder], group)  # rank 0 plans, broadcast on `group`
    model = DistributedModelParallel(module, env=env, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    load(model)
    # The rest (dense layers, data-parallel tables), gradients all-reduced by DDP.
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=args.lr, eps=1e-8),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense]), plan


def batch(step: int):
    """This rank's batch at `step`: seeded by both, so every run sees it."""
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
    first = ids[: int(lengths[:b].sum())]
    bag = torch.repeat_interleave(torch.arange(b), lengths[:b])
    hot = torch.zeros(b).index_add_(0, bag, (first < args.rows // 10).float())
    logit = dense[:, 0] - dense[:, 1] + hot - 1
    label = (torch.rand(b, generator=g) < torch.sigmoid(2 * logit)).float()
    return dense, sparse, label


data = [batch(s) for s in range(args.steps)]
runs = {}
for name, group in groups.items():
    model, opt, plan = sharded(group)
    runs[name] = {"model": model, "opt": opt, "loss": [], "time": []}
if rank == 0:
    print(plan)

for step in range(args.steps):
    dense, sparse, label = data[step]
    for name, run in runs.items():
        dist.barrier(group=groups[name])
        t0 = time.perf_counter()
        logits = run["model"](dense, sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label)
        run["opt"].zero_grad()
        loss.backward()
        run["opt"].step()
        run["time"].append(time.perf_counter() - t0)
        run["loss"].append(loss.item())

# Every rank's losses, to rank 0 (on the default group).
losses = {}
for name, run in runs.items():
    mine = torch.tensor(run["loss"], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    losses[name] = torch.stack(every)  # ranks x steps
times = {name: statistics.median(run["time"][args.warmup :]) * 1e3 for name, run in runs.items()}

ok = True
if rank == 0:
    first = backends[0]
    print(f"# DLRM, {n} ranks, {args.tables} tables {args.rows} x {args.dim}, batch {args.batch}/rank, {args.steps} steps")
    print("# sharding: " + ", ".join(f"{t}: {st.value}" for t, st in sharding_of.items()))
    print("# step  " + "  ".join(f"{k + ' loss':>18}" for k in backends) + "   (mean over ranks)")
    for s in range(args.steps):
        print(f"  {s:4d}  " + "  ".join(f"{losses[k][:, s].mean().item():18.6f}" for k in backends))
    for k in backends[1:]:
        diff = (losses[k] - losses[first]).abs().max().item()
        same = torch.allclose(losses[k], losses[first], rtol=1e-5, atol=1e-6)
        print(f"# {k} against {first}: largest loss difference {diff:.2e} (any rank, any step): {'same' if same else 'DIFFERENT'}")
        ok &= same
    print(f"# median step time, steps {args.warmup}..{args.steps - 1}:")
    for k in backends:
        print(f"#   {k:12s} {times[k]:8.2f} ms")
    if "gloo" in times and "collectives" in times:
        print(f"# collectives / gloo: {times['collectives'] / times['gloo']:.2f}")
    print("dlrm ok" if ok else "dlrm FAILED", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ranks": n,
                    "args": vars(args),
                    "sharding": {t: st.value for t, st in sharding_of.items()},
                    "median_step_ms": times,
                    "losses": {k: v.tolist() for k, v in losses.items()},
                    "ok": ok,
                },
                f,
                indent=1,
            )
verdict = torch.tensor([int(ok)])
dist.broadcast(verdict, 0)
runs.clear()
for group in groups.values():
    dist.destroy_process_group(group)
    dist.barrier()
dist.destroy_process_group()
sys.exit(0 if verdict.item() else 1)
