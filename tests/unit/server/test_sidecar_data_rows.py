"""Rows as public datasets ship them, through the real sidecar app (issue 24 item 1): ShareGPT
rows with their extra keys, UltraChat's ``prompt`` beside ``messages``, OpenAI content-part
lists, tool calls with ``tools``, ShareGPT's tool speakers, a job's chat_template_kwargs and
its own chat template. Each accepted row's stored ids and mask are checked against the text
spelled out here by hand (not against the code under test); refusals name their reason."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from connector.contract.api_token import read_token
from connector.contract.rest_client import auth_headers
from connector.contract.settings import Settings
from server.app import create_app
from tests.unit.connector.chat_templates import CHATML, QWEN3, make_tokenizer

S, E = "<|im_start|>", "<|im_end|>"


@pytest.fixture
def client(tmp_path, tiny_model):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 model=tiny_model)  # fmt: skip
    app = create_app(s)  # no token set: the sidecar made one in its run dir, which its clients read
    return TestClient(app, raise_server_exceptions=False, headers=auth_headers(read_token(s.run_dir)))  # no lifespan: nothing is sent to vLLM


def tok_of(client):
    return client.app.state.services.tokenizer._tok


def use_template_style(client, tiny_model, style):
    client.app.state.services.tokenizer._tok = make_tokenizer(tiny_model, style)


def submit(client, samples, **options):
    return client.post("/v1/jobs", json={"samples": samples, "options": options})


def stored(client, job_id):
    return list(client.app.state.services.ledger.iter_token_ids(job_id, epoch=0))


def spelled(tok, *pieces):
    """(ids, mask) of a render written out by hand as (text, carries loss) pieces; each piece
    boundary must fall on a token boundary of the whole text's encoding."""

    def enc(t):
        return tok(t, add_special_tokens=False)["input_ids"]

    ids = enc("".join(t for t, _ in pieces))
    mask, text = [], ""
    for t, trained in pieces:
        text += t
        upto = enc(text)
        assert ids[: len(upto)] == upto, f"piece boundary after {text!r} is inside a token"
        mask += [int(trained)] * (len(upto) - len(mask))
    return ids, mask


# ---------------------------------------------------------------- unknown keys: ShareGPT rows


def test_sharegpt_row_with_extra_keys_is_accepted_and_the_keys_named_once(client):
    rows = [{"id": f"sg{k}", "model": "gpt-4", "conversations": [
                {"from": "human", "value": "Hi!", "markdown": None}, {"from": "gpt", "value": "Hello."}]}
            for k in range(3)]  # fmt: skip
    rows[0]["source"] = "sharegpt90k"
    r = submit(client, rows)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["num_samples"] == 3
    assert body["warnings"] == [
        "ignored key 'model' in 3 sample(s): not a sample field (id, prompt, messages, conversations, token_ids, tools)",
        "ignored key 'source' in 1 sample(s): not a sample field (id, prompt, messages, conversations, token_ids, tools)",
    ]
    want = spelled(tok_of(client), (f"{S}user\nHi!{E}\n{S}assistant\n", 0), (f"Hello.{E}", 1), ("\n", 0))
    assert stored(client, body["job_id"]) == [want] * 3


def test_unknown_option_keys_are_still_errors(client):
    r = submit(client, [{"prompt": "a"}], epochz=2)
    assert r.status_code == 422 and "epochz" in r.text and "Extra inputs are not permitted" in r.text


