"""One replica group of a DiLoCo check, as a process of its own (``python -m tests.helpers.ft_diloco_worker``): it
opens its group's TCPStore, joins the lighthouse at ``--lighthouse`` through a torchft ``Manager``, trains the tiny
model of tests/helpers/diloco_net.py under ``OuterSync`` and saves its parameters after each inner step, its sync
records and its bytes per step to ``--out`` (torch.save)."""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from ddptrain.config.choices import FtSync
from ddptrain.config.schema import FtConfig
from ddptrain.ft.diloco import OuterSync
from tests.helpers.diloco_net import INNER_LR, fresh_net, inner_step


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--group", "--groups", "--sync-every", "--fragments", "--steps"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--sync", required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    timeout = timedelta(seconds=60)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None, min_replica_size=args.groups,
        use_async_quorum=False, replica_id=f"g{args.group}", lighthouse_addr=args.lighthouse, rank=0, world_size=1,
        store_addr="localhost", store_port=store.port, timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout, init_sync=False,
    )
    model = fresh_net()
    opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    ft = FtConfig(replica_groups=args.groups, sync=FtSync(args.sync), sync_every=args.sync_every,
                  fragments=args.fragments)
    outer = OuterSync.build(manager, model, opt, ft)
    params = []
    with outer:
        for step in range(args.steps):
            inner_step(model, opt, args.group, step)
            params.append([p.detach().clone() for p in model.parameters()])
    torch.save({"params": params, "records": [(r.inner_step, r.fragment, r.committed) for r in outer.records],
                "bytes_per_step": outer.bytes_per_step(), "counters": outer.counters()}, args.out)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
