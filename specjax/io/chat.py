"""Chat prompts: a model directory's chat template (`tokenizer_config.json`'s `chat_template`, or a
`chat_template.jinja` beside it) rendered with jinja2 the way transformers' `apply_chat_template`
does (sandboxed, trim_blocks, lstrip_blocks, `raise_exception`, `tojson`, the special tokens as
variables), so the same messages give the same text, hence the same token ids."""
from __future__ import annotations

import json
import os
from datetime import datetime

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


def chat_template(model_dir: str) -> tuple[str, dict]:
    """(template source, tokenizer_config) of a model directory; ValueError if it has no template."""
    cfg_file = os.path.join(model_dir, "tokenizer_config.json")
    cfg = {}
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cfg = json.load(f)
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            return f.read(), cfg
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        raise ValueError(f"{model_dir}: no chat template (tokenizer_config.json has no chat_template and there is "
                         "no chat_template.jinja): not an instruct model?")
    return template, cfg


def check_messages(messages, where: str = "messages") -> list[Message]:
    """`messages` as a list of {"role", "content"} string dicts, or ValueError naming the problem."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f'{where}: message {i} must be an object with string "role" and "content"')
    return messages


def render_chat(model_dir: str, messages: list[Message], *, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` under the model's chat template (ending with the assistant
    turn's header when `add_generation_prompt`)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template, cfg = chat_template(model_dir)
    check_messages(messages)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if isinstance(cfg.get(k), str)}
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **special)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"{model_dir}: the chat template failed: {e}") from None
