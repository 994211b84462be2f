#!/usr/bin/env python3
"""Generate tests/fixtures/tokenizer/vllm_cases.json: what vLLM 0.33.0's server renders and
tokenizes for chat and responses requests, computed by vLLM's own preprocessing code.

kv-epp must hash the prompt the engine computes. Beyond transformers (the reference of
scripts/gen_tokenizer_fixtures.py), a vLLM server rewrites requests before rendering: the
`developer` role, tools re-serialised by its pydantic models, `reasoning_effort`, request
fields over `chat_template_kwargs`, kwargs filtered to template variables, its content-part
and tool-call rules. This script runs those functions from the vLLM 0.33.0 wheel (see
scripts/vllm_extract.py: source taken from the wheel at run time, executed, never copied), with
the real transformers tokenizer and templates of the fixtures, and writes what came out.

Run:   .venv/bin/python scripts/gen_vllm_preproc_cases.py          (writes the file)
       .venv/bin/python scripts/gen_vllm_preproc_cases.py --check  (fails if it would change)
Output is deterministic.

The server modelled: `vllm serve` with `--enable-auto-tool-choice --tool-call-parser ...`
(without them vLLM refuses every request with tools and tool_choice "auto"), no
`--default-chat-template-kwargs`, no reasoning-effort map, no `--trust-request-chat-template`,
a text-only model (media parts would get model-specific placeholders; kv-epp ignores them).
The glue between the vLLM functions, which lives in async methods of vLLM's serving classes
that cannot run without an engine, is re-implemented below and cites its source:
`OnlineRenderer.render_chat` / `render_responses` / `preprocess_chat`
(vllm/renderers/online_renderer.py), `HfRenderer.render_messages` (vllm/renderers/hf.py),
`resolve_chat_template` (replaced: the template is the tokenizer's own or the server's
`--chat-template`), the multimodal item tracker (replaced: media ignored, as kv-epp does).
Responses input items are passed as dicts (vLLM validates them into openai's models first;
for the message items used here its code takes the same values either way).

Each case: name, tokenizer ("small-bpe"), template (file under templates/, or "chatml" = the
tokenizer_config's own), endpoint ("chat" | "responses"), request (the body), content_format
(vLLM's detection for the template), date_string (the server's default template kwarg, when
the template reads it), and `vllm`: {"prompt", "ids"} ("prompt" null when vLLM used the
prefill stage's `kv_transfer_params.prompt_token_ids` instead of rendering) or {"error", "stage"}:
  stage "validation": vLLM refuses the request before rendering (400);
  stage "untrusted_template": the request carries a chat template the server does not trust;
  stage "template": the chat template raised while rendering (vLLM answers 400).
Top-level `content_formats`: template sources and vLLM's content format for each
(`_detect_content_format`); kv-epp must route every "openai" one on load.
`kv_epp_gap` (optional): the `reason` label kv-epp reports for a case it does not reproduce
exactly and routes on load instead (see crates/tokenize/src/error.rs `Unrenderable`).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import copy  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from types import SimpleNamespace  # noqa: E402

warnings.filterwarnings("ignore")

import pydantic  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_tokenizer_fixtures as tf  # noqa: E402
from vllm_extract import QuietLogger, VllmSource, class_field_default, extract, find_wheel, literal_args, stub  # noqa: E402

OUT = tf.OUT / "vllm_cases.json"

# Templates written for these cases (original to this project).
DEVELOPER_AWARE = r"""{#- Knows the developer role: vLLM keeps developer messages for it. -#}
{%- for message in messages %}
    {%- if message.role == 'developer' %}
{{- '<|im_start|>developer\n' + message.content + '<|im_end|>\n' }}
    {%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

KWARGS_PROBE = r"""{#- Prints what the template receives, to pin vLLM's argument handling. -#}
{{- '<|im_start|>system\n' }}
{{- 'messages=' + messages | tojson + '\n' }}
{{- 'tools=' + tools | tojson + '\n' }}
{{- 'documents=' + documents | tojson + '\n' }}
{%- for name in ['enable_thinking', 'reasoning_effort', 'custom', 'auto_flag', 'null_flag', 'max_length', 'continue_final_message', 'padding'] %}
{{- name + '=' }}
    {%- if name == 'enable_thinking' and enable_thinking is defined %}{{ enable_thinking | tojson }}
    {%- elif name == 'reasoning_effort' and reasoning_effort is defined %}{{ reasoning_effort | tojson }}
    {%- elif name == 'custom' and custom is defined %}{{ custom | tojson }}
    {%- elif name == 'auto_flag' and auto_flag is defined %}{{ auto_flag | tojson }}
    {%- elif name == 'null_flag' and null_flag is defined %}{{ null_flag | tojson }}
    {%- elif name == 'max_length' and max_length is defined %}{{ max_length | tojson }}
    {%- elif name == 'continue_final_message' and continue_final_message is defined %}{{ continue_final_message | tojson }}
    {%- elif name == 'padding' and padding is defined %}{{ padding | tojson }}
    {%- else %}undefined{% endif %}
{{- '\n' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

OPENAI_CONTENT = r"""{#- Iterates over content parts: vLLM passes content as a list of parts ("openai" format). -#}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.content is string %}
{{- message.content }}
    {%- else %}
        {%- for part in message.content %}
            {%- if part.type == 'text' %}{{ part.text }}{% endif %}
        {%- endfor %}
    {%- endif %}
{{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

TEMPLATES = {
    "developer-aware": DEVELOPER_AWARE,
    "kwargs-probe": KWARGS_PROBE,
    "openai-content": OPENAI_CONTENT,
}


class FakeParser:
    """The multimodal content parser for a text-only routing view: media parts are dropped."""

    def __init__(self):
        self.model_config = SimpleNamespace(enable_prompt_embeds=False)

    def mm_placeholder_storage(self):
        return {}

    def __getattr__(self, name):
        if name.startswith("parse_"):
            return lambda *a, **k: None
        raise AttributeError(name)


class FakeTracker:
    def __init__(self, *a, **k):
        pass

    def create_parser(self, **_):
        return FakeParser()

    def get_num_items(self, _):
        return 0

    def resolve_items(self):
        return None, None


class Vllm:
    """vLLM 0.33.0's chat and responses preprocessing, assembled from the wheel's code."""

    def __init__(self, src: VllmSource):
        log = QuietLogger()
        exc = extract(src, "vllm/exceptions.py", ["VLLMError", "VLLMClientError", "VLLMValidationError",
                                                   "ChatTemplateResolutionError"])
        self.ValidationError = exc["VLLMValidationError"]
        common = {"logger": log, "init_logger": lambda *_: log, "VLLMValidationError": exc["VLLMValidationError"],
                  "ChatTemplateResolutionError": exc["ChatTemplateResolutionError"]}
        params = extract(src, "vllm/renderers/params.py",
                         ["merge_kwargs", "map_reasoning_effort", "recursively_merge_kwargs", "ChatParams"],
                         {**common, "merge_media_io_kwargs": lambda *a, **k: None})
        self.merge_kwargs = params["merge_kwargs"]
        self.efforts = literal_args(src, "vllm/renderers/params.py", "ReasoningEffort")
        self.tok_params_add_special_tokens = class_field_default(
            src, "vllm/renderers/params.py", "TokenizeParams", "add_special_tokens")
        base = extract(src, "vllm/entrypoints/serve/engine/protocol.py", ["_REMOVED_GUIDED_FIELDS", "OpenAIBaseModel"],
                       common)
        gen = extract(src, "vllm/entrypoints/generate/base/protocol.py", ["FunctionDefinition"],
                      {**common, "OpenAIBaseModel": base["OpenAIBaseModel"]})
        chat_env = {**common, "OpenAIBaseModel": base["OpenAIBaseModel"], "FunctionDefinition": gen["FunctionDefinition"],
                    "merge_kwargs": params["merge_kwargs"], "map_reasoning_effort": params["map_reasoning_effort"],
                    "ChatParams": params["ChatParams"]}
        chat = extract(src, "vllm/entrypoints/openai/chat_completion/protocol.py",
                       ["ChatCompletionToolsParam", "ChatCompletionRequest.build_chat_params",
                        "ChatCompletionRequest._normalize_messages_before", "ChatCompletionRequest.check_tool_usage",
                        "ChatCompletionRequest.check_generation_prompt"], chat_env)
        self.chat = chat
        self.chat_defaults = {
            f: _field_default(src, "vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest", f)
            for f in ("add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
                      "chat_template", "chat_template_kwargs", "reasoning_effort", "media_io_kwargs",
                      "response_format", "tool_choice")
        }
        online = extract(src, "vllm/renderers/online_renderer.py", ["OnlineRenderer.validate_chat_template"], common)
        self.validate_chat_template = online["validate_chat_template"]
        func = extract(src, "vllm/utils/func_utils.py", ["_supports_kw", "supports_kw"], common)

        def resolve_chat_template(tokenizer, chat_template, tools, model_config):
            # Re-implemented: the server's --chat-template, else the tokenizer's own.
            return chat_template if chat_template is not None else tokenizer.get_chat_template(None, tools)

        hf = extract(src, "vllm/renderers/hf.py", [
            "_detect_developer_role_support", "_convert_developer_to_system", "_consolidate_system_messages",
            "AssistantTracker", "_resolve_chat_template_kwargs", "_cached_resolve_chat_template_kwargs",
            "_get_hf_base_chat_template_params", "resolve_chat_template_kwargs", "_template_error_reason",
            "safe_apply_chat_template", "_is_var_access", "_is_attr_access", "_is_var_or_elems_access",
            "_attr_dotted_name", "_iter_nodes_assign_var_or_elems", "_iter_nodes_assign_messages_item",
            "_iter_nodes_assign_content_item", "_try_extract_ast", "_detect_content_format",
        ], {**common, "supports_kw": func["supports_kw"], "resolve_chat_template": resolve_chat_template})
        self.hf = hf
        msg_env = {**common, "ConversationMessage": dict, "ChatCompletionContentPartTextParam": dict,
                   "MultiModalItemTracker": FakeTracker, "PROMPT_EMBEDS_PLACEHOLDER_TOKEN": "<kv-epp-none>",
                   "_ImageParser": lambda p: p, "_AudioParser": lambda p: p, "_VideoParser": lambda p: p,
                   "_ResponsesInputImageParser": lambda p: p}
        self.msgs = extract(src, "vllm/renderers/chat_utils/chat_message.py", [
            "_TextParser", "_ImageEmbedsParser", "_AudioEmbedsParser", "_VideoEmbedsParser", "_PromptEmbedsParser",
            "_InputAudioParser", "_RefusalParser", "_PILImageParser", "_ThinkParser", "_AssistantParser", "_ToolParser",
            "ContentPart", "MM_PARSER_MAP", "TEXT_PART_TYPES", "_collect_known_content_part_fields",
            "_KNOWN_CONTENT_PART_FIELDS", "_collect_extra_fields", "PART_TYPES_TO_SKIP_NONE_CONTENT", "_CLAUDE_CODE_BILLING_HEADER",
            "_reject_reserved_placeholder_in_text", "parse_chat_message_content_mm_part",
            "parse_chat_message_content_part", "parse_chat_message_content_parts", "_strip_claude_code_billing_header",
            "parse_chat_message_content", "_postprocess_messages", "parse_chat_messages",
            "_TEXT_CONTENT_PART_TYPES", "_MEDIA_CONTENT_PART_KEYS", "has_non_text_content",
        ], msg_env)
        self.reused = extract(src, "vllm/renderers/online_renderer.py", ["_reused_prompt_token_ids"],
                              {**common, "has_non_text_content": self.msgs["has_non_text_content"]})[
            "_reused_prompt_token_ids"]
        resp_env = {**common, "FunctionDefinition": gen["FunctionDefinition"],
                    "ChatCompletionToolsParam": chat["ChatCompletionToolsParam"], "merge_kwargs": params["merge_kwargs"],
                    "map_reasoning_effort": params["map_reasoning_effort"], "ChatParams": params["ChatParams"],
                    # openai's TypedDicts (the package is not installed): plain dicts.
                    "ChatCompletionToolMessageParam": dict, "ChatCompletionAssistantMessageParam": dict,
                    "ChatCompletionMessageToolCallParam": dict, "FunctionCallTool": dict}
        self.resp = extract(src, "vllm/entrypoints/openai/responses/utils.py", [
            "should_continue_final_message", "construct_input_messages", "construct_chat_messages_with_tool_call",
            "_construct_message_from_response_item", "_item_type", "_item_dict",
            "convert_tool_responses_to_completions_format",
        ], resp_env)
        # The method imports `from .utils import should_continue_final_message`: serve the
        # extracted one under a stand-in package.
        import types

        pkg, utils = types.ModuleType("kvepp_vllm_responses"), types.ModuleType("kvepp_vllm_responses.utils")
        pkg.__path__ = []
        utils.should_continue_final_message = self.resp["should_continue_final_message"]
        sys.modules[pkg.__name__], sys.modules[utils.__name__] = pkg, utils
        self.resp_protocol = extract(src, "vllm/entrypoints/openai/responses/protocol.py",
                                     ["ResponsesRequest.build_chat_params"],
                                     {**resp_env, "__package__": pkg.__name__})
        self.model_config = SimpleNamespace(enable_prompt_embeds=False, multimodal_config=None)

    def content_format(self, template: str) -> str:
        return self.hf["_detect_content_format"](template, default="string")

    def render(self, tokenizer, messages, chat_params, tok_add_special_tokens):
        """`HfRenderer.render_messages` (text-only) then the tokenizer, as `render_chat` does."""
        content_format = self.content_format(chat_params.chat_template or tokenizer.chat_template)
        try:
            conversation, _, _ = self.msgs["parse_chat_messages"](messages, self.model_config, content_format)
        except self.ValidationError as e:
            return {"error": str(e), "stage": "validation"}
        kwargs = chat_params.get_apply_chat_template_kwargs()
        try:
            prompt = self.hf["safe_apply_chat_template"](self.model_config, tokenizer, conversation, **kwargs)
        except self.ValidationError as e:
            return {"error": str(e), "stage": "template"}
        ids = list(tokenizer(prompt, add_special_tokens=tok_add_special_tokens)["input_ids"])
        return {"prompt": prompt, "ids": ids}

    def with_server_defaults(self, chat_params, tool_dicts, server_kwargs):
        # OnlineRenderer.preprocess_chat: merge_kwargs(--default-chat-template-kwargs,
        # {tools, tokenize}), then ChatParams.with_defaults.
        defaults = self.merge_kwargs(server_kwargs, dict(tools=tool_dicts, tokenize=False))
        return chat_params.with_defaults(defaults, default_media_io_kwargs=None, default_mm_processor_kwargs=None)

    def untrusted(self, request_template, kwargs):
        renderer = SimpleNamespace(create_error_response=lambda message, *a, **k: message)
        return self.validate_chat_template(renderer, request_template, kwargs, False)

    def chat_request(self, tokenizer, template, body, server_kwargs):
        data = copy.deepcopy(body)
        try:
            for check in ("_normalize_messages_before", "check_tool_usage", "check_generation_prompt"):
                data = self.chat[check](None, data)
            effort = data.get("reasoning_effort")
            if effort is not None and effort not in self.efforts:
                raise self.ValidationError("reasoning_effort: not a ReasoningEffort")
            tools = data.get("tools")
            if tools is not None:
                tools = [self.chat["ChatCompletionToolsParam"].model_validate(t) for t in tools]
        except (self.ValidationError, pydantic.ValidationError, KeyError, TypeError) as e:
            return {"error": str(e).splitlines()[0], "stage": "validation"}
        req = SimpleNamespace(**{**self.chat_defaults, **{k: v for k, v in data.items() if k in self.chat_defaults}})
        req.tools = tools
        req.tool_choice = data.get("tool_choice", self.chat_defaults["tool_choice"])
        error = self.untrusted(req.chat_template, req.chat_template_kwargs)
        if error is not None:
            return {"error": error, "stage": "untrusted_template"}
        tool_dicts = None if tools is None else [t.model_dump() for t in tools]
        # preprocess_chat: decode-side reuse of forwarded prompt ids skips rendering.
        req.kv_transfer_params = data.get("kv_transfer_params")
        req.echo = data.get("echo", False)

        def validate_token_ids(ids, parameter):
            if any(i >= len(tokenizer) for i in ids):
                raise self.ValidationError(f"{parameter}: token id out of vocabulary")

        try:
            reused = self.reused(req, SimpleNamespace(validate_token_ids=validate_token_ids), data["messages"])
        except self.ValidationError as e:
            return {"error": str(e), "stage": "validation"}
        if reused:
            return {"prompt": None, "ids": reused}
        params = self.chat["build_chat_params"](req, template, "auto", reasoning_effort_map={})
        params = self.with_server_defaults(params, tool_dicts, server_kwargs)
        return self.render(tokenizer, data["messages"], params, req.add_special_tokens)

    def responses_request(self, tokenizer, template, body, server_kwargs):
        data = copy.deepcopy(body)
        tools = data.get("tools") or []
        tool_dicts = None
        if tools:
            tool_dicts = [self.resp["convert_tool_responses_to_completions_format"](t).model_dump() for t in tools]
        reasoning = data.get("reasoning")
        req = SimpleNamespace(
            input=data["input"], chat_template_kwargs=data.get("chat_template_kwargs"), tools=tools,
            tool_choice=data.get("tool_choice", "auto"), media_io_kwargs=None,
            reasoning=None if reasoning is None else SimpleNamespace(effort=reasoning.get("effort")),
        )
        error = self.untrusted(None, req.chat_template_kwargs)
        if error is not None:
            return {"error": error, "stage": "untrusted_template"}
        messages = self.resp["construct_input_messages"](request_instructions=data.get("instructions"),
                                                          request_input=req.input)
        # render_responses: effective kwargs as defaults, then preprocess_chat's build_chat_params.
        params = self.resp_protocol["build_chat_params"](req, template, "auto", reasoning_effort_map={})
        params = self.with_server_defaults(params, tool_dicts, server_kwargs)
        return self.render(tokenizer, messages, params, self.tok_params_add_special_tokens)


def _field_default(src, module_path, class_name, field):
    """A pydantic field's default as written in the class (a literal or `Field(default=...)`)."""
    import ast

    tree = ast.parse(src.path(module_path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == field:
                    value = item.value
                    if isinstance(value, ast.Call):
                        value = next(k.value for k in value.keywords if k.arg == "default")
                    return ast.literal_eval(value)
    raise LookupError(field)


SYS = {"role": "system", "content": "You are a helpful assistant."}
DEV = {"role": "developer", "content": "Answer in French."}
TOOL_UNORDERED = {"function": {"parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                               "name": "get_weather", "x-extra": 1}, "type": "function", "x-tool-extra": True}
TOOL_STRICT = {"type": "function", "defer_loading": False,
               "function": {"name": "lookup", "description": "Look it up.", "strict": True,
                            "parameters": {"type": "object", "properties": {}}}}


def build_cases(v: Vllm, tok, templates) -> list[dict]:
    cases: list[dict] = []
    model = tf.MODEL_NAME["small-bpe"]

    def add(name, template, endpoint, request, gap=None):
        request = {"model": model, **request}
        source = templates[template]
        server_template = None if template == "chatml" else source
        run = v.chat_request if endpoint == "chat" else v.responses_request
        # The one template that reads the clock gets its date from the server's
        # --default-chat-template-kwargs (kv-epp: a server-side template variable).
        server_kwargs = {"date_string": tf.DATE_STRING} if template == "tools-thinking" else {}
        out = run(tok, server_template, request, server_kwargs)
        case = {"name": name, "tokenizer": "small-bpe", "template": template, "endpoint": endpoint,
                "request": request, "content_format": v.content_format(source), "vllm": out}
        if server_kwargs:
            case["date_string"] = tf.DATE_STRING
        if gap:
            case["kv_epp_gap"] = gap
        cases.append(case)

    user = {"role": "user", "content": "Bonjour?"}
    # developer -> system
    add("chat/developer/chatml-first", "chatml", "chat", {"messages": [DEV, user]})
    add("chat/developer/chatml-consolidated", "chatml", "chat",
        {"messages": [SYS, user, {"role": "assistant", "content": "Oui."}, DEV, user]})
    add("chat/developer/llama3-alternation", "llama3", "chat",
        {"messages": [DEV, user, {"role": "assistant", "content": "Oui."}, {"role": "developer", "content": ""},
                      {"role": "developer", "content": [{"type": "text", "text": "Be short."}]}, user]})
    add("chat/developer/aware-template-keeps-it", "developer-aware", "chat", {"messages": [SYS, DEV, user]})
    add("chat/developer/one-system-no-merge", "chatml", "chat", {"messages": [DEV, user, user]})
    add("chat/developer/tools-thinking-single-system", "tools-thinking", "chat",
        {"messages": [SYS, {"role": "user", "content": "hi"}, DEV]})
    add("chat/developer/probe-keys", "kwargs-probe", "chat",
        {"messages": [{"role": "developer", "content": "d", "name": "ops", "tools": [{"x": 1}]}, user]})
    # reasoning_effort
    add("chat/reasoning-effort/high", "tools-thinking", "chat",
        {"messages": [user], "reasoning_effort": "high"})
    add("chat/reasoning-effort/none", "tools-thinking", "chat",
        {"messages": [user], "reasoning_effort": "none"})
    add("chat/reasoning-effort/client-enable-thinking-wins", "kwargs-probe", "chat",
        {"messages": [user], "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}})
    add("chat/reasoning-effort/client-null-enable-thinking", "kwargs-probe", "chat",
        {"messages": [user], "reasoning_effort": "max", "chat_template_kwargs": {"enable_thinking": None}})
    add("chat/reasoning-effort/kwarg-only", "kwargs-probe", "chat",
        {"messages": [user], "chat_template_kwargs": {"reasoning_effort": "medium"}})
    add("chat/reasoning-effort/invalid", "kwargs-probe", "chat", {"messages": [user], "reasoning_effort": "huge"})
    # request fields over chat_template_kwargs; kwargs filter
    add("chat/kwargs/request-fields-win", "kwargs-probe", "chat",
        {"messages": [user], "chat_template_kwargs": {"add_generation_prompt": False, "custom": [1, {"b": 2, "a": 1}],
                                                      "auto_flag": "auto", "null_flag": None, "max_length": 3,
                                                      "padding": True, "documents": [{"title": "k"}]}})
    add("chat/kwargs/documents-field-wins", "kwargs-probe", "chat",
        {"messages": [user], "documents": [{"title": "f", "text": "x"}],
         "chat_template_kwargs": {"documents": [{"title": "k"}]}})
    add("chat/kwargs/chatml-unused", "chatml", "chat",
        {"messages": [user], "chat_template_kwargs": {"custom": 1, "enable_thinking": True}})
    add("chat/kwargs/request-chat-template", "chatml", "chat", {"messages": [user], "chat_template": "{{ 'x' }}"})
    add("chat/kwargs/kwarg-chat-template", "chatml", "chat",
        {"messages": [user], "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})
    add("chat/kwargs/continue-final-message", "kwargs-probe", "chat",
        {"messages": [user, {"role": "assistant", "content": "Je"}], "add_generation_prompt": False,
         "continue_final_message": True})
    # tools
    add("chat/tools/reordered-and-no-description", "tools-thinking", "chat",
        {"messages": [user], "tools": [TOOL_UNORDERED, TOOL_STRICT]})
    add("chat/tools/probe", "kwargs-probe", "chat", {"messages": [user], "tools": [TOOL_STRICT, TOOL_UNORDERED]})
    add("chat/tools/kwargs-tools-override", "kwargs-probe", "chat",
        {"messages": [user], "tools": [TOOL_STRICT], "chat_template_kwargs": {"tools": [{"raw": True}]}})
    add("chat/tools/bad-type", "kwargs-probe", "chat",
        {"messages": [user], "tools": [{"type": "web", "function": {"name": "f"}}]})
    add("chat/tools/no-name", "kwargs-probe", "chat", {"messages": [user], "tools": [{"type": "function",
                                                                                      "function": {}}]})
    add("chat/tools/tool-calls-arguments", "kwargs-probe", "chat",
        {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": {"k": "v"}}},
            {"id": "c", "type": "function", "function": {"name": "h", "arguments": ""}},
            {"id": "d", "type": "function", "function": {"name": "i", "arguments": "{\"z\": 1, \"y\": [true]}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "r1"}, {"type": "text",
                                                                                               "text": "r2"}]}],
         "tools": [TOOL_STRICT]})
    add("chat/tools/tool-calls-not-function", "kwargs-probe", "chat",
        {"messages": [user, {"role": "assistant", "tool_calls": [{"id": "a", "type": "custom",
                                                                   "custom": {"name": "f"}}]}]})
    # content parts and message fields
    add("chat/content/part-types", "kwargs-probe", "chat",
        {"messages": [{"role": "user", "task": "qa", "content": [
            {"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"},
            {"type": "refusal", "refusal": "c"}, {"type": "thinking", "thinking": "d"}, "e",
            {"type": "text", "text": None}, {"image_url": {"url": "https://example.invalid/x.png"}},
            {"type": "input_image", "image_url": "https://example.invalid/y.png"}]},
            {"role": "assistant", "content": "x", "reasoning_content": "why"}]})
    add("chat/content/billing-header", "chatml", "chat",
        {"messages": [{"role": "system", "content": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
            {"type": "text", "text": "x-anthropic-billing-header: cch=def\nYou are Claude Code."},
            {"type": "text", "text": "Be careful."}]}, user]})
    add("chat/content/billing-header-string", "chatml", "chat",
        {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nSystem text."}, user]})
    add("chat/content/unknown-part-type", "chatml", "chat",
        {"messages": [{"role": "user", "content": [{"type": "hologram", "text": "x"}]}]})
    add("chat/content/untyped-part", "chatml", "chat", {"messages": [{"role": "user", "content": [{"text": "x"}]}]})
    add("chat/content/openai-format-template", "openai-content", "chat", {"messages": [SYS, user]},
        gap="content_format")
    # disaggregated serving: the prefill stage's ids are used as they are
    kv = {"kv_transfer_params": {"do_remote_prefill": True, "prompt_token_ids": [5, 6, 7, 8]}}
    add("chat/kv-transfer/reused-ids", "chatml", "chat", {"messages": [user], **kv})
    add("chat/kv-transfer/echo-renders", "chatml", "chat", {"messages": [user], "echo": True, **kv})
    add("chat/kv-transfer/media-renders", "chatml", "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                   {"type": "image_url", "image_url": {"url": "u"}}]}], **kv})
    add("chat/kv-transfer/bad-ids", "chatml", "chat",
        {"messages": [user], "kv_transfer_params": {"prompt_token_ids": [1, -2]}})
    add("chat/kv-transfer/out-of-vocabulary", "chatml", "chat",
        {"messages": [user], "kv_transfer_params": {"prompt_token_ids": [1, 999999]}})
    add("chat/template/raise", "llama3", "chat", {"messages": [{"role": "assistant", "content": "first"}, user]})

    # /v1/responses
    add("responses/string-input", "chatml", "responses", {"input": "Bonjour?", "instructions": "Be brief."})
    add("responses/empty-instructions", "chatml", "responses", {"input": "Hi", "instructions": ""})
    add("responses/messages", "kwargs-probe", "responses",
        {"input": [{"role": "developer", "content": "Use tools."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                                {"type": "input_image", "image_url": "https://example.invalid/z.png"}]},
                   {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                    "content": [{"type": "output_text", "text": "Which city?", "annotations": []},
                                {"type": "output_text", "text": "ignored", "annotations": []}]},
                   {"role": "user", "content": "Paris"}],
         "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False,
                    "x": 1}],
         "reasoning": {"effort": "low"}, "chat_template_kwargs": {"custom": "c"}})
    add("responses/tools-thinking", "tools-thinking", "responses",
        {"input": [{"role": "user", "content": "Weather in Paris?"}],
         "tools": [{"type": "function", "name": "get_weather", "description": "Get weather.",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
         "reasoning": {"effort": "none"}})
    add("responses/continue-partial", "chatml", "responses",
        {"input": [{"role": "user", "content": "Write a haiku."},
                   {"type": "message", "role": "assistant", "status": "incomplete",
                    "content": [{"type": "output_text", "text": "Autumn moonlight —"}]}]})
    add("responses/function-call-output", "chatml", "responses",
        {"input": [{"role": "user", "content": "hi"},
                   {"type": "function_call_output", "call_id": "c1", "output": "42"}]},
        gap="responses_input")
    return cases


# Template shapes for the content-format check (vLLM's `_detect_content_format` walks the AST;
# kv-epp's textual check must flag every template vLLM calls "openai").
CONTENT_FORMAT_TEMPLATES = [
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}",
    "{% for message in messages %}{% for item in message.content | selectattr('type', 'equalto', 'text') %}"
    "{{ item.text }}{% endfor %}{% endfor %}",
    "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "{% macro render(content) %}{% for part in content %}{{ part.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
    "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{{ c.text }}{% endfor %}{% endif %}{% endfor %}",
    "{%- for m in messages %}{{ m.role }}{% for t in m.tool_calls %}{{ t }}{% endfor %}{% endfor %}",
]


def generate() -> str:
    wheel = find_wheel()
    if wheel is None:
        raise SystemExit("vllm-0.33.0 wheel not found: run scripts/setup-venv.sh (or set VLLM_WHEEL_DIR)")
    v = Vllm(VllmSource(wheel))
    templates = {name: (tf.TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")
                 for name in ("chatml", "llama3", "tools-thinking")}
    templates.update(TEMPLATES)
    tok = AutoTokenizer.from_pretrained(str(tf.SMALL_DIR), local_files_only=True)
    cases = build_cases(v, tok, templates)
    meta = {"generator": "scripts/gen_vllm_preproc_cases.py", "vllm_version": "0.33.0",
            "transformers_version": __import__("transformers").__version__,
            "content_formats": [{"template": t, "vllm": v.content_format(t)} for t in CONTENT_FORMAT_TEMPLATES]}
    return tf.dump_cases(meta, cases)


def main() -> int:
    check = "--check" in sys.argv[1:]
    for name, text in TEMPLATES.items():
        path = tf.TEMPLATE_DIR / f"{name}.jinja"
        if check:
            if path.read_text(encoding="utf-8") != text:
                print(f"{path} is stale: run scripts/gen_vllm_preproc_cases.py", file=sys.stderr)
                return 1
        else:
            tf.write_text(path, text)
    out = generate()
    if check:
        if OUT.read_text(encoding="utf-8") != out:
            print(f"{OUT} differs from what vLLM 0.33.0's code produces now: "
                  "run scripts/gen_vllm_preproc_cases.py", file=sys.stderr)
            return 1
        print(f"{OUT}: up to date with vLLM 0.33.0's preprocessing")
        return 0
    tf.write_text(OUT, out)
    print(f"wrote {out.count(chr(10)) - 5} cases to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
