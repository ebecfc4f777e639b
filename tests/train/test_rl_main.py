"""`rlax-ps train` as a user runs it against a server: a setting the trainer refuses ends it
with one line naming the field (and a prompt's file and line) and exit status 2."""

import json
import subprocess
import sys

from child_env import child_env
from rl_testlib import REPO


def test_a_prompt_too_long_is_refused_in_one_line_naming_its_file_and_line(tmp_path):
  prompts = tmp_path / "train.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": p, "answer": "2", "task": "addition"}) + "\n"
                             for p in ("1+1=", "1+" * 30 + "1=")))
  proc = subprocess.run(
      [sys.executable, "-m", "rlax_ps", "train", "--config=configs/rl_local.py:tiny",
       f"--workdir={tmp_path / 'rl'}", "--address=127.0.0.1:1", "--token=unused",
       f"--config.data.jsonl={prompts}"],
      cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr == (f"rlax-ps train: data.jsonl {prompts}:2: rl.max_prompt_tokens: 16 is "
                         f"too small for this prompt of 63 tokens; raise it or shorten the "
                         f"prompt\n")
