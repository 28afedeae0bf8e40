"""Data-parallel training that survives the loss of a rank: the survivors
agree on who failed, shrink the process group with torch's own
``dist.shrink_group``, re-shard the data among themselves and finish.

    python python/examples/elastic_train.py --launch 4          # 4 ranks, one killed
    python python/examples/elastic_train.py --launch 4 --seed 7 --victims 2

torchrun's agent tears the whole group down when one worker dies, so
``--launch N`` is a small launcher that does not: it hosts the torch store
itself (so any rank may die, rank 0 included), starts N copies of this
script with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, and TORCHELASTIC_USE_AGENT_STORE so no rank serves the store),
and waits for them. Any launcher that leaves the survivors running and
serves the store outside the ranks works the same way.

Each step every rank computes gradients on its shard of the global batch
and all-reduces them (averaged). One rank (or ``--victims``) SIGKILLs itself
at a random step (``--seed``). The survivors' all_reduce raises; they ask the
backend for the failed ranks (the same list on every survivor), call
``dist.shrink_group``, take the weights and the step from the new rank 0
(a survivor may have applied the failed step and another not), and go on
with the global batch split among fewer ranks. At the end every survivor
checks that its weights equal everyone's, and rank 0 prints the loss per
epoch and the time the failure cost.
"""

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--launch", type=int, metavar="N", help="start N ranks (the launcher role)")
parser.add_argument("--seed", type=int, default=1, help="picks the victims and their steps")
parser.add_argument("--victims", type=int, default=1, help="ranks that kill themselves")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps", type=int, default=25, help="steps per epoch")
parser.add_argument("--batch", type=int, default=256, help="global batch (split among the ranks)")
args = parser.parse_args()


def say(line: str) -> None:
    """One write per line: the ranks share the launcher's output."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def launch(n: int) -> int:
    from torch.distributed import TCPStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (serves while we run)
    rng = random.Random(args.seed)
    total = args.epochs * args.steps
    victims = {r: rng.randrange(2, total - 2) for r in rng.sample(range(n), args.victims)}
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "ELASTIC_DIE_AT": str(victims.get(rank, -1))}
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--launch", "0"], env=env))
    codes = [p.wait() for p in procs]
    died = [r for r, c in enumerate(codes) if c == -signal.SIGKILL]
    failed = [r for r, c in enumerate(codes) if c not in (0, -signal.SIGKILL)]
    say(f"launcher: rank(s) {died} were killed (planned: {sorted(victims)}); "
        f"{n - len(died)} survivors exited {'with errors: ' + str(failed) if failed else 'cleanly'}")
    return 1 if failed or sorted(died) != sorted(victims) else 0


def train() -> int:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import collectives.torch  # noqa: F401  (registers the "collectives" backend)

    torch.set_num_threads(1)
    dist.init_process_group("collectives")
    first_rank = dist.get_rank()
    die_at = int(os.environ.get("ELASTIC_DIE_AT", "-1"))

    torch.manual_seed(0)  # the same data and initial weights everywhere
    samples = args.batch * args.steps
    x = torch.randn(samples, 32)
    y = (x[:, :8].sum(1) > 0).long() + (x[:, 8:16].sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3))
    loss_fn = nn.CrossEntropyLoss()
    params = list(model.parameters())

    def shard(step: int):
        """This rank's part of step `step`'s global batch, among today's ranks."""
        rank, n = dist.get_rank(), dist.get_world_size()
        at = (step % args.steps) * args.batch
        lo, hi = at + args.batch * rank // n, at + args.batch * (rank + 1) // n
        return x[lo:hi], y[lo:hi]

    step, total, lost, losses = 0, args.epochs * args.steps, [], {}
    while step < total:
        xs, ys = shard(step)
        loss = loss_fn(model(xs), ys)
        model.zero_grad()
        loss.backward()
        if step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        try:
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        except Exception as e:  # a peer died: agree, shrink, resync, go on
            started = time.perf_counter()
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
            failed = backend.failed_ranks()
            dist.shrink_group(failed)
            for p in params:  # the new rank 0's weights and step for everyone
                dist.broadcast(p.data, src=0)
            at = torch.tensor([step])
            dist.broadcast(at, src=0)
            step = int(at)
            lost.append(time.perf_counter() - started)
            why = (str(e).splitlines() or [""])[0][:160]
            say(f"rank {first_rank}: {type(e).__name__} ({why}); ranks {failed} of the group failed; shrunk to "
                f"{dist.get_world_size()} ranks in {lost[-1] * 1e3:.0f} ms, resuming at step {step}")
            continue
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= 0.1 * flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        losses.setdefault(step // args.steps, []).append(loss.item())
        step += 1

    # The same weights on every survivor, to the bit.
    mine = torch.cat([p.data.reshape(-1) for p in params])
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    same = bool(torch.equal(low, high))
    if dist.get_rank() == 0:
        curve = ", ".join(f"{sum(v) / len(v):.3f}" for _, v in sorted(losses.items()))
        say(f"loss per epoch: {curve}")
        say(f"{dist.get_world_size()} survivors; time lost to the failure(s): "
            f"{', '.join(f'{t * 1e3:.0f} ms' for t in lost) or 'none'}")
    say(f"rank {first_rank}: weights {'equal on every survivor' if same else 'DIFFER'}")
    say(f"ok {first_rank}" if same else f"failed {first_rank}")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(launch(args.launch) if args.launch else train())
