"""Tiny generated models whose chat templates render tools in each family's own syntax.

Each is the tiny qwen3 test model (tests/support/testmodels.py) with the default model's tokenizer,
some of its unused control tokens renamed to the family's markers (``[TOOL_CALLS]``,
``<|eot_id|>``...) and a chat template written here in the family's style:

- ``hermes``: ChatML with the tools in the system message and ``<tool_call>`` blocks
  (``<tool_call>`` and ``</tool_call>`` user-defined tokens, as in Qwen's vocabulary);
- ``llama3``: Llama 3 headers, the tools in the system message, one JSON call per message,
  tool results under the ``ipython`` role;
- ``mistral``: ``[INST]`` turns, ``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS]`` arrays with 9-character
  ids, and ``[TOOL_RESULTS]`` whose content the template writes with ``tojson``.

Their weights are random: what they write is noise, except where a grammar holds it.
"""

# ruff: noqa: E501  (the templates keep one statement a line, as the families' own do)

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import gguf
import testmodels

FORMATS = ("hermes", "llama3", "mistral")

HERMES = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou can call these functions (JSON schemas within <tools></tools>):\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nTo call one, write <tool_call>\n{"name": <function-name>, "arguments": <args-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA3 = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}
{%- set system = '' %}{%- set rest = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}
{{- 'Environment: ipython\n\nTo call a function, respond with JSON: {"name": function name, "parameters": dictionary of argument name and its value}.\n\n' }}
{%- for t in tools %}{{- (t | tojson(indent=4)) + '\n\n' }}{%- endfor %}
{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in rest %}
{%- if 'tool_calls' in message %}
{%- if message.tool_calls | length != 1 %}{{- raise_exception('This model makes one tool call at once') }}{%- endif %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

MISTRAL = r"""
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}
{%- set system = '' %}{%- set rest = messages %}
{%- endif %}
{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in rest %}
{%- if message.role == 'user' %}
{%- if loop.first and system %}{{- '[INST]' + system + '\n\n' + message.content + '[/INST]' }}
{%- else %}{{- '[INST]' + message.content + '[/INST]' }}{%- endif %}
{%- elif message.tool_calls is defined and message.tool_calls %}
{{- '[TOOL_CALLS][' }}
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{- raise_exception('Tool call ids are 9 letters or digits') }}{%- endif %}
{{- '{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS]{"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

_CONTROL = gguf.TokenType.CONTROL
_USER_DEFINED = gguf.TokenType.USER_DEFINED
# llama.cpp takes <|endoftext|> and the fill-in-the-middle tokens <repo_name>, <reponame> and
# <file_sep> to end a generation too: renamed, the template's own end of turn is the only one
# (a reply that ends otherwise is no longer the text its template writes back).
_ONE_END = {i: (f"<unused{i}>", _CONTROL) for i in (0, 3, 4, 5)}
# Per format: the template and the token ids renamed (the default model's control tokens 0-16:
# <|endoftext|>, <|im_start|> (BOS), <|im_end|> (EOS) and 14 that no chat uses).
_SPECS: dict[str, tuple[str, dict[int, tuple[str, int]]]] = {
    "hermes": (HERMES, {**_ONE_END, 8: ("<tool_call>", _USER_DEFINED), 9: ("</tool_call>", _USER_DEFINED)}),
    "llama3": (
        LLAMA3,
        {
            **_ONE_END,
            1: ("<|begin_of_text|>", _CONTROL),
            2: ("<|eot_id|>", _CONTROL),
            8: ("<|start_header_id|>", _CONTROL),
            9: ("<|end_header_id|>", _CONTROL),
        },
    ),
    "mistral": (
        MISTRAL,
        {
            **_ONE_END,
            1: ("<s>", _CONTROL),
            2: ("</s>", _CONTROL),
            8: ("[INST]", _CONTROL),
            9: ("[/INST]", _CONTROL),
            10: ("[TOOL_CALLS]", _CONTROL),
            11: ("[AVAILABLE_TOOLS]", _CONTROL),
            12: ("[/AVAILABLE_TOOLS]", _CONTROL),
            13: ("[TOOL_RESULTS]", _CONTROL),
            14: ("[/TOOL_RESULTS]", _CONTROL),
        },
    ),
}


#: An edit of a tokenizer's entries.
TokenizerEdit = Callable[[list[testmodels.TokenizerEntry]], list[testmodels.TokenizerEntry]]


def retokenizer(fmt: str, more: Mapping[int, tuple[str, int]] | None = None) -> tuple[TokenizerEdit, str]:
    """The edit of the default model's tokenizer entries that gives format `fmt`'s template and
    token names (and the `more` token ids renamed: text and kind), and a tag that changes
    whenever the edit does."""
    template, renames = _SPECS[fmt]
    renames = {**renames, **(more or {})}

    def edit(entries: list[testmodels.TokenizerEntry]) -> list[testmodels.TokenizerEntry]:
        out = []
        for kv in entries:
            if kv.key == "tokenizer.chat_template":
                kv = replace(kv, value=template.strip().encode())
            elif kv.key == "tokenizer.ggml.tokens":
                kv = replace(
                    kv, value=[renames[i][0].encode() if i in renames else t for i, t in enumerate(kv.value)]
                )
            elif kv.key == "tokenizer.ggml.token_type":
                kv = replace(
                    kv, value=[int(renames[i][1]) if i in renames else t for i, t in enumerate(kv.value)]
                )
            out.append(kv)
        return out

    tag = hashlib.sha256(repr((template, sorted(renames.items()))).encode()).hexdigest()[:12]
    return edit, tag


def path(fmt: str) -> Path:
    """The GGUF of the tiny model whose template speaks format `fmt` (built once, cached)."""
    edit, tag = retokenizer(fmt)
    return testmodels.variant("qwen3", f"tools-{fmt}-{tag}", edit)
