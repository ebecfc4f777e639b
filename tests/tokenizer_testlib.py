"""Tokenizers made in a test: a byte-level BPE (another tokenizer than the char one, which
gives back any text it is given), and the chat fixture's with special tool-call markers."""


def save_byte_level_tokenizer(folder):
  """A byte-level BPE of single bytes and no merges (257 ids: <eos>, then the 256 bytes)
  saved in `folder` as tokenizer.json and tokenizer_config.json: a character of two bytes
  is two tokens, neither of which decodes alone. Returns it as an HFTokenizer."""
  import json
  import os

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  from rlax_ps.tokenizers import HFTokenizer
  vocab = {c: i + 1 for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
  tok = Tokenizer(models.BPE({"<eos>": 0, **vocab}, []))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<eos>"])
  os.makedirs(folder, exist_ok=True)
  tok.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<eos>"}, f)
  return HFTokenizer(str(folder))


def special_marker_tokenizer(folder):
  """The chat fixture's tokenizer with `<tool_call>`, `</tool_call>` and `<|python_tag|>` as
  special tokens, as some Hermes and every Llama 3.1 checkpoint has them."""
  import os
  import shutil

  import tokenizers

  from rlax_ps.tokenizers import HFTokenizer
  chat = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "chat_tokenizer")
  tok = tokenizers.Tokenizer.from_file(os.path.join(chat, "tokenizer.json"))
  tok.add_special_tokens(["<tool_call>", "</tool_call>", "<|python_tag|>"])
  tok.save(os.path.join(folder, "tokenizer.json"))
  for name in ("tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(chat, name), folder)
  return HFTokenizer(str(folder))


def save_byte_fallback_tokenizer(folder):
  """A SentencePiece-style BPE with byte fallback (Llama 2's and Mistral's decoder: a
  character it has no piece for is its UTF-8 bytes, <0xE6> ...) trained on a few English
  words, saved in `folder`. Returns it as an HFTokenizer."""
  import json
  import os

  from tokenizers import Tokenizer, decoders, models, normalizers, trainers

  from rlax_ps.tokenizers import HFTokenizer
  tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                         normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4,
                          trainers.BpeTrainer(vocab_size=80, show_progress=False,
                                              special_tokens=["<unk>", "<s>", "</s>"]))
  saved = json.loads(tok.to_str())
  vocab = saved["model"]["vocab"]
  for i in range(256):  # the byte pieces, in the model's vocabulary as SentencePiece's are
    vocab.setdefault(f"<0x{i:02X}>", len(vocab))
  os.makedirs(folder, exist_ok=True)
  Tokenizer.from_str(json.dumps(saved)).save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
  return HFTokenizer(str(folder))