def test_upload_ignores_extra_keys_too(client):
    line = json.dumps({"model": "m", "conversations": [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Yo."}]})
    r = client.post("/v1/jobs/upload", files={"file": ("a.jsonl", (line + "\n").encode())})
    assert r.status_code == 200, r.text
    assert r.json()["warnings"][0].startswith("ignored key 'model' in 1 sample(s)")


def test_a_job_without_extra_keys_has_no_warnings(client):
    r = submit(client, [{"prompt": "plain"}])
    assert r.status_code == 200 and r.json()["warnings"] == []


# ---------------------------------------------------------------- UltraChat rows


ULTRA = {"prompt": "What is two plus two?", "prompt_id": "9f1c",
         "messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
                      {"role": "user", "content": "And three plus three?"}, {"role": "assistant", "content": "Six."}]}  # fmt: skip


def test_ultrachat_row_messages_win_over_the_prompt_that_repeats_them(client):
    r = submit(client, [ULTRA])
    assert r.status_code == 200, r.text
    assert r.json()["warnings"] == [
        "ignored key 'prompt_id' in 1 sample(s): not a sample field (id, prompt, messages, conversations, token_ids, tools)"
    ]
    want = spelled(tok_of(client), (f"{S}user\nWhat is two plus two?{E}\n{S}assistant\n", 0), (f"Four.{E}", 1),
                   (f"\n{S}user\nAnd three plus three?{E}\n{S}assistant\n", 0), (f"Six.{E}", 1), ("\n", 0))  # fmt: skip
    assert stored(client, r.json()["job_id"]) == [want]


def test_a_prompt_that_is_not_the_first_user_turn_is_refused_with_the_reason(client):
    bad = {**ULTRA, "prompt": "Something else entirely"}
    r = submit(client, [ULTRA, bad])
    assert r.status_code == 422
    (s,) = r.json()["detail"]["samples"]
    assert s["index"] == 1 and "the prompt is not the conversation's first user turn" in s["reason"]
    r = submit(client, [ULTRA, bad], on_invalid="skip")
    assert r.status_code == 200 and r.json()["num_samples"] == 1 and r.json()["num_failed_at_submission"] == 1
    r = submit(client, [{"prompt": "a", "token_ids": [1, 2]}])  # a prompt beside token ids is still ambiguous
    assert r.status_code == 422 and "exactly one of prompt, messages, conversations, token_ids" in r.text


# ---------------------------------------------------------------- OpenAI content-part lists

PARTS = [{"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
         {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "input_text", "text": "Part two."}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Done."}, {"type": "output_text", "text": "Really."}]}]  # fmt: skip

#: A template that loops over content parts (as multimodal ones do) and joins them with " | ".
PARTS_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string %}{{- m['content'] }}"
    "{%- else %}{%- for p in m['content'] %}{%- if p['type'] == 'text' %}{{- p['text'] }}{%- endif %}"
    "{%- if not loop.last %}{{- ' | ' }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_content_part_lists_are_joined_with_newlines_for_a_string_template(client, tiny_model):
    use_template_style(client, tiny_model, CHATML)
    r = submit(client, [{"messages": PARTS}])
    assert r.status_code == 200, r.text
    want = spelled(tok_of(client), (f"{S}system\nBe terse.{E}\n{S}user\nPart one.\nPart two.{E}\n{S}assistant\n", 0),
                   (f"Done.\nReally.{E}", 1), ("\n", 0))  # fmt: skip
    assert stored(client, r.json()["job_id"]) == [want]
    # the same text as plain strings gives the same ids and mask
    plain = [{"role": m["role"], "content": "\n".join(p["text"] for p in m["content"])} for m in PARTS]
    r2 = submit(client, [{"messages": plain}])
    assert stored(client, r2.json()["job_id"]) == [want]


def test_content_part_lists_reach_a_template_that_loops_over_parts(client):
    r = submit(client, [{"messages": PARTS}, {"messages": [{"role": "user", "content": "plain"},
                                                            {"role": "assistant", "content": "text"}]}],
               chat_template=PARTS_TEMPLATE, loss_mask="all")  # fmt: skip
    assert r.status_code == 200, r.text
    tok = tok_of(client)
    want = spelled(tok, (f"{S}system\nBe terse.{E}\n{S}user\nPart one. | Part two.{E}\n{S}assistant\nDone. | Really.{E}\n", 1))
    want2 = spelled(tok, (f"{S}user\nplain{E}\n{S}assistant\ntext{E}\n", 1))  # a string becomes one text part
    assert stored(client, r.json()["job_id"]) == [want, want2]


def test_our_content_format_detection_agrees_with_vllms():
    hf = pytest.importorskip("vllm.renderers.hf")
    from connector.contract.sample_tokens import content_format
    from hsstream.tiny_model import CHAT_TEMPLATE
    from tests.unit.connector.chat_templates import STYLES

    templates = [PARTS_TEMPLATE, CHAT_TEMPLATE, TOOLS_TEMPLATE, *(st.render(m) for st in STYLES for m in (False, True)),
                 "{% set lm = messages[1:] %}{% for m in lm %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
                 "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c }}{% endfor %}{% endfor %}"]  # fmt: skip
    assert {content_format(t) for t in templates} == {"string", "openai"}
    for t in templates:
        assert content_format(t) == hf._detect_content_format(t, default="string"), t


def test_non_text_parts_are_refused_per_sample_with_the_reason(client):
    img = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                       {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}  # fmt: skip
    r = submit(client, [{"messages": [img, {"role": "assistant", "content": "A cat."}]}])
    assert r.status_code == 422
    (s,) = r.json()["detail"]["samples"]
    assert "message 0: content part 1 has type 'image_url': only text parts" in s["reason"]


# ---------------------------------------------------------------- tools and tool calls

#: A Hermes/Qwen2.5-style tool template: tools in a system block, calls in <tool_call>, results as
#: a user turn with <tool_response>.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + m['content'] }}"
    "{%- for c in m['tool_calls'] or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' + (c['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip

TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "It is 21 degrees."},
]  # fmt: skip


def tool_chat_expected(tok):
    tools = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in TOOLS)
    return spelled(
        tok,
        (f"{S}system\n# Tools\n<tools>{tools}\n</tools>{E}\n{S}user\nWeather in Paris?{E}\n{S}assistant\n", 0),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' + E, 1),  # trained on
        (f"\n{S}user\n<tool_response>\n" + '{"temp": 21}' + f"\n</tool_response>{E}\n{S}assistant\n", 0),  # not
        (f"It is 21 degrees.{E}", 1),
        ("\n", 0),
    )


