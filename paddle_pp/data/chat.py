"""Chat samples as the model's own template writes them, and which of their tokens train.

A sample is a list of messages (OpenAI's `messages`, with `tools`; ERNIEKit's `system` / `src` /
`tgt` / `label` read into the same list: `conversation`). The model folder's template
(`chat_template.jinja`, else `chat_template` in tokenizer_config.json) is rendered with jinja2 as
transformers' `apply_chat_template` renders it (a sandbox with `trim_blocks`, `lstrip_blocks`,
loop controls, its `tojson`, `raise_exception` and `strftime_now`, the folder's special tokens as
variables), and the text is tokenized without adding special tokens, as it does: the template
writes `<bos>` where the model wants one.

The trained tokens are the assistant turns', found in the rendering itself:
- a template with `{% generation %}` blocks marks them (transformers' assistant mask);
- otherwise each trained assistant turn k is what rendering turns 0..k adds to rendering turns 0..k-1
  with the generation prompt (the end-of-turn tokens included: a model that never learns them never
  stops). That holds only when each rendering is a prefix of the next; a template that rewrites
  earlier turns (Qwen3's drops past reasoning) is refused by name.
A turn marked untrained (ERNIEKit's `label: 0`, OpenAI's `weight: 0`) stays in the text, untrained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from paddle_pp.data.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"
GENERATION_OPEN, GENERATION_CLOSE = "\ue000", "\ue001"  # private-use marks around a generation block's output
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """One sample: its messages (as the template reads them), the tools it offers, and per message
    whether an assistant message trains."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    trained: tuple[bool, ...] = ()

    def assistant_turns(self) -> list[int]:
        return [i for i, message in enumerate(self.messages) if message["role"] == "assistant"]


def conversation(record: dict, where: str) -> Conversation:
    """A sample from one JSON line: OpenAI's `messages` (+ `tools`; an assistant message with
    `weight: 0` is not trained) or ERNIEKit's `src` / `tgt` (+ `system`, `label`: 0 = do not train that turn)."""
    if "messages" in record:
        return _openai(record, where)
    if "src" in record and "tgt" in record:
        return _erniekit(record, where)
    raise DataError(f"{where}: a sample has neither 'messages' (OpenAI's form) nor 'src' and 'tgt' (ERNIEKit's); "
                    f"its keys are {sorted(record)}")


def _openai(record: dict, where: str) -> Conversation:
    unknown = set(record) - {"messages", "tools"}
    if unknown:
        raise DataError(f"{where}: unknown keys {sorted(unknown)} beside 'messages' (known: messages, tools)")
    messages, trained = [], []
    for message in record["messages"]:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataError(f"{where}: a message's role must be one of {ROLES}, got {message!r:.80}")
        weight = message.get("weight", 1)
        if weight not in (0, 1):
            raise DataError(f"{where}: a message's 'weight' is 0 or 1 (train it or not), got {weight!r}")
        if weight == 0 and message["role"] != "assistant":
            raise DataError(f"{where}: 'weight' marks assistant messages only, found on a {message['role']} message")
        messages.append({key: value for key, value in message.items() if key != "weight"})
        trained.append(message["role"] == "assistant" and weight == 1)
    if not any(trained):
        raise DataError(f"{where}: a sample has no assistant message to train")
    tools = record.get("tools")
    return Conversation(tuple(messages), tuple(tools) if tools else None, tuple(trained))


def _erniekit(record: dict, where: str) -> Conversation:
    unknown = set(record) - {"system", "src", "tgt", "label", "is_system"}
    if unknown:
        raise DataError(f"{where}: unknown keys {sorted(unknown)} in an ERNIEKit sample (known: system, src, tgt, "
                        "label, is_system)")
    if record.get("is_system", 0):
        raise DataError(f"{where}: 'is_system: 1' (the first src as the system prompt) is not modelled; give the "
                        "prompt as 'system'")
    src, tgt = ([value] if isinstance(value, str) else list(value) for value in (record["src"], record["tgt"]))
    labels = record.get("label", [1] * len(tgt))
    if len(src) != len(tgt) or len(labels) != len(tgt) or any(label not in (0, 1) for label in labels):
        raise DataError(f"{where}: ERNIEKit's src, tgt and label are one entry per turn (label 0 or 1), got "
                        f"{len(src)}, {len(tgt)} and {labels!r}")
    if not any(labels):
        raise DataError(f"{where}: every turn has label 0: the sample trains nothing")
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    trained = [False] * len(messages)
    for question, answer, label in zip(src, tgt, labels):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        trained += [False, bool(label)]
    return Conversation(tuple(messages), None, tuple(trained))


