"""The connector checks its configuration when vLLM constructs it, before any request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

plugin = pytest.importorskip("connector.vllm_plugin")  # vLLM is installed for this tier


def vllm_config(ids, extra, n=12, method="extract_hidden_states"):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        speculative_config=SimpleNamespace(
            method=method,
            draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=ids)),
        ),
        model_config=SimpleNamespace(
            get_total_num_hidden_layers=lambda: n, get_hidden_size=lambda: 128, dtype="torch.bfloat16",
            served_model_name="m", model="m",
        ),
    )


def test_duplicates_refused_at_connector_start(tmp_path):
    with pytest.raises(ValueError, match=r"duplicate layer id\(s\) \[2\]"):
        plugin.ConnectorOptions.from_vllm(vllm_config([2, 2, 5], {"shared_storage_path": str(tmp_path)}))


def test_out_of_range_refused(tmp_path):
    with pytest.raises(ValueError, match="outside 0..12"):
        plugin.ConnectorOptions.from_vllm(vllm_config([2, 40], {"shared_storage_path": str(tmp_path)}))


def test_wrong_method_refused(tmp_path):
    with pytest.raises(plugin.ConnectorConfigError, match="extract_hidden_states"):
        plugin.ConnectorOptions.from_vllm(vllm_config([2], {}, method="eagle3"))


def test_user_order_taken_from_extra_config(tmp_path):
    o = plugin.ConnectorOptions.from_vllm(
        vllm_config([2, 5, 10], {"layer_ids": [5, 2, 10], "shared_storage_path": str(tmp_path), "notice_endpoint": "ipc:///tmp/x"})
    )
    assert o.user_layer_ids == [5, 2, 10] and o.spool_dir == str(tmp_path) and o.dtype == "bfloat16"
    with pytest.raises(plugin.ConnectorConfigError, match="different layers"):
        plugin.ConnectorOptions.from_vllm(vllm_config([2, 5, 11], {"layer_ids": [5, 2, 10]}))


def test_missing_or_unwritable_spool_refused(tmp_path):
    with pytest.raises(plugin.ConnectorConfigError, match="does not exist"):
        plugin.check_spool(str(tmp_path / "nope"))
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    import os

    if os.geteuid() == 0:  # root writes anywhere; check the message path with a file instead
        f = tmp_path / "file"
        f.write_text("")
        with pytest.raises(plugin.ConnectorConfigError, match="does not exist"):
            plugin.check_spool(str(f))
    else:
        with pytest.raises(plugin.ConnectorConfigError, match="not writable"):
            plugin.check_spool(str(ro))