@pytest.mark.parametrize("marked", [False, True], ids=["turn-by-turn", "generation-markers"])
def test_tool_call_conversation_with_tools_is_masked_on_the_calls_not_the_results(client, marked):
    template = TOOLS_TEMPLATE
    if marked:  # the same template with {% generation %} around each assistant turn's content and end token
        template = (template.replace("'<|im_start|>assistant\\n' + m['content'] }}",
                                     "'<|im_start|>assistant\\n' }}{% generation %}{{- m['content'] }}")
                            .replace("{%- endfor %}{{- '<|im_end|>\\n' }}",
                                     "{%- endfor %}{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"))  # fmt: skip
        assert "generation" in template
    r = submit(client, [{"id": "t1", "messages": TOOL_CHAT, "tools": TOOLS}], chat_template=template)
    assert r.status_code == 200, r.text
    assert stored(client, r.json()["job_id"]) == [tool_chat_expected(tok_of(client))]


def test_sharegpt_tool_speakers_and_tools_as_json_text(client):
    """LLaMA-Factory / glaive rows: function_call (the call as JSON), observation (its result),
    and tools as a JSON string: the same ids and mask as the OpenAI form."""
    row = {"tools": json.dumps(TOOLS), "system": "ignored here", "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "{\"temp\": 21}"},
        {"from": "gpt", "value": "It is 21 degrees."}]}  # fmt: skip
    r = submit(client, [row], chat_template=TOOLS_TEMPLATE)
    assert r.status_code == 200, r.text
    assert r.json()["warnings"][0].startswith("ignored key 'system' in 1 sample(s)")
    assert stored(client, r.json()["job_id"]) == [tool_chat_expected(tok_of(client))]
    row["conversations"][1]["value"] = "not json"
    r = submit(client, [row], chat_template=TOOLS_TEMPLATE)
    assert r.status_code == 422
    assert "conversations[1] (function_call): its value must be a JSON object" in r.json()["detail"]["samples"][0]["reason"]


def test_bad_tool_calls_and_tools_are_refused_with_the_reason(client):
    call = {**TOOL_CHAT[1], "tool_calls": [{"type": "retrieval", "retrieval": {}}]}
    r = submit(client, [{"messages": [TOOL_CHAT[0], call]}, {"messages": TOOL_CHAT, "tools": "[not json"}],
               chat_template=TOOLS_TEMPLATE)  # fmt: skip
    assert r.status_code == 422
    a, b = r.json()["detail"]["samples"]
    assert "message 1: tool_calls[0] must be" in a["reason"]
    assert b["index"] == 1 and "tools: not a JSON list" in b["reason"]
    r = submit(client, [{"messages": [TOOL_CHAT[0], {**TOOL_CHAT[1], "tool_calls": {"id": "c1"}}]}])
    assert r.status_code == 422 and "message 1: tool_calls must be a list of calls" in r.text
    r = submit(client, [{"prompt": "x", "tools": TOOLS}])
    assert r.status_code == 422 and "tools go with a conversation" in r.text


