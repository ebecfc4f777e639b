"""Tokenizers behind one interface: a character-level one for the built-in tasks, and
Hugging Face `tokenizer.json` files through the `tokenizers` package.

Both give `encode(text) -> list[int]`, `encode_prompt(prompt) -> list[int]` (a prompt as
the model sees it: [bos] text, or a conversation through the chat template),
`encode_reply(text, after)` (an environment's reply to a turn, as the next message),
`decode(ids) -> str`, `bos_id`, `eos_id`, `stop_ids`, `turn_end_id`, `pad_id`, `vocab_size` and
`save(directory)` (Hugging Face files beside an exported model), so the trainer, the
sampler and the verifiers never care which one they hold.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import string
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from rlax_ps import chat
from rlax_ps.tiktoken_bpe import TIKTOKEN_FILE, has_tiktoken, tiktoken_tokenizer

# Printable ASCII without the tab/vertical-tab/form-feed/carriage-return controls.
DEFAULT_ALPHABET = "".join(c for c in string.printable if c not in "\t\x0b\x0c\r")

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class Tokenizer(Protocol):
  """What every tokenizer offers."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def bos_id(self) -> int | None: ...  # None: prompts start with no bos

  @property
  def eos_id(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def stop_ids(self) -> tuple[int, ...]: ...

  @property
  def turn_end_id(self) -> int: ...  # the stop token that ends an assistant's turn

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

  def render_prompt(self, prompt: str | list[dict[str, str]]) -> str: ...

  def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]: ...

  def encode_reply(self, text: str | Sequence[str | Mapping[str, str]], after: int
                   ) -> list[int]: ...

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str: ...

  def save(self, directory: str) -> str: ...

  @property
  def identity(self) -> str: ...  # what maps text to ids and back, as a digest


