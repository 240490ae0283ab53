"""One member of a process group, run inside a network namespace by the cross-host tests.

    python tests/integration/cross_host_member.py weight|learner RANK WORLD MASTER PORT \
        [--join-timeout S] [--no-local-ip]

``weight``: a :class:`actors.weight_group.WeightGroup` member (rank 0 sends a small state
dict, the others receive and check it). ``learner``: :func:`learner.distributed.init_rank_distributed`
then an all-reduce of ``rank + 1``. Prints ``OK <detail>`` on success; on a join failure
prints ``JOIN-ERROR <seconds> <message>`` and exits 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from actors.rendezvous import GroupJoinError

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}


def weight_member(rank: int, world: int, master: str, port: int, join_timeout: float) -> str:
    from actors.rendezvous import bind_master_store
    from actors.weight_group import WeightGroup, tensor_metas

    store = None
    if rank == 0:
        store = bind_master_store()
        port = store.port
        print(f"PORT {port}", flush=True)
    group = WeightGroup(master, port, rank, world, "gloo", 30.0, store, join_timeout)
    metas = tensor_metas(STATE)
    if rank == 0:
        sent = group.send(STATE, metas, 7)
        group.barrier()  # the others have received before rank 0 leaves
        group.close()
        return f"sent {sent} bytes"
    version, tensors = group.receive(metas)
    got = dict(tensors)
    group.barrier()
    group.close()
    assert version == 7, version
    assert all(torch.equal(got[k], v) for k, v in STATE.items())
    return f"received version {version}"


def learner_member(rank: int, world: int, master: str, port: int, join_timeout: float) -> str:
    import torch.distributed as dist

    from learner.distributed import init_rank_distributed

    info = init_rank_distributed(rank, world, master, port, "gloo", 30.0, join_timeout)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    assert value.item() == expected, value
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads alive at exit abort the process
    return f"rank {info.rank}/{info.world_size} all-reduce {value.item():g}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("group", choices=["weight", "learner"])
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("master")
    parser.add_argument("port", type=int)
    parser.add_argument("--join-timeout", type=float, default=20.0)
    args = parser.parse_args()
    member = weight_member if args.group == "weight" else learner_member
    started = time.monotonic()
    try:
        detail = member(args.rank, args.world, args.master, args.port, args.join_timeout)
    except GroupJoinError as e:
        print(f"JOIN-ERROR {time.monotonic() - started:.1f} {e}", flush=True)
        return 3
    print(f"OK {detail}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: a failed group's threads would abort it