class ChatTemplate:
    """A folder's chat template, compiled as transformers compiles it."""

    def __init__(self, source: str, special_tokens: dict[str, str], name: str):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """`{% generation %}...{% endgeneration %}`: its output between two marks, found after rendering."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_marked"), [], [], body).set_lineno(lineno)

            def _marked(self, caller):
                return f"{GENERATION_OPEN}{caller()}{GENERATION_CLOSE}"

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[Generation, loopcontrols])
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.name, self.special_tokens = name, special_tokens
        self.marks_generation = "generation" in source and "endgeneration" in source
        try:
            self.template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise DataError(f"{name}: the chat template does not parse ({err})") from err

    def render(self, messages, tools=None, add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """(the text, the character spans of its generation blocks)."""
        import jinja2

        try:
            marked = self.template.render(messages=list(messages), tools=list(tools) if tools else None,
                                          documents=None, add_generation_prompt=add_generation_prompt,
                                          **self.special_tokens)
        except jinja2.TemplateError as err:
            raise DataError(f"{self.name}: the chat template refused a sample ({err})") from err
        return _without_marks(marked)

    def trained_spans(self, sample: Conversation, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered sample and the character spans of its trained assistant turns."""
        text, blocks = self.render(sample.messages, sample.tools)
        turns = sample.assistant_turns()
        if self.marks_generation:
            if len(blocks) != len(turns):
                raise DataError(f"{where}: {self.name} marks {len(blocks)} generation block(s) for {len(turns)} "
                                "assistant message(s); each assistant turn must be one block")
            return text, [span for span, turn in zip(blocks, turns) if sample.trained[turn]]
        spans = []
        for turn in turns:
            before, _ = self.render(sample.messages[:turn], sample.tools, add_generation_prompt=True)
            through, _ = self.render(sample.messages[:turn + 1], sample.tools)
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(
                    f"{where}: {self.name} does not render the first {turn + 1} message(s) as a prefix of the whole "
                    "conversation (it rewrites earlier turns, as Qwen3's drops past reasoning), so the assistant's "
                    "tokens cannot be found from the rendering; give the template {% generation %} blocks, or "
                    "train on one assistant turn per sample")
            if sample.trained[turn]:
                spans.append((len(before), len(through)))
        return text, spans


def _without_marks(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without the generation marks, and the spans they enclosed (blocks never nest)."""
    text, spans, start, length = [], [], 0, 0
    for char in marked:
        if char == GENERATION_OPEN:
            start = length
        elif char == GENERATION_CLOSE:
            spans.append((start, length))
        else:
            text.append(char)
            length += 1
    return "".join(text), spans


def load_template(folder: Path, override: Path | None = None) -> tuple[str, str]:
    """(the template source, where it came from): `override`, else the folder's chat_template.jinja, else the
    `chat_template` of its tokenizer_config.json (a list of named templates: the one named "default")."""
    if override is not None:
        if not override.is_file():
            raise DataError(f"--chat_template {override} does not exist")
        return override.read_text(encoding="utf-8"), str(override)
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILE)
    config_path = folder / "tokenizer_config.json"
    template: Any = json.loads(config_path.read_text()).get("chat_template") if config_path.is_file() else None
    if isinstance(template, list):
        template = {entry.get("name"): entry.get("template") for entry in template}.get("default")
    if not template:
        raise DataError(f"{folder} has no chat template ({TEMPLATE_FILE}, or chat_template in tokenizer_config.json); "
                        "fine-tuning on chat data renders the model's own: pass --chat_template <file.jinja>")
    return template, f"{config_path} chat_template"


def special_tokens(folder: Path) -> dict[str, str]:
    """The special tokens a template reads by name (transformers passes its `special_tokens_map`)."""
    settings = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            settings |= {key: value for key, value in json.loads(path.read_text()).items()
                         if key in ("bos_token", "eos_token", "unk_token", "pad_token") and value}
    return {key: value.get("content") if isinstance(value, dict) else value for key, value in settings.items()}