class CharTokenizer:
  """One id per character: ids 0, 1, 2 are <pad>, <bos>, <eos>; then the alphabet in order."""

  def __init__(self, alphabet: str = DEFAULT_ALPHABET):
    if len(set(alphabet)) != len(alphabet):
      dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
      raise ValueError(f"CharTokenizer alphabet: expected distinct characters, got "
                       f"duplicates {dupes!r}")
    if not alphabet:
      raise ValueError("CharTokenizer alphabet: expected at least one character, got ''")
    self.alphabet = alphabet
    self.specials = (PAD, BOS, EOS)
    self._ids = {c: i + len(self.specials) for i, c in enumerate(alphabet)}
    # id by code point, -1 where none; the last entry stands for every code point past it.
    self._table = np.full(max(map(ord, alphabet)) + 2, -1, np.int32)
    self._table[[ord(c) for c in alphabet]] = np.arange(len(alphabet)) + len(self.specials)

  @property
  def vocab_size(self) -> int:
    return len(self.specials) + len(self.alphabet)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  @property
  def turn_end_id(self) -> int:
    return self.eos_id

  def render_prompt(self, prompt: str | list[dict[str, str]]) -> str:
    """The text itself; a conversation needs a chat template, which this tokenizer has not."""
    if not isinstance(prompt, str):
      raise ValueError(f"prompt: a list of messages needs an HF tokenizer with "
                       f"tokenizer.chat_template set; the char tokenizer takes text, got "
                       f"{prompt!r}")
    return prompt

  def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
    """[bos] + the prompt's ids."""
    return self.encode(self.render_prompt(prompt), add_bos=True)

  def encode_reply(self, text: str | Sequence[str | Mapping[str, str]], after: int
                   ) -> list[int]:
    """An environment's reply after a turn the policy ended: the text's ids (no template;
    several replies, or messages' contents, joined by newlines)."""
    del after
    return self.encode(text if isinstance(text, str) else "\n".join(
        m["content"] if isinstance(m, Mapping) else m for m in text))

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """The characters' ids, looked up all at once by code point (one per character of the
    str, a lone surrogate included, which no alphabet holds)."""
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    ids = self._table.take(points, mode="clip")
    if len(ids) and ids.min() < 0:
      pos = int(np.argmax(ids < 0))
      raise ValueError(f"CharTokenizer.encode: character {text[pos]!r} at position {pos} of "
                       f"{text!r} is not in the alphabet")
    return ([self.bos_id] if add_bos else []) + ids.tolist() + ([self.eos_id] if add_eos else [])

  @property
  def identity(self) -> str:
    """A digest of what maps text to ids and back (the alphabet), the same on every machine:
    a worker whose differs from the trainer's samples in another vocabulary."""
    return "char:" + hashlib.blake2b(self.alphabet.encode("utf-8", "surrogatepass"),
                                     digest_size=16).hexdigest()

  @property
  def fingerprint(self) -> str:
    """A digest of what encode_prompt depends on (the alphabet): a cached check of prompt
    lengths (rl_checks.check_prompt_lengths) holds for this tokenizer alone."""
    return self.identity

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
    out = []
    n = len(self.specials)
    for i in ids:
      i = int(i)
      if i < 0 or i >= self.vocab_size:
        raise ValueError(f"CharTokenizer.decode: id {i} outside [0, {self.vocab_size})")
      if i < n:
        if not skip_special:
          out.append(self.specials[i])
      else:
        out.append(self.alphabet[i - n])
    return "".join(out)

  @property
  def vocab(self) -> dict[str, int]:
    """token -> id: the specials, then the alphabet."""
    return {**{tok: i for i, tok in enumerate(self.specials)}, **self._ids}

  def check_checkpoint(self, checkpoint: str) -> None:
    """ValueError naming tokenizer.kind when the Hugging Face checkpoint folder `checkpoint`
    ships a tokenizer.json other than this one's (its model was trained on other ids), or
    ships none and embeds more ids than this one has (another tokenizer's model: it would
    sample ids this one cannot decode); FileNotFoundError when it has no config.json."""
    file = os.path.join(checkpoint, "tokenizer.json")
    if has_tiktoken(checkpoint) and not os.path.isfile(file):
      raise ValueError(f"tokenizer.kind: 'char' (the built-in character tokenizer) is not "
                       f"the tokenizer of the checkpoint {checkpoint} (its {TIKTOKEN_FILE}: "
                       f"a tiktoken BPE); set --config.tokenizer.kind=hf to use the "
                       f"checkpoint's")
    if not os.path.isfile(file):
      self._check_vocab_size(checkpoint)
      return
    with open(file) as f:
      model = json.load(f).get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") == "WordLevel" and vocab == self.vocab:
      return
    raise ValueError(f"tokenizer.kind: 'char' (the built-in character tokenizer, "
                     f"{self.vocab_size} ids) is not the tokenizer of the checkpoint "
                     f"{checkpoint} (its tokenizer.json: a {model.get('type', '?')} model of "
                     f"{len(vocab or ())} tokens); set --config.tokenizer.kind=hf to use the "
                     f"checkpoint's")

  def _check_vocab_size(self, checkpoint: str) -> None:
    """ValueError when the config.json of `checkpoint` (which ships no tokenizer.json) has a
    vocab_size above this tokenizer's."""
    config = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(config):
      raise FileNotFoundError(f"no config.json in HF checkpoint folder {checkpoint!r}")
    with open(config) as f:
      d = json.load(f)
    vocab = d.get("vocab_size") or (d.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int) and vocab > self.vocab_size:
      raise ValueError(f"tokenizer.kind: 'char' (the built-in character tokenizer, "
                       f"{self.vocab_size} ids) is not the tokenizer of the checkpoint "
                       f"{checkpoint} (its config.json: vocab_size {vocab}, and no "
                       f"tokenizer.json); set --config.tokenizer.kind=hf and "
                       f"--config.tokenizer.path to its tokenizer")

  def save(self, directory: str) -> str:
    """Write an equivalent Hugging Face `tokenizer.json` (loadable by HFTokenizer and by
    `transformers`), so an exported model ships with its tokenizer. Its post-processor
    starts each text with <bos>, as encode_prompt does: transformers and vLLM then give
    the exported model the prompt ids it was trained on."""
    from tokenizers import Regex, Tokenizer as _HFTok, decoders, models, pre_tokenizers
    from tokenizers import processors

    tok = _HFTok(models.WordLevel(self.vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "." skips \n
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(self.specials))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, self.bos_id)])
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, f, indent=1)
    return path


# The files of a Hugging Face tokenizer that HFTokenizer.save copies along when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", chat.TEMPLATE_FILE, "chat_template.json", "vocab.json",
                   "merges.txt", "tokenizer.model", TIKTOKEN_FILE)


