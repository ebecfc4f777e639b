"""`rlax-ps eval` on odd inputs: every checkpoint is checked (config, tensor names, tokenizer
against the model's vocabulary) before any is evaluated, and the table takes no results."""

import os
import shutil
import subprocess
import sys

import pytest

from child_env import child_env
from rlax_ps import config_files
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer
from rlax_ps.train import eval_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf")


def tiny_config():
  """configs/rl_local.py:tiny, as `rlax-ps eval --config=configs/rl_local.py:tiny` reads it."""
  return config_files.load(os.path.join(REPO, "configs", "rl_local.py"), "tiny")


def llama_copy(tmp_path, tokenizer_from=None):
  """The llama fixture (vocab_size 96, no tokenizer) copied, with another fixture's
  tokenizer files beside it."""
  path = tmp_path / "llama"
  shutil.copytree(os.path.join(FIXTURES, "llama"), path)
  for f in ("tokenizer.json", "tokenizer_config.json"):
    if tokenizer_from and os.path.isfile(os.path.join(FIXTURES, tokenizer_from, f)):
      shutil.copy(os.path.join(FIXTURES, tokenizer_from, f), path / f)
  return str(path)


def test_the_table_of_no_results_says_so():
  assert eval_main.table({}) == "held-out: no checkpoints evaluated"


def test_a_tokenizer_with_ids_the_model_cannot_embed_is_refused_before_evaluating(tmp_path):
  # The chat tokenizer has 336 ids, the llama fixture embeds 96: ids past 95 would be
  # clamped into the embedding table and scored as if nothing were wrong.
  path = llama_copy(tmp_path, "chat_tokenizer")
  result = subprocess.run(
      [sys.executable, "-m", "rlax_ps", "eval", "--config=configs/rl_local.py:tiny",
       f"--checkpoints={path}"], cwd=REPO, capture_output=True, text=True, timeout=120,
      env=child_env())
  assert result.returncode == 2, result.stdout + result.stderr
  assert ("config.json vocab_size: expected at least 336 (the hf tokenizer's ids), got 96"
          in result.stderr), result.stderr
  assert "Traceback" not in result.stderr


def test_a_checkpoint_without_a_tokenizer_is_not_read_with_a_char_tokenizer_of_other_size(
    tmp_path):
  path = llama_copy(tmp_path)
  with pytest.raises(ValueError, match=(
      r"config.json vocab_size: expected 99 \(the char tokenizer's ids\), got 96; it ships no "
      r"tokenizer.json, so set --config.tokenizer.kind=hf")):
    eval_main.check_checkpoint(tiny_config(), path)
  config = tiny_config()
  config.tokenizer.alphabet = "".join(chr(33 + i) for i in range(93))  # 96 ids with specials
  assert isinstance(eval_main.check_checkpoint(config, path), CharTokenizer)


def test_a_checkpoint_shipping_a_chat_template_scored_on_raw_prompts_is_said(tmp_path, capsys):
  """An instruct export scored with a config that renders prompts raw (rl_local.py's, where
  the run trained with tokenizer.chat_template=auto) scores what it was not trained on:
  said on stderr; with the template, nothing is said."""
  path = llama_copy(tmp_path, "chat_tokenizer")
  config = tiny_config()
  assert eval_main.checkpoint_tokenizer(config, path).chat_template is None
  assert f"rlax-ps eval: {path} ships a chat template, but its prompts are scored raw" in (
      capsys.readouterr().err)
  config.tokenizer.chat_template = "auto"
  assert eval_main.checkpoint_tokenizer(config, path).chat_template
  assert capsys.readouterr().err == ""
  eval_main.checkpoint_tokenizer(tiny_config(), llama_copy(tmp_path / "b"))  # char: no template
  assert capsys.readouterr().err == ""


def test_a_checkpoint_with_its_own_smaller_tokenizer_is_read_with_it(tmp_path):
  path = llama_copy(tmp_path)
  CharTokenizer("0123456789+ ").save(path)
  tokenizer = eval_main.check_checkpoint(tiny_config(), path)
  assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == 15


def test_a_checkpoint_missing_a_tensor_is_named_before_evaluating(tmp_path):
  path = llama_copy(tmp_path)
  os.remove(os.path.join(path, "model.safetensors"))
  shutil.copy(os.path.join(FIXTURES, "qwen2", "model.safetensors"), path)
  with pytest.raises(ValueError, match=f"checkpoint {path}: .*missing tensor"):
    eval_main.check_checkpoint(tiny_config(), path)


def test_empty_checkpoint_entries_are_left_out():
  assert eval_main._paths(["a", "", " ", "b"]) == ["a", "b"]  # pylint: disable=protected-access
  with pytest.raises(Exception, match=r"not found: \(none\)"):
    eval_main._checkpoints_exist(["", " "])  # pylint: disable=protected-access


def run_eval(*args):
  return subprocess.run([sys.executable, "-m", "rlax_ps", "eval",
                         "--config=configs/rl_local.py:tiny", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120, env=child_env())


@pytest.mark.slow  # ~4 s; test_prompts' bad-task case and the nothing-held-out test below
def test_a_bad_held_out_file_is_named_before_any_checkpoint_loads(tmp_path):
  (tmp_path / "heldout.jsonl").write_text('{"prompt": "1+1=", "answer": "2", "task": "nope"}\n')
  result = run_eval(f"--config.data.heldout_jsonl={tmp_path / 'heldout.jsonl'}",
                    f"--checkpoints={llama_copy(tmp_path)}",
                    "--config.tokenizer.alphabet=" + "".join(chr(33 + i) for i in range(93)))
  assert result.returncode == 2, result.stdout + result.stderr
  assert "rlax-ps eval: --config: held-out set: data.heldout_jsonl" in result.stderr
  assert "got 'nope'" in result.stderr and "Traceback" not in result.stderr


def test_nothing_held_out_is_refused_before_any_checkpoint_loads(tmp_path):
  """eval.num_examples=0 crashed in the first checkpoint's evaluation (max of nothing)."""
  result = run_eval("--config.eval.num_examples=0", f"--checkpoints={llama_copy(tmp_path)}",
                    "--config.tokenizer.alphabet=" + "".join(chr(33 + i) for i in range(93)))
  assert result.returncode == 2, result.stdout + result.stderr
  assert "--config: held-out set: no examples to evaluate" in result.stderr
  assert "Traceback" not in result.stderr


def test_a_prompt_a_later_checkpoints_tokenizer_cannot_encode_is_named_first(tmp_path):
  (tmp_path / "heldout.jsonl").write_text('{"prompt": "1+1=\\u00e9", "answer": "2", '
                                          '"task": "math"}\n')
  alphabet = "".join(chr(33 + i) for i in range(93))  # 96 ids: the llama fixture's vocab
  first = llama_copy(tmp_path / "a")
  CharTokenizer("0123456789+=\u00e9").save(first)
  second = llama_copy(tmp_path / "b")
  result = run_eval(f"--config.data.heldout_jsonl={tmp_path / 'heldout.jsonl'}",
                    f"--checkpoints={first},{second}", f"--config.tokenizer.alphabet={alphabet}")
  assert result.returncode == 2, result.stdout + result.stderr
  assert (f"--checkpoints: checkpoint {second}: held-out prompt of 'math': CharTokenizer.encode"
          in result.stderr), result.stderr
