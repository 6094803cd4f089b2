"""The ``files`` spool layout: one safetensors file per sample, what drop-in clients get.

The sidecar reserves nothing (the connector names the file after vLLM's request id) and counts
a sample's bytes by the file's size. The writer writes under a hidden temporary name and
renames the file into place, so a reader never sees half a file; the notice goes after the
rename. The trainer reads the file from the spool (mapped, or into one pinned buffer) and,
once the sample is checked, deletes it (the stream does, ``transport.spool``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from connector.contract import messages as M
from connector.contract import sample_file as SF
from connector.contract import spool as SP
from connector.layouts import ReaderHalf, SidecarHalf, WriterHalf

if TYPE_CHECKING:
    import torch

log = logging.getLogger("hsstream.connector")


def save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """safetensors' writer, imported at the first write: the sidecar loads this module (its half)
    without torch."""
    from safetensors.torch import save_file as st_save_file

    st_save_file(tensors, path, metadata=metadata)


class FilesSidecar(SidecarHalf):
    name = "files"


class FilesWriter(WriterHalf):
    name = "files"

    def write(self, writer: Any, job: Any) -> M.Notice:
        """The file under its temporary name, then renamed into place (``job.path``: a client's
        own path, ``allow_custom_save_path``). A full filesystem is a "busy" notice (not the
        sample's fault), any other failure an "error" one."""
        import torch

        from connector.spool_writer import spool_full

        w = writer
        dest = job.path or self.spool / job.file
        tmp = dest.parent / SP.tmp_name_for(dest.name)
        t0 = time.perf_counter()
        try:
            if job.ready is not None:
                job.ready()
            t1 = time.perf_counter()
            ids = torch.tensor(job.token_ids, dtype=torch.int64)
            # Encoded on the writer thread, off the engine's step (as hs-connectors quantises on
            # write), unless the gatherer encoded on the device (FP8: half the bytes copied).
            payload = job.encoded if job.encoded is not None else w.encode(job.hidden_states)
            if (rows := payload[SF.HIDDEN_STATES_KEY].shape[0]) != ids.shape[0]:
                raise ValueError(f"{rows} hidden-state rows for {ids.shape[0]} tokens")
            tensors = {**payload, SF.TOKEN_IDS_KEY: ids}
            digest, finite = SF.checksum_and_finite(tensors, algo=w.checksum_algo, threads=w.checksum_threads)
            t2 = time.perf_counter()
            notice = w.notice(
                job.request_id,
                job.tag,
                status=M.NoticeStatus.ok,
                file=job.file if job.path is None else None,  # the sidecar reads the spool only
                num_tokens=int(ids.shape[0]),
                nbytes=sum(t.numel() * t.element_size() for k, t in tensors.items() if k != SF.TOKEN_IDS_KEY),
                checksum=digest,
                checksum_algo=w.checksum_algo,
                finite=finite,
            )
            save_file(
                tensors,
                str(tmp),
                metadata=SF.header_metadata(notice),
            )
            # Token ids are the users' prompts: 0600 before the name is visible. safetensors 0.8
            # writes 0600 itself; older releases (GPU images pin their own) follow the umask.
            w.count_copied(os.stat(tmp).st_size)  # the file's bytes, as safetensors wrote them
            os.chmod(tmp, SP.FILE_MODE)
            os.rename(tmp, dest)
            if job.lock is not None:
                job.lock.release()
            t3 = time.perf_counter()
            timings = {"gather": job.gather_s, "queue": t0 - job.created, "copy_wait": t1 - t0, "checksum": t2 - t1,
                       "write": t3 - t2}
            notice = notice.model_copy(update={"timings": {k: round(v, 6) for k, v in timings.items()}})
        except BaseException as e:  # noqa: BLE001 - every failure must become a notice
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            if spool_full(e):
                # The spool's filesystem is full (other files, pages still mapped by a trainer): not
                # the sample's fault, so "busy", as for a full write queue: produced again with no
                # attempt spent (the sidecar submits nothing more while the filesystem is short).
                w.count_spool_full()
                log.warning("spool full writing %s (%s): refused as busy", job.request_id, e)
                notice = w.notice(job.request_id, job.tag, status=M.NoticeStatus.busy,
                                   reason=f"spool full: {e}")  # fmt: skip
            else:
                log.exception("hidden-state write failed for %s", job.request_id)
                notice = w.notice(job.request_id, job.tag, status=M.NoticeStatus.error,
                                   reason=f"write failed: {e!r}")  # fmt: skip
        finally:
            job.hidden_states = job.encoded = None  # release pinned memory now
            if job.lock is not None:
                job.lock.abandon()  # no-op once released; else no file will come
        return notice


class FilesReader(ReaderHalf):
    name = "files"

    def open(self, n: M.Notice, *, pin_memory: bool, alloc: Callable[[int], torch.Tensor] | None,
             device: Any, timings: dict[str, float], on_header: Callable | None,
             on_release: Callable[[], None] | None) -> dict[str, torch.Tensor]:  # fmt: skip
        from trainer_client.sample_reader import read_sample_file

        if self.spool is None:
            raise SF.InvalidSample("delivery without bytes, and no spool to read from")
        t0 = time.perf_counter()
        tensors = read_sample_file(SP.resolve_in_spool(self.spool, n.file), pin_memory=pin_memory, alloc=alloc,
                                   timings=timings, on_header=on_header)  # fmt: skip
        timings.setdefault("read_s", time.perf_counter() - t0)  # unpinned: safetensors maps the file
        return tensors