def tokenizer_file(directory: str) -> str | None:
  """The tokenizer a checkpoint folder ships: its tokenizer.json, else its tiktoken.model
  (Kimi K2, Moonlight), else None."""
  for name in ("tokenizer.json", TIKTOKEN_FILE):
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None


def other_ids(tokenizer: CharTokenizer | HFTokenizer, checkpoint: str) -> str:
  """Why the tokenizer a checkpoint folder ships gives other ids than `tokenizer` ("" when
  it gives the same, or ships none): a model of that folder scores ids of its own."""
  file = tokenizer_file(checkpoint)
  if file is None:
    return ""
  from tokenizers import Tokenizer as _HFTok
  try:
    theirs = (tiktoken_tokenizer(checkpoint) if os.path.basename(file) == TIKTOKEN_FILE
              else _HFTok.from_file(file)).get_vocab(with_added_tokens=True)
  except Exception as e:  # (the tokenizers package raises plain Exceptions)
    return f"its tokenizer ({file}) cannot be read: {e}"
  mine = (tokenizer.vocab if isinstance(tokenizer, CharTokenizer)
          else tokenizer._tok.get_vocab(with_added_tokens=True))
  if theirs == mine:
    return ""
  return (f"its tokenizer ({file}, {len(theirs)} tokens) gives other ids than the policy's "
          f"({len(mine)} tokens)")


# Special-token spellings tried, in order, when tokenizer_config.json does not name them.
_EOS_GUESSES = ("<|end_of_text|>", "<|endoftext|>", "</s>", EOS, "<|im_end|>", "<|eot_id|>")
_PAD_GUESSES = ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>", "<|endoftext|>", "<unk>")


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # {"content": "<s>", "lstrip": ...} in older configs.
    return value.get("content")
  return value


# tokenizer_config.json classes that transformers 5 builds anew from tokenizer.json's
# vocabulary and merges, with a SentencePiece-like pipeline of its own in place of the
# file's (Llama 1 and 2, Mistral v0.x, Yi, TinyLlama: transformers 4 read the file's),
# unless the file is byte-level (a Llama-3 one so labelled: read as it is).
_METASPACE_CLASSES = frozenset({"LlamaTokenizer", "LlamaTokenizerFast"})


def _byte_level(file: str) -> bool:
  """Whether tokenizer.json `file` names a ByteLevel part anywhere, as transformers asks."""
  with open(file, encoding="utf-8") as f:
    return '"ByteLevel"' in f.read()


