import hashlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hsstream.tiny_model import (  # noqa: E402
    BUILD_VERSION,
    MARKER_NAME,
    build_tiny_verifier,
    hf_hidden_states,
)


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_tiny_verifier(tmp_path_factory.mktemp("tiny") / "model")


def test_build_is_deterministic_and_idempotent(built, tmp_path):
    other = build_tiny_verifier(tmp_path / "again")
    a, b = _hashes(built), _hashes(other)
    assert a == b
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", MARKER_NAME} <= set(a)
    assert (built / MARKER_NAME).read_text().strip() == BUILD_VERSION
    # A second call must reuse the finished build, not redo it.
    mtime = (other / MARKER_NAME).stat().st_mtime_ns
    assert build_tiny_verifier(other) == other
    assert (other / MARKER_NAME).stat().st_mtime_ns == mtime
    # No temp folders left behind next to the output.
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["again"]


def test_model_and_tokenizer_load(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers == 12 and cfg.hidden_size == 128
    assert len(tok) <= cfg.vocab_size == 512
    assert cfg.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert cfg.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>") == tok.pad_token_id

    text = "Héllo wörld — 中文, русский, 🚀✅ naïve café\n\tx = y**2  # ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert max(ids) < cfg.vocab_size
    # Special tokens are atomic.
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|im_start|>")]


def test_chat_template_assistant_mask(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🚀"},
        {"role": "assistant", "content": "Hello there!"},
    ]
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🚀<|im_end|>\n<|im_start|>assistant\n"

    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello there!<|im_end|>"


def test_hf_hidden_states_last_layer_is_pre_norm(built):
    from transformers import AutoModelForCausalLM

    ids = list(range(3, 40))
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32, attn_implementation="eager").eval()
    n = model.config.num_hidden_layers

    hooked = []

    def hook(_mod, _args, output):
        hooked.append((output[0] if isinstance(output, tuple) else output).detach())

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    hs = out.hidden_states
    assert len(hs) == n + 1

    ref = hf_hidden_states(built, ids, [0, 5, n])
    assert ref.shape == (len(ids), 3, model.config.hidden_size) and ref.dtype == torch.float32
    torch.testing.assert_close(ref[:, 0], hs[0][0])
    torch.testing.assert_close(ref[:, 1], hs[5][0])
    # HF's hidden_states[-1] is post final-norm; ours must be the raw layer output.
    assert not torch.allclose(ref[:, 2], hs[-1][0], atol=1e-3)
    torch.testing.assert_close(ref[:, 2], hooked[0][0])
    torch.testing.assert_close(model.model.norm(ref[:, 2]), hs[-1][0])

    with pytest.raises(ValueError):
        hf_hidden_states(built, ids, [n + 1])
