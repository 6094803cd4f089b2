"""A toy spool layout, for the seam's test only (``tests/unit/connector/test_toy_layout.py``):
each sample is one file of ``torch.save``'s pickle format (not safetensors), in the spool under
the spool's naming rule (``hs-…``, what the sidecar and the trainer may delete), told apart from
a ``files`` sample by its name's ``hs-toy-`` prefix (its placement). Registered with one line:

    L.register("toy", L.Layout("tests.support.toy_layout", "ToySidecar", "ToyWriter", "ToyReader"))
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from connector import layouts as L
from connector.contract import messages as M
from connector.contract import sample_file as SF
from connector.contract import spool as SP

PREFIX = SP.FILE_PREFIX + "toy-"


def _is_toy(file: str | None) -> bool:
    return isinstance(file, str) and file.startswith(PREFIX)


class ToySidecar(L.SidecarHalf):
    """Nothing to reserve: the writer names the file; its bytes are the file's size."""

    name = "toy"


class ToyWriter(L.WriterHalf):
    name = "toy"
    written = 0  # samples this layout wrote (the test checks the toy, not files, carried it)

    @staticmethod
    def claims(tag: M.RequestTag | None, file: str | None) -> bool:
        return _is_toy(file)

    def write(self, writer: Any, job: Any) -> M.Notice:
        if job.ready is not None:
            job.ready()
        ids = torch.tensor(job.token_ids, dtype=torch.int64)
        tensors = {SF.HIDDEN_STATES_KEY: job.hidden_states.contiguous(), SF.TOKEN_IDS_KEY: ids}
        digest, finite = SF.checksum_and_finite(tensors, algo=writer.checksum_algo, threads=writer.checksum_threads)
        notice = writer.notice(job.request_id, job.tag, status=M.NoticeStatus.ok, file=job.file,
                               num_tokens=int(ids.shape[0]), nbytes=job.hidden_states.numel() * job.hidden_states.element_size(),
                               checksum=digest, checksum_algo=writer.checksum_algo, finite=finite)  # fmt: skip
        tmp = self.spool / SP.tmp_name_for(job.file)
        buf = io.BytesIO()
        torch.save(tensors, buf)
        tmp.write_bytes(buf.getvalue())
        os.chmod(tmp, SP.FILE_MODE)
        os.rename(tmp, self.spool / job.file)  # complete before the notice, as every layout
        type(self).written += 1
        return notice


class ToyReader(L.ReaderHalf):
    name = "toy"
    opened = 0

    @staticmethod
    def claims(n: M.Notice) -> bool:
        return _is_toy(n.file)

    def open(self, n: M.Notice, *, pin_memory: bool, alloc: Any, device: Any, timings: dict[str, float],
             on_header: Any, on_release: Any) -> dict[str, torch.Tensor]:  # fmt: skip
        assert self.spool is not None
        raw = SP.resolve_in_spool(self.spool, n.file).read_bytes()
        tensors = torch.load(io.BytesIO(raw), weights_only=True)
        if on_header is not None:
            on_header(tensors, None)  # the header's checks, as a file's reader makes them
        type(self).opened += 1
        return tensors
