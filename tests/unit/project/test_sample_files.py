"""The tests' sample-file factory (tests/support/sample_files.py) writes what the stream
accepts, in every payload dtype, and each corruption it offers is one the stream refuses."""

from __future__ import annotations

import pytest
import torch

from connector.contract import payload as PL, sample_file as SF
from trainer_client import stream as S

from tests.support import sample_files


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", PL.FP8_DTYPE])
@pytest.mark.parametrize("algo", SF.CHECKSUM_ALGOS)
def test_a_factory_file_is_accepted_and_its_checksum_is_the_contracts(tmp_path, dtype, algo):
    f = sample_files.write_sample(tmp_path, tokens=5, layer_ids=[1, 3], hidden=8, dtype=dtype, algo=algo)
    assert f.notice.dtype == dtype and f.notice.checksum_algo == algo and f.path.exists()
    tensors = S.read_into_buffer(f.path, None, lambda n: torch.empty(n, dtype=torch.uint8))
    assert f.notice.checksum == SF.sample_checksum(tensors, algo=algo)
    smp = S.load_and_check(tmp_path, f.deliver)
    assert smp.token_ids.tolist() == f.deliver.expected_token_ids and smp.key == f.notice.key


@pytest.mark.parametrize("corrupt, message", [("checksum", "checksum mismatch"), ("nan", "non-finite")])
def test_each_corruption_is_refused_for_its_own_reason(tmp_path, corrupt, message):
    f = sample_files.write_sample(tmp_path, corrupt=corrupt)
    with pytest.raises(S.InvalidSample, match=message):
        S.load_and_check(tmp_path, f.deliver)
    with pytest.raises(ValueError, match="unknown corruption"):
        sample_files.write_sample(tmp_path, corrupt="typo")
