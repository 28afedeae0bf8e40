"""Pipeline parallelism on the collectives backend: one stage per rank,
micro-batches sent forward and gradients sent backward with
dist.batch_isend_irecv (GPipe's schedule: every micro-batch forward, then
every one backward), checked against the same model trained in one process:

    torchrun --nproc-per-node 4 python/examples/pipeline.py

Every rank builds the whole model from one seed and keeps its own stage;
the last rank also trains the whole model alone on the same data and
prints both loss curves, which must agree to float round-off. Exit status 1
if they do not.
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import collectives.torch  # noqa: F401

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
parser.add_argument("--batch", type=int, default=16, help="samples per micro-batch")
parser.add_argument("--width", type=int, default=64)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("collectives")
rank, stages = dist.get_rank(), dist.get_world_size()
first, last = rank == 0, rank == stages - 1
W, B = args.width, args.batch


def model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(stages - 1)] + [nn.Linear(W, 1)]


g = torch.Generator().manual_seed(1)
xs = torch.randn(args.steps, args.micro, B, W, generator=g)
ys = xs.sum(-1, keepdim=True).sin()

stage = model()[rank]
opt = torch.optim.SGD(stage.parameters(), lr=0.05)
losses = []
for step in range(args.steps):
    inputs, outputs = [], []
    for m in range(args.micro):
        x = xs[step, m] if first else torch.empty(B, W)
        if not first:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, rank - 1)]):
                w.wait()
            x.requires_grad_()
        y = stage(x)
        if not last:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, y.detach().contiguous(), rank + 1)]):
                w.wait()
        inputs.append(x)
        outputs.append(y)
    total = 0.0
    for m in reversed(range(args.micro)):
        if last:
            loss = nn.functional.mse_loss(outputs[m], ys[step, m]) / args.micro
            loss.backward()
            total += loss.item()
        else:
            grad = torch.empty(B, W)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, grad, rank + 1)]):
                w.wait()
            outputs[m].backward(grad)
        if not first:
            ops = [dist.P2POp(dist.isend, inputs[m].grad.contiguous(), rank - 1)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
    opt.step()
    opt.zero_grad()
    losses.append(total)

ok = True
if last:
    # The same model, data and micro-batching, trained by one process.
    whole = model()
    params = [p for s in whole for p in s.parameters()]
    ref_opt = torch.optim.SGD(params, lr=0.05)
    reference = []
    for step in range(args.steps):
        total = 0.0
        for m in range(args.micro):
            y = xs[step, m]
            for s in whole:
                y = s(y)
            loss = nn.functional.mse_loss(y, ys[step, m]) / args.micro
            loss.backward()
            total += loss.item()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.append(total)
    print(f"# pipeline of {stages} stages, {args.micro} micro-batches of {B}; loss per step")
    print(f"# {'step':>4} {'pipeline':>12} {'one process':>12}")
    for s, (a, b) in enumerate(zip(losses, reference)):
        print(f"  {s:4d} {a:12.6f} {b:12.6f}")
    worst = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(losses, reference))
    ok = worst < 1e-4
    print(f"# largest relative difference {worst:.2e}")
    print("pipeline ok" if ok else "pipeline FAILED", flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
