"""`rlax-ps worker --verifiers=FILE` scores prompts whose task names a verifier that FILE
registers; a file that cannot be imported, or a default task nothing knows, stops the
worker at start with an error naming the field."""

import json
import os
import subprocess
import sys

import numpy as np
from flax import nnx

from child_env import child_env
from param_server.client import ParamServerClient, Prompt, RetryPolicy
from param_server.server import ParamServer, ServerConfig
from rlax_ps import config_files, sync
from rlax_ps.models import Transformer, flatten_params, model_config_from
from rlax_ps.tokenizers import CharTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = {"trainer": "t-v", "worker": "w-v", "viewer": "v-v"}
FIXTURE = "tests/fixtures/user_verifiers.py"


def _worker(address, token_file, *extra):
  env = child_env(tokens=False)
  return subprocess.run([sys.executable, "-m", "rlax_ps", "worker",
                         "--config=configs/rl_local.py:tiny", f"--address={address}",
                         f"--token_file={token_file}", "--max_leases=1", "--backoff_max_s=0.5",
                         *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_worker_scores_with_verifiers_from_a_users_file(tmp_path):
  server = ParamServer(ServerConfig(
      storage_dir=str(tmp_path / "ps"), port=0, wal_fsync=False, compact_in_background=False,
      **{f"{r}_token": t for r, t in TOKENS.items()})).start()
  tokens = tmp_path / "tokens.json"
  tokens.write_text(json.dumps(TOKENS))
  try:
    cfg = config_files.load(os.path.join(REPO, "configs", "rl_local.py"), "tiny")
    model_config = model_config_from(cfg.model, CharTokenizer().vocab_size)
    params = {k: np.asarray(v) for k, v in
              flatten_params(Transformer(model_config, rngs=nnx.Rngs(0))).items()}
    with ParamServerClient(server.address, token=TOKENS["trainer"], role="trainer",
                           retry=RetryPolicy(deadline_s=5.0)) as trainer:
      trainer.publish(sync.encode(None, params, "bf16", version=0).to_bytes())
      trainer.enqueue_prompts([
          Prompt(id="p0", text="1+2=", task="fixture_any", extra=b"3"),
          Prompt(id="p1", text="1+2=", task="fixture_strict_int", extra=b"3")])
      done = _worker(server.address, tokens, f"--verifiers={FIXTURE}")
      assert done.returncode == 0, done.stderr[-2000:]
      taken = {t.prompt.id: t.group.samples for t in trainer.take_rollouts(0, 4).rollouts}
    assert sorted(taken) == ["p0", "p1"]  # one lease of both (prompts_per_lease 2)
    assert [s.reward for s in taken["p0"]] == [0.75] * 4  # samples_per_prompt
    # p1's verifier raises on text that is no integer: those samples score 0 and the
    # worker goes on
    raised = 0
    for s in taken["p1"]:
      try:
        assert s.reward == float(int(s.text.strip()) == 3)
      except ValueError:
        raised += 1
        assert s.reward == 0.0
    assert raised > 0 and f"{raised} samples scored 0 by a verifier that raised" in done.stdout
    missing = _worker(server.address, tokens, "--verifiers=tests/fixtures/missing.py")
    assert missing.returncode != 0
    assert "worker.verifiers: could not import 'tests/fixtures/missing.py'" in missing.stderr
    unknown = _worker(server.address, tokens, "--default_task=fixture_any")
    assert unknown.returncode != 0
    assert "worker.default_task: 'fixture_any' is neither a built-in task" in unknown.stderr
  finally:
    server.stop(grace=0)


def test_an_unknown_environment_is_named_before_the_model_loads(tmp_path):
  # The model's checkpoint does not exist either: the environment is checked first, with
  # the verifiers, in one line (exit 2), not after loading the tokenizer and model.
  done = _worker("127.0.0.1:1", tmp_path / "tokens.json", "--environment=nope",
                 f"--config.init_from_hf={tmp_path / 'no_checkpoint'}")
  assert done.returncode == 2, done.stderr[-2000:]
  assert "worker.environment" in done.stderr and "'nope'" in done.stderr, done.stderr
  assert "Traceback" not in done.stderr
