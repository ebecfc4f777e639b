"""tiktoken BPE files (Kimi K2's, Kimi-VL's and Moonlight's `tiktoken.model`) as a Hugging Face
`tokenizers.Tokenizer`, so that HFTokenizer reads those checkpoints as any other.

The file ranks byte strings (one base64 token and its rank a line). tiktoken splits text with
a regex that the checkpoint's Python class holds (not a file), then merges within each piece
the adjacent pair whose concatenation ranks lowest. Byte-level BPE over every (left, right)
split of each token, each merge ranked as the token it makes, with `ignore_merges` (a piece
that is a token whole is that token), encodes alike.
"""

from __future__ import annotations

import base64
import json
import os

TIKTOKEN_FILE = "tiktoken.model"

# Kimi's pre-tokenizer (tokenization_kimi.py / tokenization_moonshot.py): Han runs apart,
# words with their case and contractions, up to 3 digits, punctuation runs, whitespace.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# The regex of each remote-code tokenizer class that reads a tiktoken.model, by the module
# that tokenizer_config.json's auto_map names.
PATTERNS = {"tokenization_kimi": KIMI_PATTERN, "tokenization_moonshot": KIMI_PATTERN}
RESERVED_SPECIALS = 256  # the ids after the ranks that name special tokens (Kimi's count)


def has_tiktoken(directory: str) -> bool:
  return os.path.isfile(os.path.join(directory, TIKTOKEN_FILE))


def read_ranks(file: str) -> dict[bytes, int]:
  """The ranks of a tiktoken BPE file: {token bytes: rank}, ranks 0..n-1 (ValueError naming
  the file and line otherwise)."""
  ranks = {}
  with open(file, "rb") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
      except ValueError as e:
        raise ValueError(f"{file}:{number}: expected a base64 token and its rank ({e})") from None
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise ValueError(f"{file}: expected ranks 0..{len(ranks) - 1}, each once")
  return ranks


def _config(directory: str) -> dict:
  file = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{directory}: a {TIKTOKEN_FILE} needs its tokenizer_config.json "
                            f"(special tokens, tokenizer class)")
  with open(file) as f:
    return json.load(f)


def pattern_of(config: dict, directory: str) -> str:
  """The pre-tokenizer regex of the tokenizer class tokenizer_config.json's auto_map names."""
  names = (config.get("auto_map") or {}).get("AutoTokenizer") or [None]
  name = names[0] if isinstance(names, list) else names
  module = str(name).split(".")[0]
  if module not in PATTERNS:
    raise ValueError(f"{directory}/tokenizer_config.json: auto_map.AutoTokenizer: its "
                     f"{TIKTOKEN_FILE} splits text with the regex of {name!r}, code rlax-ps "
                     f"does not run; known: {sorted(PATTERNS)}")
  return PATTERNS[module]


def specials_of(config: dict, base: int) -> dict[int, str]:
  """{id: special token} after `base` ranks: tokenizer_config.json's added_tokens_decoder,
  the rest of the reserved ids named <|reserved_token_{id}|> (as Kimi's class names them)."""
  added = {int(i): v["content"] if isinstance(v, dict) else str(v)
           for i, v in (config.get("added_tokens_decoder") or {}).items()}
  low = [i for i in added if i < base]
  if low:
    raise ValueError(f"tokenizer_config.json: added_tokens_decoder: id {low[0]} is a BPE "
                     f"rank (< {base}), not a special token")
  top = max([base + RESERVED_SPECIALS - 1, *added])
  return {i: added.get(i, f"<|reserved_token_{i}|>") for i in range(base, top + 1)}


def tiktoken_tokenizer(directory: str):
  """The `tokenizers.Tokenizer` of the tiktoken.model in `directory` (with its
  tokenizer_config.json): byte-level BPE, the class's regex, its special tokens at their
  ids."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  config = _config(directory)
  pattern = pattern_of(config, directory)
  ranks = read_ranks(os.path.join(directory, TIKTOKEN_FILE))
  chars = _byte_chars()
  text = {token: "".join(chars[b] for b in token) for token in ranks}
  merges = sorted((rank, ranks[token[:i]], text[token[:i]], text[token[i:]])
                  for token, rank in ranks.items() for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks)
  tok = Tokenizer(models.BPE({text[t]: r for t, r in ranks.items()},
                             [(a, b) for _, _, a, b in merges], ignore_merges=True))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  specials = specials_of(config, len(ranks))
  tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)
                          for i in sorted(specials)])
  wrong = [(i, s) for i, s in specials.items() if tok.token_to_id(s) != i]
  if wrong:
    raise ValueError(f"{directory}/tokenizer_config.json: special token {wrong[0][1]!r} at id "
                     f"{wrong[0][0]}, which its BPE ranks hold as a token already")
  return tok


def _byte_chars() -> dict[int, str]:
  """GPT-2's byte -> printable char table (ByteLevel's): printable Latin-1 bytes stand for
  themselves, the others for chars from U+0100 on, in byte order."""
  table = {b: chr(b) for b in [*range(33, 127), *range(161, 173), *range(174, 256)]}
  for extra, b in enumerate(b for b in range(256) if b not in table):
    table[b] = chr(256 + extra)
  return table
