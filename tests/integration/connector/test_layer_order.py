"""Layer ids in a non-ascending order come back in the user's order (vLLM stores ascending)."""

from __future__ import annotations

from tests.conftest import SESSION_ENV
from tests.integration.conftest import stack_fixture, start_stack, stop_stack, submit, tiny
from tests.integration.connector.test_e2e_hidden_states import WORKER_PROCESS, assert_close_to_hf
from trainer_client import HiddenStateStream

LAYERS = [5, 2, 10]


def _start():
    return start_stack(tiny(), LAYERS, base_env=SESSION_ENV)


PRESTART = {"stack": (_start, stop_stack)}  # tests/support/prestart.py
stack = stack_fixture(__name__)


def test_user_layer_order_is_kept(stack, tiny_model):
    ids = list(range(40, 140))
    job = submit(stack, [{"token_ids": ids}])
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
        got = list(s)
    assert len(got) == 1 and got[0].layer_ids == LAYERS
    assert_close_to_hf(tiny_model, got[0], LAYERS)
    # and the order really matters: the ascending order would not match
    swapped = got[0].hidden_states[:, [1, 0, 2]].float()
    assert not (swapped - got[0].hidden_states.float()).abs().max().item() == 0
    assert stack.spool_files() == []
    # the tests' default topology (tests/conftest.py): the worker inside the engine-core process
    assert not WORKER_PROCESS.search((stack.workdir / "vllm.log").read_text())