# ---------------------------------------------------------------- chat_template_kwargs, the job's own template

THINK_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_chat_template_kwargs_reach_the_template(client):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old reply"}]
    tok = tok_of(client)
    for kwargs, tail in [(None, ""), ({"enable_thinking": True}, ""), ({"enable_thinking": False}, "<think>\n\n</think>\n\n")]:
        r = submit(client, [{"messages": msgs}], mode="regenerate", chat_template=THINK_TEMPLATE,
                   chat_template_kwargs=kwargs)  # fmt: skip
        assert r.status_code == 200, r.text
        assert stored(client, r.json()["job_id"]) == [spelled(tok, (f"{S}user\nHi{E}\n{S}assistant\n{tail}", 0))]


def test_template_kwargs_the_sidecar_sets_and_bad_templates_are_422s(client):
    r = submit(client, [{"prompt": "a"}], chat_template_kwargs={"add_generation_prompt": True, "tokenize": True})
    assert r.status_code == 422 and "chat_template_kwargs may not set add_generation_prompt, tokenize" in r.text
    r = submit(client, [{"prompt": "a"}], chat_template="{% for m in messages %}")
    assert r.status_code == 422 and "chat_template is not valid Jinja" in r.text
    r = submit(client, [{"prompt": "a"}], chat_template="x" * 65537)
    assert r.status_code == 422 and "chat_template" in r.text and "65536" in r.text


def test_a_job_template_that_renders_too_long_is_refused_and_not_tried_again(client):
    svc = client.app.state.services
    svc.tokenizer.render_timeout_s = 0.2
    slow = "{%- for a in range(2000) %}{%- for b in range(2000) %}{%- endfor %}{%- endfor %}" + THINK_TEMPLATE
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    r = submit(client, [{"messages": msgs}, {"messages": msgs}], chat_template=slow, on_invalid="reject")
    assert r.status_code == 422
    a, b = r.json()["detail"]["samples"]
    assert "the job's chat_template took longer than 0.2 s to render this sample" in a["reason"]
    assert "took longer than 0.2 s to render an earlier sample" in b["reason"]
    r = submit(client, [{"messages": msgs}], chat_template=THINK_TEMPLATE)  # another template still renders
    assert r.status_code == 200, r.text


#: Qwen3's template as tests/unit/connector/chat_templates.py writes it, with Qwen3's non-thinking switch:
#: ``enable_thinking=False`` prompts with an empty <think></think> block, which earlier turns in
#: the history do not show.
QWEN3_SWITCH = QWEN3.render(False).replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}",
)
TWO_TURNS = [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Yes."}]  # fmt: skip


def test_qwen3_with_thinking_off_masks_every_turn(client, tiny_model):
    """The prompt of the first turn (with the empty think block) is no prefix of the whole
    render; the turn starts where the two part, after the shared header."""
    use_template_style(client, tiny_model, QWEN3)
    assert "enable_thinking" in QWEN3_SWITCH
    tok = tok_of(client)
    head = f"{S}user\nThink first.{E}\n{S}assistant\n"
    mid = f"\n{S}user\nAgain?{E}\n{S}assistant\n"
    for kwargs, want in [
        ({"enable_thinking": False}, spelled(tok, (head, 0), (f"Done.{E}", 1), (mid + "<think>\n\n</think>\n\n", 0),
                                             (f"Yes.{E}", 1), ("\n", 0))),
        (None, spelled(tok, (head, 0), (f"Done.{E}", 1), (mid, 0), (f"<think>\n\n</think>\n\nYes.{E}", 1), ("\n", 0))),
    ]:  # fmt: skip
        r = submit(client, [{"messages": TWO_TURNS}], chat_template=QWEN3_SWITCH, chat_template_kwargs=kwargs)
        assert r.status_code == 200, r.text
        assert stored(client, r.json()["job_id"]) == [want], kwargs
