"""Chat templates in the styles released folders ship (written here, shaped as the hub's), tokenizer folders
carrying them (saved by transformers' own fast class), and chat samples in OpenAI's and ERNIEKit's forms."""

from __future__ import annotations

import json
from pathlib import Path

# Llama 3: <|begin_of_text|>, a header per turn, <|eot_id|> after each
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")

# Qwen2.5: a default system prompt, tools in the system turn, tool calls as <tool_call> JSON, tool results as user turns
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Gemma 3: <bos>, the system prompt folded into the first user turn, the assistant named "model", roles alternating
GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# ChatML with {% generation %} blocks (SmolLM3's and TRL's assistant-mask form): transformers' assistant mask
CHATML_GENERATION = """{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- message.content + '<|im_end|>\\n' }}
        {%- endgeneration %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3's: rewrites earlier assistant turns (drops their <think> blocks), so k turns are no prefix of k + 1
REWRITING = """{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == "assistant" and not loop.last %}
        {%- set content = content.split('</think>')[-1] %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# style -> (template, bos token, eos token)
TEMPLATES = {"llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"), "qwen": (QWEN, None, "<|im_end|>"),
             "gemma": (GEMMA, "<bos>", "<eos>"), "chatml_generation": (CHATML_GENERATION, None, "<|im_end|>"),
             "rewriting": (REWRITING, None, "<|im_end|>")}
SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<unk>", "<pad>"]

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Today's weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
# multi-turn with a system prompt; one with a tool call and its result (Qwen's tool template)
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You answer briefly."},
                  {"role": "user", "content": "What is a kernel?"},
                  {"role": "assistant", "content": "The core of an operating system."},
                  {"role": "user", "content": "And a shell?"},
                  {"role": "assistant", "content": "A program that reads commands and runs them."}]},
    {"messages": [{"role": "user", "content": "Name a hacker in the jargon file."},
                  {"role": "assistant", "content": "One who enjoys exploring systems."}]},
]
TOOL_CONVERSATION = {"messages": [
    {"role": "system", "content": "You may call tools."},
    {"role": "user", "content": "Is it raining in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "rain, 12 degrees"},
    {"role": "assistant", "content": "Yes: rain and 12 degrees."}], "tools": TOOLS}


def chat_tokenizer(style: str, folder: Path, corpus: Path, vocab_size: int = 2048) -> Path:
    """A byte-level BPE trained on `corpus` with every template's special tokens, saved by transformers'
    PreTrainedTokenizerFast with `style`'s template, bos and eos (as a hub folder holds them)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    template, bos, eos = TEMPLATES[style]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(corpus)], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, unk_token="<unk>",
                                                pad_token="<pad>", **({"bos_token": bos} if bos else {}))
    fast.chat_template = template
    fast.save_pretrained(folder)
    return Path(folder)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def jargon_chats(corpus: Path, count: int, seed: int = 0) -> list[dict]:
    """`count` samples of mixed lengths from the corpus's paragraphs: 1-3 turns, a question from the first words
    of a paragraph, an answer of 4-40 of its words; every third in ERNIEKit's form with its middle turn untrained."""
    import numpy as np

    rng = np.random.RandomState(seed)
    paragraphs = [p.split() for p in corpus.read_text(encoding="utf-8").split("\n\n") if len(p.split()) > 12]
    samples = []
    for index in range(count):
        turns = []
        for _ in range(rng.randint(1, 4)):
            words = paragraphs[rng.randint(len(paragraphs))]
            turns.append((" ".join(words[:rng.randint(3, 8)]) + "?", " ".join(words[:rng.randint(4, 41)])))
        if index % 3 == 2:
            samples.append({"system": "Answer from the jargon file.", "src": [q for q, _ in turns],
                            "tgt": [a for _, a in turns], "label": [int(i != 1) for i in range(len(turns))]})
        else:
            samples.append({"messages": [m for q, a in turns for m in ({"role": "user", "content": q},
                                                                       {"role": "assistant", "content": a})]})
    return samples
