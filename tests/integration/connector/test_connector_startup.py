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


def test_a_spool_that_is_a_symlink_not_ours_or_writable_by_others_is_refused(tmp_path, monkeypatch):
    """The spool holds users' prompts as token ids: a symlink planted where it should be (in the
    world-writable /dev/shm) would send them elsewhere, and another user's or a group-writable
    directory lets others swap a file between its rename and its notice."""
    import os

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    plugin.check_spool(str(real))  # a private directory of ours: fine
    plugin.check_spool(str(real) + "/")
    link = tmp_path / "link"
    link.symlink_to(real)
    for p in (str(link), str(link) + "/"):
        with pytest.raises(plugin.ConnectorConfigError, match="is a symlink"):
            plugin.check_spool(p)
    for mode in (0o770, 0o702, 0o777, 0o1777):
        os.chmod(real, mode)
        want = rf"writable by other users \(mode {oct(mode)}\).*chmod 700"
        with pytest.raises(plugin.ConnectorConfigError, match=want):
            plugin.check_spool(str(real))
    os.chmod(real, 0o750)  # readable by the group (a trainer's group, say): fine
    plugin.check_spool(str(real))
    uid = os.geteuid()
    monkeypatch.setattr(plugin.os, "geteuid", lambda: uid + 1)  # as if another user made it
    with pytest.raises(plugin.ConnectorConfigError, match=rf"belongs to uid {uid}, not to this process"):
        plugin.check_spool(str(real))


def test_unknown_extra_config_keys_are_named_in_a_warning(tmp_path, caplog):
    extra = {"shared_storage_path": str(tmp_path), "notice_endpoint": "none", "num_writer_thread": 2, "use_lock": True}
    with caplog.at_level("WARNING", logger="hsstream.connector"):
        o = plugin.ConnectorOptions.from_vllm(vllm_config([2, 5], extra))
    (rec,) = [r for r in caplog.records if "unknown key" in r.getMessage()]
    assert "['num_writer_thread', 'use_lock']" in rec.getMessage()
    assert o.notice_ep is None  # "none": no sidecar, no notices queued for nobody
    caplog.clear()
    with caplog.at_level("WARNING", logger="hsstream.connector"):
        plugin.ConnectorOptions.from_vllm(vllm_config([2, 5], {"shared_storage_path": str(tmp_path), "allow_custom_save_path": False, "use_synchronization_lock": True, "layer_order": "sorted"}))
    assert not [r for r in caplog.records if "unknown key" in r.getMessage()]


def test_layer_order_option(tmp_path):
    base = {"shared_storage_path": str(tmp_path), "notice_endpoint": "ipc:///tmp/x", "layer_ids": [10, 2, 5]}
    o = plugin.ConnectorOptions.from_vllm(vllm_config([2, 5, 10], base))
    assert o.layer_order == "config" and o.file_layer_ids == [10, 2, 5]
    o = plugin.ConnectorOptions.from_vllm(vllm_config([2, 5, 10], {**base, "layer_order": "sorted"}))
    assert o.file_layer_ids == [2, 5, 10]  # the Example connector's order
    with pytest.raises(plugin.ConnectorConfigError, match="layer_order 'ascending'"):
        plugin.ConnectorOptions.from_vllm(vllm_config([2, 5, 10], {**base, "layer_order": "ascending"}))


def test_lock_and_custom_path_flags(tmp_path):
    base = {"shared_storage_path": str(tmp_path), "notice_endpoint": "ipc:///tmp/x"}
    o = plugin.ConnectorOptions.from_vllm(vllm_config([2], base))
    assert (o.allow_custom_save_path, o.use_lock) == (False, True)  # the Example connector's defaults
    o = plugin.ConnectorOptions.from_vllm(vllm_config([2], {**base, "allow_custom_save_path": True, "use_synchronization_lock": "false"}))
    assert (o.allow_custom_save_path, o.use_lock) == (True, False)
    with pytest.raises(plugin.ConnectorConfigError, match="allow_custom_save_path must be true or false"):
        plugin.ConnectorOptions.from_vllm(vllm_config([2], {**base, "allow_custom_save_path": "yes please"}))


def test_switch_interval_from_the_environment(tmp_path, monkeypatch):
    """What vLLM's worker lowers Python's switch interval to (rank 0, beside the writers)."""
    base = {"shared_storage_path": str(tmp_path)}
    assert plugin.ConnectorOptions.from_vllm(vllm_config([2], base)).switch_interval_ms == 1.0
    monkeypatch.setenv("HSSTREAM_SWITCH_INTERVAL_MS", "0")
    assert plugin.ConnectorOptions.from_vllm(vllm_config([2], base)).switch_interval_ms == 0.0


def test_checksum_kind_and_threads_from_the_environment_or_the_extra_config(tmp_path, monkeypatch, caplog):
    """xxh3-128 on one thread unless told (sample_file.CONNECTOR_CHECKSUM_ALGO says why);
    ``checksum`` and ``checksum_threads`` in the extra config are known keys."""
    for k in ("HSSTREAM_CHECKSUM", "HSSTREAM_CHECKSUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    base = {"shared_storage_path": str(tmp_path)}
    o = plugin.ConnectorOptions.from_vllm(vllm_config([2], base))
    assert (o.checksum_algo, o.checksum_threads) == ("xxh3-128", 1)
    monkeypatch.setenv("HSSTREAM_CHECKSUM", "blake3")
    monkeypatch.setenv("HSSTREAM_CHECKSUM_THREADS", "0")
    o = plugin.ConnectorOptions.from_vllm(vllm_config([2], base))
    assert (o.checksum_algo, o.checksum_threads) == ("blake3", 0)
    with caplog.at_level("WARNING", logger="hsstream.connector"):
        o = plugin.ConnectorOptions.from_vllm(vllm_config([2], {**base, "checksum": "xxh3-128", "checksum_threads": 4}))
    assert (o.checksum_algo, o.checksum_threads) == ("xxh3-128", 4)
    assert not [r for r in caplog.records if "unknown key" in r.getMessage()]
    for bad in (-1, "2", True):
        with pytest.raises(plugin.ConnectorConfigError, match="checksum_threads must be an integer >= 0"):
            plugin.ConnectorOptions.from_vllm(vllm_config([2], {**base, "checksum_threads": bad}))
