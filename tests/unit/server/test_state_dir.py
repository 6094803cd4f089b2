"""The ledger is durable by default: it lives in the user's state directory ($XDG_STATE_HOME/
hsstream, else ~/.local/state/hsstream), which survives logout and reboot, while the sockets stay
in the runtime directory ($XDG_RUNTIME_DIR, else /tmp), which need not. A stack given a run dir
of its own (a second stack, a test) keeps its ledger there; HSSTREAM_STATE_DIR and
HSSTREAM_LEDGER_PATH say where outright."""

from __future__ import annotations

import os
import stat

import pytest

from connector.contract.settings import Settings
from server.ledger import Ledger


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for k in [k for k in os.environ if k.startswith("HSSTREAM_")] + ["XDG_STATE_HOME", "XDG_RUNTIME_DIR"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_default_ledger_is_in_the_state_dir_and_the_sockets_in_the_runtime_dir(clean_env, tmp_path):
    s = Settings()
    assert s.ledger_file() == tmp_path / "home" / ".local" / "state" / "hsstream" / "ledger.sqlite"
    assert s.notice_ep() == f"ipc:///tmp/hsstream-{os.getuid()}/notice.sock"
    clean_env.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    clean_env.setenv("XDG_RUNTIME_DIR", str(tmp_path / "rt"))
    s = Settings()
    assert s.ledger_file() == tmp_path / "state" / "hsstream" / "ledger.sqlite"
    assert s.delivery_ep() == f"ipc://{tmp_path}/rt/hsstream-{os.getuid()}/delivery.sock"


def test_explicit_places_win(clean_env, tmp_path):
    clean_env.setenv("HSSTREAM_RUN_DIR", str(tmp_path / "run"))
    assert Settings().ledger_file() == tmp_path / "run" / "ledger.sqlite"  # a stack of its own, as before
    clean_env.setenv("HSSTREAM_STATE_DIR", str(tmp_path / "st"))
    assert Settings().ledger_file() == tmp_path / "st" / "ledger.sqlite"
    clean_env.setenv("HSSTREAM_LEDGER_PATH", str(tmp_path / "l.sqlite"))
    assert Settings().ledger_file() == tmp_path / "l.sqlite"


def test_the_ledger_makes_its_private_directory(tmp_path):
    path = tmp_path / "state" / "hsstream" / "ledger.sqlite"
    Ledger(path).close()
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_up_hands_its_children_the_ledger_it_chose(clean_env, tmp_path, tiny_model):
    """`up` passes the run dir to its children; the ledger must not follow it into the runtime dir."""
    from hsstream.up import build_config

    clean_env.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cfg = build_config(model=tiny_model)
    assert cfg.env["HSSTREAM_LEDGER_PATH"] == str(tmp_path / "state" / "hsstream" / "ledger.sqlite")
    assert Settings(**{k[9:].lower(): v for k, v in cfg.env.items() if k.startswith("HSSTREAM_")}).ledger_file() \
        == tmp_path / "state" / "hsstream" / "ledger.sqlite"