def _as_transformers_rebuilds(tok, cfg: Mapping[str, Any]) -> None:
  """Give `tok` (a tokenizers.Tokenizer of a BPE model) the pre-tokenizer and decoder that
  transformers 5's LlamaTokenizer gives it: no normalizer, a "▁" before the first word
  only (before each, with tokenizer_config's legacy: true; none without add_prefix_space)
  and spaces as "▁"; post-processor and added tokens as the file has them."""
  from tokenizers import decoders, pre_tokenizers
  if type(tok.model).__name__ != "BPE":
    return
  prefix = cfg.get("add_prefix_space")
  prefix = True if prefix is None else bool(prefix)
  scheme = ("always" if cfg.get("legacy", False) else "first") if prefix else "never"
  tok.normalizer = None
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme,
                                               split=False)
  tok.decoder = decoders.Sequence(
      [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
      + ([decoders.Strip(" ", 1, 0)] if prefix else []))


class HFTokenizer:
  """A Hugging Face `tokenizer.json` (via the `tokenizers` package) with bos/eos/pad ids.

  Special tokens come from the arguments, else the sibling `tokenizer_config.json`, else
  (eos and pad) common spellings; pad falls back to eos, as for Llama checkpoints that have
  no pad token. A text prompt is encoded as transformers' (5.x) AutoTokenizer encodes it
  (a LlamaTokenizer's pipeline as it rebuilds it, _as_transformers_rebuilds):
  with the special tokens of tokenizer.json's post-processor (a Llama-3 or Gemma bos,
  or none, whatever tokenizer_config.json's add_bos_token says, which transformers 5 ignores
  beside a tokenizer.json). bos_id is the named bos, else the one the post-processor puts
  first, else None (prompts then start with their text).
  Generation stops at eos, at every `eos_token_id` of a sibling generation_config.json
  (instruct models end a turn with their own token) and at each of `stop_tokens`.
  `chat_template` ("auto" or a .jinja path; rlax_ps.chat) renders prompts as a
  conversation, with `chat_kwargs` as template variables (e.g. {"enable_thinking": False})
  and `tools` (function schemas, `algorithms.tools`) as the tools it offers the model.
  """

  def __init__(self, path: str, *, bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None, chat_template: str = "",
               chat_kwargs: Mapping[str, Any] | None = None, stop_tokens: Sequence[str] = (),
               tools: Sequence[Mapping[str, Any]] | None = None):
    from tokenizers import Tokenizer as _HFTok

    file = tokenizer_file(path) if os.path.isdir(path) else path
    if file is None or not os.path.exists(file):
      raise FileNotFoundError(f"HFTokenizer path: expected a tokenizer.json (or "
                              f"{TIKTOKEN_FILE}) file or a directory holding one, got {path!r}")
    self.path = file
    if os.path.basename(file) == TIKTOKEN_FILE:
      self._tok = tiktoken_tokenizer(os.path.dirname(file))
    else:
      try:
        self._tok = _HFTok.from_file(file)
      except Exception as e:  # (the tokenizers package raises plain Exceptions)
        raise ValueError(f"{file}: not a tokenizer the tokenizers package can read: {e}"
                         ) from None
    cfg = {}
    cfg_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    if os.path.exists(cfg_file):
      try:
        with open(cfg_file) as f:
          cfg = json.load(f)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
      if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("tokenizer_class") in _METASPACE_CLASSES and not _byte_level(file):
      _as_transformers_rebuilds(self._tok, cfg)
    named = {kind: given or _token_text(cfg.get(f"{kind}_token")) for kind, given in
             (("bos", bos_token), ("eos", eos_token), ("pad", pad_token))}
    bos = named["bos"]
    self._bos = (self._resolve("bos", bos, ()) if bos is not None
                 else _leading_special(self._tok))
    self._eos = self._resolve("eos", named["eos"], _EOS_GUESSES)
    pad = self._resolve("pad", named["pad"], _PAD_GUESSES, required=False)
    self._pad = self._eos if pad is None else pad
    directory = os.path.dirname(file)
    extra = [self._tok.token_to_id(t) for t in stop_tokens]
    unknown = [t for t, i in zip(stop_tokens, extra) if i is None]
    if unknown:
      raise ValueError(f"tokenizer.stop_tokens: {unknown[0]!r} is not in the vocabulary of "
                       f"{self.path}")
    self._stops = tuple(dict.fromkeys([self._eos, *_generation_eos_ids(directory), *extra]))
    self.chat_template = (chat.read_template(chat_template, directory, tools=bool(tools))
                          if chat_template else None)
    self.chat_kwargs = dict(chat_kwargs or {})
    if tools and self.chat_template is None:
      raise ValueError("tokenizer.tools: tools are offered through a chat template; set "
                       "tokenizer.chat_template")
    self.tools = list(tools) if tools else None
    self._reply_roles: dict[int, str] = {}  # replies in a row -> the role they render as
    # The special tokens a template sees by name: those the arguments or tokenizer_config.json
    # name (unk, sep, cls, mask too), as transformers passes them (a guessed one renders as
    # nothing there).
    self._special = {key: text for key, text in ((k, _token_text(v)) for k, v in cfg.items()
                                                 if k.endswith("_token"))
                     if isinstance(text, str)}
    self._special.update({f"{kind}_token": name for kind, name in named.items()
                          if name is not None})
    if self.tools:  # a template that never reads `tools` (Gemma's, a plain ChatML one)
      def probe(tools):
        return chat.render(self.chat_template, [{"role": "user", "content": "1+1"}],
                           special_tokens=self._special, tools=tools, **self.chat_kwargs)
      offered = probe(self.tools)
      try:
        plain = probe(None)
      except Exception:  # noqa: BLE001 - one that fails without tools reads them
        plain = None
      if offered == plain:
        raise ValueError(f"tokenizer.tools: the chat template renders no tools (it does not "
                         f"read `tools`), so {[t['function']['name'] for t in self.tools]} "
                         f"would be offered in no prompt; name a template that does "
                         f"(tokenizer.chat_template=FILE.jinja) or describe the tools in the "
                         f"prompts")

  def _resolve(self, kind, name, guesses, required=True):
    if name is not None:
      i = self._tok.token_to_id(name)
      if i is None:
        raise ValueError(f"HFTokenizer {kind}_token: {name!r} is not in the vocabulary of "
                         f"{self.path}")
      return i
    for guess in guesses:
      i = self._tok.token_to_id(guess)
      if i is not None:
        return i
    if required:
      raise ValueError(f"HFTokenizer {kind}_token: not set and none of {list(guesses)} is in "
                       f"the vocabulary of {self.path}; pass {kind}_token=...")
    return None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> int | None:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self._stops

  @functools.cached_property
  def turn_end_id(self) -> int:
    """The stop token that ends an assistant's turn: the first the chat template renders
    after the turn's text where that is a stop id (Gemma's <end_of_turn>, Llama 3's
    <|eot_id|>, whose eos_token may be another), else eos_id."""
    if self.chat_template is None:
      return self.eos_id
    try:
      after = self.encode(self._render_after_turn([]))
    except ValueError:  # a template refusing the probe conversation
      return self.eos_id
    return after[0] if after and after[0] in self._stops else self.eos_id

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    bos = [self.bos_id] if add_bos and self.bos_id is not None else []
    return bos + ids + ([self.eos_id] if add_eos else [])

  @property
  def identity(self) -> str:
    """A digest of what maps text to ids and back (tokenizer.json, the chat template with its
    variables and tools, the special tokens), the same on every machine: a worker whose
    differs from the trainer's samples in another vocabulary."""
    with open(self.path, "rb") as f:
      digest = hashlib.blake2b(f.read(), digest_size=16)
    digest.update(json.dumps([self.chat_template, self.chat_kwargs, self.tools, self._special],
                             sort_keys=True, default=repr).encode())
    return "hf:" + digest.hexdigest()

  @property
  def fingerprint(self) -> str:
    """A digest of what encode_prompt depends on: the identity, the `tokenizers` version and
    the date where the template reads the clock: a cached check of prompt lengths holds for
    this one alone."""
    import tokenizers
    today = (datetime.date.today().isoformat()
             if self.chat_template and "strftime_now" in self.chat_template else "")
    return "hf:" + hashlib.blake2b(json.dumps([self.identity, tokenizers.__version__, today])
                                   .encode(), digest_size=16).hexdigest()

  def render_prompt(self, prompt: str | list[dict[str, str]]) -> str:
    """The prompt text the model sees: with a chat template, a text prompt is one user
    message and the assistant's turn is opened; without one, the text itself."""
    if self.chat_template is None:
      if not isinstance(prompt, str):
        raise ValueError(f"prompt: a list of messages needs tokenizer.chat_template ('auto' "
                         f"or a .jinja file), got {prompt!r}")
      return prompt
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else chat.check_messages(prompt))
    return chat.render(self.chat_template, messages, special_tokens=self._special,
                       tools=self.tools, **self.chat_kwargs)

  def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
    """The prompt's ids: the text with the post-processor's special tokens (transformers'
    encode), or the rendered conversation without them (its template places any bos
    itself, as transformers' apply_chat_template encodes it)."""
    text = self.render_prompt(prompt)
    return self._tok.encode(text, add_special_tokens=self.chat_template is None).ids

  def encode_conversation(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """A whole conversation's ids under the chat template, no turn opened after it (what
    transformers' apply_chat_template(messages, tokenize=True) gives): what a reward
    model reads."""
    if self.chat_template is None:
      raise ValueError("encode_conversation: expected a tokenizer with a chat template")
    text = chat.render(self.chat_template, chat.check_messages(list(messages)),
                       special_tokens=self._special, add_generation_prompt=False,
                       tools=self.tools, **self.chat_kwargs)
    return self.encode(text)

  def encode_reply(self, text: str | Sequence[str | Mapping[str, str]], after: int
                   ) -> list[int]:
    """The ids that follow a turn the policy ended with token `after`: the environment's
    reply `text` as the next message (a list: as that many messages), each a "tool"
    message (a "user" one where the template renders no tool role; a message given as a
    {"role", "content"} dict keeps its role, a demonstration's user turn), and the
    assistant's turn opened again, as the chat template renders that conversation (its own
    filters on the content, `trim` or `tojson`, applied); without a template, the text's
    ids (a list joined by newlines). No replies (an empty list): the framing between two
    assistant turns.

    Only what follows the turn is taken: a template may render earlier turns differently
    once more follow (Qwen3 drops an empty thinking block), but the policy has already seen
    them as they were sampled; the turn's closing token (`after`) is left out where the
    template opens the rest with it."""
    items = [text] if isinstance(text, str) else list(text)
    texts = [m["content"] if isinstance(m, Mapping) else m for m in items]
    if self.chat_template is None:
      return self.encode("\n".join(texts))
    tools = sum(not isinstance(m, Mapping) or m["role"] == "tool" for m in items)
    role = self._reply_roles.get(tools) or self._reply_role(tools)
    self._reply_roles[tools] = role
    framed = self._render_after_turn([
        {"role": m["role"] if isinstance(m, Mapping) and m["role"] != "tool" else role,
         "content": t} for m, t in zip(items, texts)])
    closing = self.decode([after], skip_special=False)
    if closing and framed.startswith(closing):
      framed = framed[len(closing):]
    return self.encode(framed)

  _TURN = "\ue000"  # the assistant turn's stand-in: a private-use character no template writes

  def _render_after_turn(self, messages: list[dict[str, str]]) -> str:
    """What the template renders after an assistant turn when `messages` follow it."""
    turn = [{"role": "user", "content": "\ue002"}, {"role": "assistant", "content": self._TURN}]
    return chat.render(self.chat_template, turn + messages, special_tokens=self._special,
                       tools=self.tools, **self.chat_kwargs).partition(self._TURN)[2]

  def _reply_role(self, count: int) -> str:
    """"tool", or "user" where the template refuses a tool message or renders it without its
    content (Phi-3's drops any role it does not know): the role `count` replies take."""
    replies = [chr(0xE100 + i) for i in range(count)]
    errors = []
    for role in ("tool", "user"):
      try:
        framed = self._render_after_turn([{"role": role, "content": r} for r in replies])
      except ValueError as e:
        errors.append(str(e))
        continue
      if framed and all(framed.count(r) == 1 for r in replies) and all(
          framed.index(a) < framed.index(b) for a, b in zip(replies, replies[1:])):
        return role
      errors.append("expected the assistant's turn and then each reply, once and in order, "
                    "in the rendered conversation")
    raise ValueError(f"tokenizer.chat_template: cannot render an environment's reply as a "
                     f"tool or user message: {errors[-1]}")

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def save(self, directory: str) -> str:
    """Copy this tokenizer's files (tokenizer.json and the files beside it that transformers
    reads: its config, special tokens, chat templates, vocabularies; a tiktoken.model with
    its tokenizer class's code, and the tokenizer.json made of it) to `directory`, and the
    chat template it renders with, if set, as chat_template.jinja."""
    import shutil

    source = os.path.dirname(self.path)
    os.makedirs(directory, exist_ok=True)
    code = [n for n in os.listdir(source) if n.startswith("tokenization_") and n.endswith(".py")]
    for name in (*TOKENIZER_FILES, *code):
      if os.path.isfile(os.path.join(source, name)):
        shutil.copy(os.path.join(source, name), os.path.join(directory, name))
    if os.path.basename(self.path) == TIKTOKEN_FILE:
      self._tok.save(os.path.join(directory, "tokenizer.json"))
    elif os.path.basename(self.path) != "tokenizer.json":
      shutil.copy(self.path, os.path.join(directory, "tokenizer.json"))
    extra = os.path.join(source, chat.ADDITIONAL_DIR)
    if os.path.isdir(extra):
      shutil.copytree(extra, os.path.join(directory, chat.ADDITIONAL_DIR), dirs_exist_ok=True)
    if self.chat_template is not None:
      with open(os.path.join(directory, chat.TEMPLATE_FILE), "w") as f:
        f.write(self.chat_template)
    return os.path.join(directory, "tokenizer.json")


def _leading_special(tok) -> int | None:
  """The special token a tokenizer.json's post-processor puts before a text, or None."""
  plain = tok.encode("a", add_special_tokens=False).ids
  full = tok.encode("a", add_special_tokens=True).ids
  if len(full) > len(plain) and full[1:1 + len(plain)] == plain:
    return full[0]
  return None


def _generation_eos_ids(directory: str) -> list[int]:
  """generation_config.json's eos_token_id (an id or a list) in `directory`, if any."""
  file = os.path.join(directory, "generation_config.json")
  if not os.path.isfile(file):
    return []
  with open(file) as f:
    ids = json.load(f).get("eos_token_id")
  ids = [ids] if isinstance(ids, int) else (ids or [])
  if not all(isinstance(i, int) and i >= 0 for i in ids):
    raise ValueError(f"{file}: eos_token_id: expected token ids, got {ids!r}")
  return ids


# What every render is given: chat_kwargs may not set them.
_RENDER_ARGS = ("messages", "tools", "documents", "add_generation_prompt")


def make_tokenizer(kind: str, path: str = "", alphabet: str = "", *, chat_template: str = "",
                   chat_kwargs: str | Mapping[str, Any] = "", stop_tokens: str = "",
                   tools: str = "", tool_modules: str = "") -> CharTokenizer | HFTokenizer:
  """From config: kind "char" (optional alphabet) or "hf" (path to tokenizer.json or its
  dir, optional chat template and its variables as a dict or JSON text, extra stop tokens,
  comma-separated, and the registered tools its prompts offer, comma-separated, after
  importing the files `tool_modules` names: worker.verifiers)."""
  if kind == "char":
    for field, value in (("chat_template", chat_template), ("stop_tokens", stop_tokens),
                         ("tools", tools)):
      if value:
        raise ValueError(f"tokenizer.{field}: the char tokenizer takes none; expected '' or "
                         f"kind='hf', got {value!r}")
    return CharTokenizer(alphabet or DEFAULT_ALPHABET)
  if kind == "hf":
    if not path:
      raise ValueError("tokenizer.path: expected a tokenizer.json path for kind='hf', got ''")
    if isinstance(chat_kwargs, str):
      try:
        chat_kwargs = json.loads(chat_kwargs) if chat_kwargs else {}
      except json.JSONDecodeError as e:
        raise ValueError(f"tokenizer.chat_kwargs: expected a JSON object, got "
                         f"{chat_kwargs!r} ({e})") from None
    if not isinstance(chat_kwargs, Mapping):
      raise ValueError(f"tokenizer.chat_kwargs: expected a JSON object, got {chat_kwargs!r}")
    reserved = sorted(k for k in chat_kwargs if k in _RENDER_ARGS or k.endswith("_token"))
    if reserved:  # (render's own arguments: a TypeError, or prompts without the turn opened)
      raise ValueError(f"tokenizer.chat_kwargs: {reserved} are set by rlax-ps itself (the "
                       f"messages, tokenizer.tools, the turn it opens, the special tokens); "
                       f"expected the template's own variables, e.g. enable_thinking")
    stops = [t.strip() for t in stop_tokens.split(",") if t.strip()]
    schemas = None
    if tools:
      from algorithms.tools import tool_schemas
      from algorithms.verifiers import load_verifiers
      load_verifiers(tool_modules, "worker.verifiers")
      schemas = tool_schemas(tools)
    return HFTokenizer(path, chat_template=chat_template, chat_kwargs=chat_kwargs,
                       stop_tokens=stops, tools=schemas)
  raise ValueError(f"tokenizer.kind: expected 'char' or 'hf', got {kind!r}")


def tokenizer_from_config(block: Mapping[str, Any] | None, default_path: str = "",
                          tool_modules: str = "") -> CharTokenizer | HFTokenizer:
  """The tokenizer a config's `tokenizer` block names (kind, path, alphabet, chat_template,
  chat_kwargs, stop_tokens, tools); `default_path` (the HF checkpoint started from) when it
  names no path; `tool_modules` (worker.verifiers) define the tools. The char tokenizer is
  refused for a checkpoint that ships another tokenizer, or none and more ids."""
  block = block or {}
  tokenizer = make_tokenizer(str(block.get("kind", "char")), str(block.get("path", "") or default_path),
                        str(block.get("alphabet", "")),
                        chat_template=str(block.get("chat_template", "")),
                        chat_kwargs=block.get("chat_kwargs", ""),
                        stop_tokens=str(block.get("stop_tokens", "")),
                        tools=str(block.get("tools", "")), tool_modules=tool_modules)
  if isinstance(tokenizer, CharTokenizer) and default_path:
    tokenizer.check_checkpoint(default_path)
  return tokenizer

