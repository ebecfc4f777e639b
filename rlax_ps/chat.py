"""Chat templates: a Hugging Face tokenizer's Jinja template turns a conversation into the
prompt text an instruct model was trained on, rendered as transformers'
`apply_chat_template` renders it (sandboxed; `tojson`, `raise_exception`, `strftime_now`,
`{% generation %}` blocks), so prompts for an instruct model need no hand formatting.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Mapping, Sequence

TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.43 writes the template here


def raw_prompt(text: str | list, metadata: Mapping[str, str]) -> str | list[dict[str, Any]]:
  """The prompt as the trainer had it before rendering it: metadata "prompt" (JSON: a
  conversation its chat template rendered, or a text) where it rendered it, else `text`. A
  reward model or teacher of another tokenizer renders the conversation with its own."""
  return json.loads(metadata["prompt"]) if "prompt" in metadata else text


def check_messages(messages: Any, field: str = "prompt") -> list[dict[str, str]]:
  """`messages` as a list of {"role", "content"} string dicts; ValueError naming `field`."""
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ValueError(f"{field}: expected a non-empty list of {{'role', 'content'}} messages, "
                     f"got {messages!r}")
  for i, m in enumerate(messages):
    if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      raise ValueError(f"{field}[{i}]: expected {{'role': str, 'content': str}}, got {m!r}")
  return [dict(m) for m in messages]


ADDITIONAL_DIR = "additional_chat_templates"  # transformers' named templates, one .jinja each


def named_templates(tokenizer_dir: str) -> dict[str, str]:
  """The tokenizer's chat templates by name, as transformers reads them: "default" from
  chat_template.jinja or tokenizer_config.json's chat_template (a list of {"name",
  "template"} holds several, e.g. "tool_use"), more from additional_chat_templates/, and an
  image-text model's chat_template.json as the default where there is none else."""
  found: dict[str, str] = {}
  file = os.path.join(tokenizer_dir, TEMPLATE_FILE)
  if os.path.isfile(file):
    with open(file) as f:
      found["default"] = f.read()
  config_file = os.path.join(tokenizer_dir, "tokenizer_config.json")
  template = None
  if os.path.isfile(config_file):
    with open(config_file) as f:
      template = json.load(f).get("chat_template")
  if isinstance(template, str):
    found.setdefault("default", template)
  elif isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": ...}]
    for t in template:
      if isinstance(t, Mapping) and isinstance(t.get("template"), str):
        found.setdefault(str(t.get("name")), t["template"])
  extra = os.path.join(tokenizer_dir, ADDITIONAL_DIR)
  for name in sorted(os.listdir(extra)) if os.path.isdir(extra) else ():
    if name.endswith(".jinja"):
      with open(os.path.join(extra, name)) as f:
        found.setdefault(name[:-len(".jinja")], f.read())
  processor_file = os.path.join(tokenizer_dir, "chat_template.json")
  if "default" not in found and os.path.isfile(processor_file):  # e.g. Gemma 3 4B and up
    with open(processor_file) as f:
      template = json.load(f).get("chat_template")
    if isinstance(template, str):
      found["default"] = template
  return {name: t for name, t in found.items() if t}


def read_template(spec: str, tokenizer_dir: str, tools: bool = False) -> str:
  """The template `spec` names: "auto" takes the tokenizer's (named_templates): its
  "tool_use" one when `tools` are offered and it has one, else its "default", as
  transformers' apply_chat_template picks; a name of one of them takes that one; any other
  value is a .jinja file's path. ValueError naming tokenizer.chat_template if none."""
  templates = named_templates(tokenizer_dir) if spec == "auto" or not os.path.isfile(spec) else {}
  if spec != "auto":
    if spec in templates and not os.path.isfile(spec):
      return templates[spec]
    if not os.path.isfile(spec):
      raise ValueError(f"tokenizer.chat_template: expected 'auto', '', a template file or one "
                       f"of the tokenizer's templates {sorted(templates)}, got {spec!r} (no "
                       f"such file)")
    with open(spec) as f:
      return f.read()
  if tools and "tool_use" in templates:
    return templates["tool_use"]
  if "default" not in templates:
    raise ValueError(f"tokenizer.chat_template: 'auto' found no chat template in "
                     f"{tokenizer_dir} ({TEMPLATE_FILE}, tokenizer_config.json's "
                     f"chat_template, {ADDITIONAL_DIR}/ or chat_template.json); name a .jinja "
                     f"file or set ''")
  return templates["default"]


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  import jinja2
  from jinja2 import ext, nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for masks; it renders
    its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ValueError(f"tokenizer.chat_template: not a valid Jinja template: {e}") from None


def render(template: str, messages: Sequence[Mapping[str, str]], *,
           special_tokens: Mapping[str, str] | None = None, add_generation_prompt: bool = True,
           tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
  """The text of `messages` under `template`, ending with the assistant's turn opened
  (`add_generation_prompt`); `special_tokens` (bos_token, eos_token, ...) and `kwargs`
  (e.g. enable_thinking) are template variables, as in transformers."""
  import jinja2
  try:
    return _compile(template).render(messages=list(messages), tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**dict(special_tokens or {}), **kwargs})
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f"tokenizer.chat_template: rendering {list(messages)!r} failed: "
                     f"{e}") from None
