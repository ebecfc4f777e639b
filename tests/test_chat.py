"""Chat templates render prompts exactly as transformers' apply_chat_template does (text and
ids, on tests/fixtures/hf/chat_tokenizer written by make_hf_fixtures.py), generation stops at
every end-of-turn id, and bad templates, messages and settings are named."""

import json
import os

import pytest

from rlax_ps import chat
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer, make_tokenizer
from rlax_ps.train.prompts import read_prompts

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
CHAT = os.path.join(FIXTURES, "chat_tokenizer")
with open(os.path.join(CHAT, "expected.json")) as _f:
  CASES = json.load(_f)["cases"]


def tokenizer(template="auto", **kwargs):
  spec = template if template == "auto" else os.path.join(CHAT, template)
  return HFTokenizer(CHAT, chat_template=spec, chat_kwargs=kwargs)


@pytest.mark.parametrize("case", CASES, ids=[f"{c['template']}-{i}" for i, c in enumerate(CASES)])
def test_rendering_and_ids_equal_transformers_apply_chat_template(case):
  tok = tokenizer(case["template"], **case["kwargs"])
  assert tok.render_prompt(case["messages"]) == case["text"]
  assert tok.encode_prompt(case["messages"]) == case["ids"]


def test_a_text_prompt_is_one_user_message_and_without_a_template_stays_text():
  tok = tokenizer()
  one = [c for c in CASES if c["template"] == "auto" and not c["kwargs"]
         and len(c["messages"]) == 1][0]
  assert tok.encode_prompt(one["messages"][0]["content"]) == one["ids"]
  plain = HFTokenizer(CHAT)
  assert plain.chat_template is None
  assert plain.encode_prompt("hello world") == plain.encode("hello world")  # it states no bos


