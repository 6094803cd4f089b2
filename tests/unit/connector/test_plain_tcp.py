"""No unauthenticated TCP: a ``tcp://`` notice or delivery endpoint, or a stream's ``tcp://``
without CURVE keys, refuses to start (sidecar, connector, stream, ``hsstream`` commands), saying
how to make keys, unless ``HSSTREAM_ALLOW_INSECURE_TCP=1``, which logs one WARNING."""

from __future__ import annotations

import logging

import pytest
import zmq

from connector.contract import endpoints as E
from connector import protocol as P
from connector.contract.settings import Settings
from tests.unit.hsstream.test_secure_defaults import _env, _hsstream, free_port
from trainer_client import HiddenStateStream


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(E, "_warned", set())
    for k in ("HSSTREAM_NOTICE_ENDPOINT", "HSSTREAM_DELIVERY_ENDPOINT", E.ALLOW_SWITCH):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("var", ["HSSTREAM_NOTICE_ENDPOINT", "HSSTREAM_DELIVERY_ENDPOINT"])
@pytest.mark.parametrize("ep", ["tcp://127.0.0.1:5599", "tcp://0.0.0.0:5599", "ws://10.0.0.1:80"])
def test_a_plain_network_endpoint_is_refused_with_the_way_out(monkeypatch, var, ep):
    monkeypatch.setenv(var, ep)
    with pytest.raises(E.InsecureEndpoint, match=rf"refusing {var}={ep}: it is plain TCP.*`hsstream keys DIR`"
                                                 rf".*{E.ALLOW_SWITCH}=1"):  # fmt: skip
        Settings()


def test_ipc_and_the_defaults_are_fine(tmp_path):
    s = Settings(notice_endpoint=f"ipc://{tmp_path}/n.sock", run_dir=tmp_path)
    assert s.notice_ep().startswith("ipc://") and Settings().delivery_ep().startswith("ipc://")


def test_the_switch_allows_it_with_one_warning_per_process(monkeypatch, caplog):
    monkeypatch.setenv("HSSTREAM_NOTICE_ENDPOINT", "tcp://127.0.0.1:5599")
    monkeypatch.setenv(E.ALLOW_SWITCH, "1")
    with caplog.at_level(logging.WARNING, logger="hsstream"):
        for _ in range(3):
            assert Settings().notice_ep() == "tcp://127.0.0.1:5599"
    (rec,) = [r for r in caplog.records if "plain TCP" in r.getMessage()]
    assert rec.levelno == logging.WARNING and "HSSTREAM_NOTICE_ENDPOINT=tcp://127.0.0.1:5599" in rec.getMessage()


def test_the_stream_refuses_tcp_without_keys():
    with pytest.raises(E.InsecureEndpoint, match=r"HiddenStateStream endpoint=tcp://127.0.0.1:\d+.*curve_server_key"
                                                 r".*`hsstream keys DIR`"):  # fmt: skip
        HiddenStateStream(f"tcp://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="both"):
        HiddenStateStream(f"tcp://127.0.0.1:{free_port()}", curve_server_key="k")


def test_with_the_switch_the_stream_talks_plain_tcp(monkeypatch, caplog):
    monkeypatch.setenv(E.ALLOW_SWITCH, "1")
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with caplog.at_level(logging.WARNING, logger="hsstream"):
            s = HiddenStateStream(f"tcp://127.0.0.1:{port}", timeout_s=5)
        assert [r for r in caplog.records if "plain TCP" in r.getMessage()]
        assert s.transport == "zmq"  # remote: the bytes come in the message
        s._connect()
        assert sock.poll(5000)
        assert isinstance(P.decode_msg(sock.recv_multipart()[1:]), P.Hello)
        s.close()
    finally:
        sock.close(linger=0)


def test_hsstream_serve_refuses_a_plain_tcp_notice_endpoint(tmp_path):
    env = _env(tmp_path, HSSTREAM_NOTICE_ENDPOINT=f"tcp://127.0.0.1:{free_port()}", HSSTREAM_PORT=str(free_port()))
    p = _hsstream("serve", env=env)
    assert p.returncode == 2, p.stderr
    assert "error: refusing HSSTREAM_NOTICE_ENDPOINT=tcp://127.0.0.1:" in p.stderr and "hsstream keys" in p.stderr
    assert "Traceback" not in p.stderr


def test_the_connector_refuses_a_plain_tcp_notice_endpoint_in_its_extra_config(tmp_path, monkeypatch):
    plugin = pytest.importorskip("connector.vllm_plugin")
    from tests.integration.connector.test_connector_startup import vllm_config

    extra = {"shared_storage_path": str(tmp_path), "notice_endpoint": "tcp://10.0.0.5:5557"}
    with pytest.raises(plugin.ConnectorConfigError, match=r"refusing kv_connector_extra_config.notice_endpoint="
                                                         r"tcp://10.0.0.5:5557.*HSSTREAM_ALLOW_INSECURE_TCP"):  # fmt: skip
        plugin.ConnectorOptions.from_vllm(vllm_config([2], extra))
    monkeypatch.setenv(E.ALLOW_SWITCH, "1")
    assert plugin.ConnectorOptions.from_vllm(vllm_config([2], extra)).notice_endpoint == "tcp://10.0.0.5:5557"


@pytest.mark.parametrize("var", ["HSSTREAM_NOTICE_ENDPOINT", "HSSTREAM_DELIVERY_ENDPOINT"])
def test_an_abstract_ipc_socket_is_refused_like_plain_tcp(monkeypatch, var):
    """``ipc://@name`` (a Linux abstract socket) has no file and so no permissions: any local user
    connects to it, as to 127.0.0.1."""
    monkeypatch.setenv(var, "ipc://@hsstream-notices")
    with pytest.raises(E.InsecureEndpoint, match=rf"refusing {var}=ipc://@hsstream-notices: it is a Linux abstract "
                                                 rf"socket.*any local user.*{E.ALLOW_SWITCH}=1"):  # fmt: skip
        Settings()
    with pytest.raises(E.InsecureEndpoint, match="abstract socket"):
        HiddenStateStream("ipc://@hsstream-delivery")
