"""More verifier families through vLLM (CPU build) with our connector, checked against HF
transformers: Llama (BOS prepended), Qwen3-MoE and Qwen2 (both ``SupportsEagle3`` in vLLM 0.32),
tiny random-normal checkpoints built offline. Layers in a non-ascending config order, written
in that order (``layer_order: config``); every layer within 5% of its max abs in bf16 and distinct.
"""

from __future__ import annotations

import random

import pytest

from hsstream.tiny_families import FAMILIES, build_family
from tests.conftest import SESSION_ENV, prestarted
from tests.integration.trainer_client.test_dropin_clients import PlainVllm, assert_matches_hf


def _layers(name: str) -> list[int]:
    n = FAMILIES[name]["num_hidden_layers"]
    return [n - 1, 1, n, n // 2]


#: One engine per family, each started while the one before is checked (tests/support/prestart.py).
PRESTART = {name: (lambda name=name: PlainVllm(str(build_family(name)), layer_ids=_layers(name), layer_order="config",
                                               base_env=SESSION_ENV), PlainVllm.stop)
            for name in sorted(FAMILIES)}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    name = request.param
    v = prestarted(__name__, name)
    yield name, v.model, _layers(name), v
    v.stop()


def test_family_matches_hf(family):
    from transformers import AutoTokenizer
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    name, model, layers, v = family
    rng = random.Random(5)
    text = "the model reads a prompt and writes hidden states"
    prompts = [[rng.randrange(0, 509) for _ in range(40)], text]
    for prompt in prompts:
        path = v.complete(prompt)["kv_transfer_params"]["hidden_states_path"]
        try:
            t = load_hidden_states(path)
        finally:
            cleanup_hidden_states(path)
        ids = t["token_ids"].tolist()
        if isinstance(prompt, str):
            want = AutoTokenizer.from_pretrained(model)(prompt).input_ids
            assert ids == want
            if FAMILIES[name].get("bos"):
                assert ids[0] == 509 and ids.count(509) == 1  # BOS once, first
        else:
            assert ids == prompt
        assert_matches_hf(model, ids, t["hidden_states"], layers)
        # the check can fail: the same file against the ascending order does not match
        with pytest.raises(AssertionError):
            assert_matches_hf(model, ids, t["hidden_states"], sorted(layers))
    assert v.spool_files() == []
