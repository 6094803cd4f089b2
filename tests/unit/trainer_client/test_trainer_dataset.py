"""The dataset wrapper's process rules, without a sidecar (the real stack: test_trainer_e2e.py)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer_client.dataset import HiddenStateDataset, stop_together


def test_dataset_pickles_as_settings_only():
    ds = HiddenStateDataset("ipc:///nonexistent/delivery.sock", jobs=["j"], spool_dir="/dev/shm/none")
    ds.stream = object()  # as if a stream were open in this process
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.stream is None and copy.endpoint == ds.endpoint and copy.jobs == ["j"]


def test_manual_ack_refused_in_workers():
    ds = HiddenStateDataset("ipc:///nonexistent/delivery.sock", ack="manual")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)
    with pytest.raises(ValueError, match="num_workers=0"):
        next(iter(loader))


def test_stop_together_is_a_pass_through_without_distributed():
    assert list(stop_together(iter([1, 2, 3]))) == [1, 2, 3]


_RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    from trainer_client.dataset import stop_together
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = [3, 7][rank]  # rank 1 has more data than rank 0
    got = list(stop_together(iter(range(n)), poll_s=5.0))
    dist.barrier()  # a rank still inside a collective would hang here
    print(json.dumps({"rank": rank, "got": got}))
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_with_uneven_data_stop_at_the_same_step(tmp_path):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT], env=env, stdout=subprocess.PIPE, text=True))
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    by_rank = {o["rank"]: o["got"] for o in outs}
    assert by_rank[1] == list(range(7))
    assert by_rank[0] == [0, 1, 2] + [None] * 4  # same number of steps, None once dry