def test_generation_stops_at_eos_and_every_generation_config_eos():
  tok = HFTokenizer(CHAT)
  im_end, endoftext = (tok._tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
  assert tok.eos_id == im_end and tok.stop_ids == (im_end, endoftext)
  plain = HFTokenizer(os.path.join(FIXTURES, "tokenizer"), bos_token="<eos>")
  assert plain.stop_ids == (plain.eos_id,)  # no generation_config.json there


def test_stop_tokens_add_to_the_stops_and_an_unknown_one_is_named():
  tok = make_tokenizer("hf", CHAT, stop_tokens="<|eot_id|>, <|im_end|>")
  ids = [tok._tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")]
  assert tok.stop_ids == tuple(ids)  # eos, generation_config's, then these, each once
  with pytest.raises(ValueError, match="tokenizer.stop_tokens: .*'<\\|nope\\|>' is not in "
                                       "the vocabulary"):
    make_tokenizer("hf", CHAT, stop_tokens="<|nope|>")
  with pytest.raises(ValueError, match="tokenizer.stop_tokens: the char tokenizer takes none"):
    make_tokenizer("char", stop_tokens="x")


def test_generation_blocks_render_their_body():
  template = ("{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}"
              "{% endfor %}")
  assert chat.render(template, [{"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"}]) == "[a][b]"


def test_the_template_is_read_from_chat_template_jinja_first_then_the_configs(tmp_path):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_text(open(os.path.join(CHAT, name)).read())
  (tmp_path / chat.TEMPLATE_FILE).write_text("{{ messages[0]['content'] }}!")
  assert HFTokenizer(str(tmp_path), chat_template="auto").render_prompt("hi") == "hi!"
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = [{"name": "tool_use", "template": "no"},
                             {"name": "default", "template": "<{{ messages[0]['content'] }}>"}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  os.remove(tmp_path / chat.TEMPLATE_FILE)
  assert HFTokenizer(str(tmp_path), chat_template="auto").render_prompt("hi") == "<hi>"
  # An image-text model's processor file is the last place looked.
  del config["chat_template"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "chat_template.json").write_text(
      json.dumps({"chat_template": "({{ messages[0]['content'] }})"}))
  assert HFTokenizer(str(tmp_path), chat_template="auto").render_prompt("hi") == "(hi)"


def test_offered_tools_take_the_tokenizers_tool_use_template_as_transformers_picks_it(tmp_path):
  """transformers' apply_chat_template takes a tokenizer's "tool_use" template when tools are
  given (Hermes-2-Pro, Command-R); "default" alone dropped the tools silently."""
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_text(open(os.path.join(CHAT, name)).read())
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = [
      {"name": "default", "template": "<{{ messages[0]['content'] }}>"},
      {"name": "tool_use", "template": "{{ tools | tojson }}<{{ messages[0]['content'] }}>"}]
  config["sep_token"] = "<|im_end|>"  # every *_token the config names is a variable
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tools = [{"type": "function", "function": {"name": "add"}}]
  assert HFTokenizer(str(tmp_path), chat_template="auto").render_prompt("hi") == "<hi>"
  offered = HFTokenizer(str(tmp_path), chat_template="auto", tools=tools)
  assert offered.render_prompt("hi") == json.dumps(tools) + "<hi>"
  # Named templates kept in additional_chat_templates/ (transformers >= 4.54), by name too.
  del config["chat_template"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / chat.TEMPLATE_FILE).write_text("[{{ messages[0]['content'] }}]{{ sep_token }}")
  (tmp_path / chat.ADDITIONAL_DIR).mkdir()
  (tmp_path / chat.ADDITIONAL_DIR / "tool_use.jinja").write_text("T{{ tools | length }}")
  assert HFTokenizer(str(tmp_path), chat_template="auto").render_prompt("hi") == (
      "[hi]<|im_end|>")
  assert HFTokenizer(str(tmp_path), chat_template="auto", tools=tools).render_prompt("hi") == "T1"
  assert HFTokenizer(str(tmp_path), chat_template="tool_use", tools=tools).render_prompt(
      "hi") == "T1"
  saved = tmp_path / "saved"
  HFTokenizer(str(tmp_path), chat_template="auto").save(str(saved))
  assert (saved / chat.ADDITIONAL_DIR / "tool_use.jinja").read_text() == "T{{ tools | length }}"


def test_tools_a_template_never_renders_are_refused_naming_the_field():
  """A template that does not read `tools` (Gemma's, a plain ChatML one) offered them in no
  prompt, and the run went on without a word."""
  tools = [{"type": "function", "function": {"name": "add"}}]
  with pytest.raises(ValueError, match=r"^tokenizer.tools: the chat template renders no "
                                       r"tools .* \['add'\] would be offered in no prompt"):
    HFTokenizer(CHAT, chat_template="auto", tools=tools)


@pytest.mark.parametrize("make,match", [
    (lambda: HFTokenizer(os.path.join(FIXTURES, "tokenizer"), bos_token="<eos>",
                         chat_template="auto"),
     "tokenizer.chat_template: 'auto' found no chat template"),
    (lambda: HFTokenizer(CHAT, chat_template="/no/such.jinja"),
     "tokenizer.chat_template: .*no such file"),
    (lambda: make_tokenizer("char", chat_template="auto"),
     "tokenizer.chat_template: the char tokenizer takes none"),
    (lambda: make_tokenizer("hf", CHAT, chat_template="auto", chat_kwargs="{enable"),
     "tokenizer.chat_kwargs: expected a JSON object"),
    (lambda: make_tokenizer("hf", CHAT, chat_template="auto", chat_kwargs="[1]"),
     "tokenizer.chat_kwargs: expected a JSON object"),
])
def test_bad_settings_are_named(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_templates_and_messages_are_named(tmp_path):
  broken = tmp_path / "broken.jinja"
  broken.write_text("{% for m in messages %}")
  with pytest.raises(ValueError, match="tokenizer.chat_template: not a valid Jinja template"):
    HFTokenizer(CHAT, chat_template=str(broken)).render_prompt("hi")
  llama3 = tokenizer("llama3.jinja")
  with pytest.raises(ValueError, match="tokenizer.chat_template: rendering .* unknown role tool"):
    llama3.render_prompt([{"role": "tool", "content": "x"}])
  with pytest.raises(ValueError, match=r"prompt\[1\]: expected \{'role': str, 'content': str\}"):
    llama3.encode_prompt([{"role": "user", "content": "a"}, {"role": "user"}])
  with pytest.raises(ValueError, match="needs tokenizer.chat_template"):
    HFTokenizer(CHAT).encode_prompt([{"role": "user", "content": "a"}])
  with pytest.raises(ValueError, match="the char tokenizer takes text"):
    CharTokenizer().encode_prompt([{"role": "user", "content": "a"}])


def test_the_sandbox_refuses_reaching_python_internals():
  with pytest.raises(ValueError, match="tokenizer.chat_template: rendering"):
    chat.render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                [{"role": "user", "content": "a"}])


def test_jsonl_prompts_may_be_conversations(tmp_path):
  path = tmp_path / "train.jsonl"
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
  path.write_text(json.dumps({"prompt": messages, "answer": "3"}) + "\n"
                  + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
  records = read_prompts(str(path), default_task="addition")
  assert [r["prompt"] for r in records] == [messages, "2+2="]
  path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n"
                  + json.dumps({"prompt": [{"role": "user", "content": 3}], "answer": "3"}) + "\n")
  with pytest.raises(ValueError, match=r"train.jsonl:2: field 'prompt'\[0\]: expected"):
    read_prompts(str(path), default_task="addition")
  path.write_text(json.dumps({"prompt": [], "answer": "3"}) + "\n")
  with pytest.raises(ValueError, match=r"train.jsonl:1: field 'prompt': expected a non-empty"):
    read_prompts(str(path), default_task="addition")


@pytest.mark.parametrize("template, closer, role", [
    ("auto", "<|im_end|>", "tool"), ("llama3.jinja", "<|eot_id|>", "user"),
    ("gemma3.jinja", "<end_of_turn>", "user")])
@pytest.mark.parametrize("reply", ["46", ["46", "and 47"]], ids=["one", "two"])
def test_an_environments_reply_continues_the_conversation_as_the_template_renders_it(
    template, closer, role, reply):
  # The prompt, the policy's turn up to its closing token, then encode_reply: the ids of the
  # whole conversation rendered with the reply as the next message(s) (a template without a
  # tool role gets user messages) and the assistant's turn opened again.
  tok = tokenizer(template)
  user, said = "the sum of 12 and 34", "hello world"
  close = tok._tok.token_to_id(closer)
  replies = [reply] if isinstance(reply, str) else reply
  conversation = [{"role": "user", "content": user}, {"role": "assistant", "content": said}]
  conversation += [{"role": role, "content": r} for r in replies]
  if template == "gemma3.jinja" and len(replies) > 1:  # Gemma's roles must alternate
    with pytest.raises(ValueError, match="cannot render an environment's reply"):
      tok.encode_reply(reply, close)
    return
  ids = tok.encode_prompt(user) + tok.encode(said) + [close] + tok.encode_reply(reply, close)
  assert ids == tok.encode_prompt(conversation)
  # A turn closed by another stop token keeps the template's own closing after it.
  other = tok.encode_reply(reply, tok.pad_id)
  assert other[:1] == [close] and other[1:] == tok.encode_reply(reply, close)


TOOLS_TEMPLATE = ("{% for t in tools or [] %}{{ t | tojson }}\n{% endfor %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_FILE = '''from algorithms.tools import register_tool


@register_tool
def add(a: int, b: int) -> int:
  """Add two integers."""
  return a + b
'''


def test_the_tools_a_config_names_are_offered_in_every_prompt(tmp_path):
  from algorithms.tools import TOOLS
  path = tmp_path / "my_tools.py"
  path.write_text(TOOL_FILE)
  template = tmp_path / "tools.jinja"
  template.write_text(TOOLS_TEMPLATE)
  try:
    tok = make_tokenizer("hf", CHAT, chat_template=str(template), tools="add",
                         tool_modules=str(path))
    schema = ('{"type": "function", "function": {"name": "add", "description": "Add two '
              'integers.", "parameters": {"type": "object", "properties": {"a": {"type": '
              '"integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}')
    assert tok.render_prompt("hi") == (schema + "\n<|im_start|>user\nhi<|im_end|>\n"
                                       "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="tokenizer.tools: 'sub' is not a registered tool"):
      make_tokenizer("hf", CHAT, chat_template=str(template), tools="sub")
    with pytest.raises(ValueError, match="tokenizer.tools: tools are offered through a chat "
                                         "template"):
      make_tokenizer("hf", CHAT, tools="add")
    with pytest.raises(ValueError, match="tokenizer.tools: the char tokenizer takes none"):
      make_tokenizer("char", tools="add")
  finally:
    TOOLS.pop("add", None)


def test_a_reply_without_a_template_is_its_text_and_a_template_that_drops_a_turn_is_named():
  assert CharTokenizer().encode_reply("<result>4</result>", 2) == CharTokenizer().encode(
      "<result>4</result>")
  assert HFTokenizer(CHAT).encode_reply("46", 2) == HFTokenizer(CHAT).encode("46")
  rewrites = ("{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% endif %}"
              "{% endfor %}")
  tok = HFTokenizer(CHAT, chat_template="auto")
  tok.chat_template = rewrites
  with pytest.raises(ValueError, match="tokenizer.chat_template: cannot render an environment's "
                                       "reply .*expected the assistant's turn and then each "
                                       "reply"):
    tok.encode_reply("46", 2)


@pytest.mark.parametrize("key", ["tools", "add_generation_prompt", "messages", "bos_token"])
def test_chat_kwargs_that_rlax_ps_sets_itself_are_refused_naming_the_field(key):
  """tools made every prompt's render a TypeError; add_generation_prompt=false rendered
  prompts without the assistant's turn opened."""
  with pytest.raises(ValueError, match=rf"tokenizer.chat_kwargs: \['{key}'\] are set by "):
    make_tokenizer("hf", CHAT, chat_template="auto", chat_kwargs=json.dumps({key: False}))
  make_tokenizer("hf", CHAT, chat_template="auto", chat_kwargs='{"enable_thinking": false}')


PHI3_LIKE = ("{% for m in messages %}{% if m.role == 'user' %}<|user|>\n{{ m.content }}<|end|>\n"
             "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}<|end|>\n{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LLAMA31_TOOL = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'tool' %}"
                "{{ m.content | tojson }}{% else %}{{ m.content | trim }}{% endif %}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, role", [(PHI3_LIKE, "user"), (LLAMA31_TOOL, "tool")],
                         ids=["drops_unknown_roles", "filters_content"])
def test_a_reply_is_rendered_with_the_templates_own_roles_and_filters(tmp_path, template, role):
  """A template that silently drops a tool message (Phi-3's) gets the reply as a user one;
  one that filters a message's content (Llama 3's trim, 3.1's tojson on tool output) renders
  the reply's text through its filters, as apply_chat_template does: the reply's text was
  pasted into a frame rendered once, unfiltered."""
  path = tmp_path / "t.jinja"
  path.write_text(template)
  tok = HFTokenizer(CHAT, chat_template=str(path))
  for reply in ("  46\n", '{"x": 1}\nok'):
    full = tok.render_prompt([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "ZZ"},
                              {"role": role, "content": reply}])
    after_turn = full.partition("ZZ")[2]
    assert tok.decode(tok.encode_reply(reply, tok.pad_id), skip_special=False) == after_turn
    assert (f"<|{role}|>" if role == "user" else f"<|im_start|>{role}") in after_turn


def test_a_reply_follows_the_turn_as_sampled_where_the_template_rewrites_earlier_turns(tmp_path):
  # Like Qwen3's, this template writes an empty thinking block only into the last assistant
  # turn: once a reply follows, the turn renders without it. The reply's ids are what the
  # template puts after the turn; the turn stays as the policy sampled it.
  template = tmp_path / "thinks.jinja"
  template.write_text(
      "{% for m in messages %}<|im_start|>{{ m.role }}\n"
      "{% if m.role == 'assistant' and loop.last %}<think></think>{% endif %}"
      "{{ m.content }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  tok = HFTokenizer(CHAT, chat_template=str(template))
  close = tok._tok.token_to_id("<|im_end|>")
  reply = tok.encode_reply("46", close)
  full = tok.render_prompt([{"role": "user", "content": "q"},
                            {"role": "assistant", "content": "A"},
                            {"role": "tool", "content": "46"}])
  assert "<think>" not in full  # the earlier turn lost its block ...
  assert tok.decode(reply, skip_special=False) == full.split("A<|im_end|>", 1)[1]  # ... not us


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]


def test_add_generation_prompt_false_opens_no_assistant_turn():
  whole = chat.render(TEMPLATE, MESSAGES, add_generation_prompt=False)
  assert whole == "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
  assert chat.render(TEMPLATE, MESSAGES[:1]).endswith("<|im_start|>assistant\n")
