"""Elastic data-parallel training of an MLP on scikit-learn's bundled digits data set.

Run it alone (one process) or under ``torchrun --nproc_per_node=N`` (DDP: gloo
on CPU, NCCL on GPU). It is written for stop-and-restart resizing:

* the global batch is fixed and split over the workers, and the batch of step
  ``s`` is drawn from a seed and ``s``, so the run does the same work whatever
  the number of workers and however often it is restarted;
* rank 0 checkpoints every ``--checkpoint-every`` steps and on SIGTERM (all
  ranks agree on the stop step with an all-reduce) to ``$ELASTIC_CHECKPOINT_DIR``;
* on start it resumes from the latest checkpoint;
* rank 0 prints JSON progress lines ``{"step": ..., "loss": ..., "world_size": ...}``
  and at the end ``{"final": true, "accuracy": ...}`` (held-out test accuracy).

Exit codes: 0 when all steps are done, 143 when stopped by SIGTERM (after checkpointing).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

EXIT_STOPPED = 143


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total-steps", type=int, default=600)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="stand in for a larger model: one step of the global batch on one GPU takes at "
                        "least this many milliseconds; each of N workers pads its step to 1/N of it "
                        "(sleeping, so it costs no CPU)")
    p.add_argument("--checkpoint-dir", default=os.environ.get("ELASTIC_CHECKPOINT_DIR", "checkpoints"))
    args = p.parse_args(argv)
    if args.total_steps < 1 or args.global_batch < 1 or args.checkpoint_every < 1:
        p.error("--total-steps, --global-batch and --checkpoint-every must be >= 1")
    if args.step_ms < 0:
        p.error("--step-ms must be >= 0")
    return args


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )


def save_checkpoint(path: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Write ``{step, model, optim}`` atomically to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optim": optim.state_dict()}, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")

    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("requested", True))

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.2, random_state=args.seed, stratify=y
    )
    x_train = torch.tensor(x_train, dtype=torch.float32, device=device)
    y_train = torch.tensor(y_train, dtype=torch.long, device=device)

    torch.manual_seed(args.seed)
    model = build_model(args.hidden).to(device)
    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpt = Path(args.checkpoint_dir) / "latest.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        step = int(state["step"])
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    if rank == 0:
        print(json.dumps({"event": "start", "step": step, "world_size": world,
                          "resumed": ckpt.exists(), "device": str(device)}), flush=True)

    loss_fn = nn.CrossEntropyLoss()
    shard = max(1, args.global_batch // world)
    flag = torch.zeros(1, device=device)
    t_last, s_last = time.monotonic(), step
    loss = torch.tensor(0.0)
    while step < args.total_steps:
        if world > 1:  # agree on stopping at the same step
            flag.fill_(1.0 if stop["requested"] else 0.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stopping = bool(flag.item())
        else:
            stopping = stop["requested"]
        if stopping:
            if rank == 0:
                save_checkpoint(ckpt, step, model, optim)
                print(json.dumps({"event": "stopped", "step": step}), flush=True)
            if world > 1:
                dist.destroy_process_group()
            return EXIT_STOPPED
        t_step = time.monotonic()
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        idx = torch.randint(0, len(x_train), (args.global_batch,), generator=g)
        mine = idx[rank * shard:(rank + 1) * shard].to(device)
        optim.zero_grad()
        loss = loss_fn(ddp(x_train[mine]), y_train[mine])
        loss.backward()
        optim.step()
        if args.step_ms:  # this worker's share of the global batch's simulated compute time
            time.sleep(max(0.0, args.step_ms / 1000 * shard / args.global_batch - (time.monotonic() - t_step)))
        step += 1
        if rank == 0 and step % args.checkpoint_every == 0:
            save_checkpoint(ckpt, step, model, optim)
        if rank == 0 and (step % args.log_every == 0 or step == args.total_steps):
            now = time.monotonic()
            rate = (step - s_last) / (now - t_last) if now > t_last else 0.0
            t_last, s_last = now, step
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "world_size": world,
                              "steps_per_s": round(rate, 2)}), flush=True)

    if rank == 0:
        save_checkpoint(ckpt, step, model, optim)
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor(x_test, dtype=torch.float32, device=device))
            acc = (logits.argmax(1).cpu() == torch.tensor(y_test)).float().mean().item()
        print(json.dumps({"final": True, "step": step, "accuracy": round(acc, 4),
                          "loss": round(loss.item(), 4), "world_size": world}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
