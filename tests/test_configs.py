"""Every recipe in configs/ loads (default and :tiny), names the command that runs it first
in its docstring, and is consistent: it passes the trainer's config checks, its workers hold
the published format and every worker field can be overridden, one model block is shared
with the warm start (or, with no warm start, the checkpoint's tokenizer and chat template)."""

import ast
import glob
import os

import pytest

from inference_workers.worker_config import WorkerConfig
from rlax_ps.config_files import load
from rlax_ps.train.rl_checks import check_rl_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(REPO, "configs", "rl_*.py")))


def test_the_rl_recipes_the_readme_names_exist():
  names = {os.path.basename(p) for p in RECIPES}
  assert {"rl_local.py", "rl_vigor.py", "rl_int8_tis.py", "rl_sync.py",
          "rl_decoupled.py", "rl_dapo.py", "rl_instruct.py", "rl_lora.py", "rl_moe.py",
          "rl_tools.py", "rl_reward_model.py"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_loads_and_is_consistent(path):
  doc = ast.get_docstring(ast.parse(open(path).read()))
  name = os.path.relpath(path, REPO)
  assert doc.splitlines()[0].startswith(f"rlax-ps local --config={name} ")
  for variant in (None, "tiny"):
    c = load(path, variant)
    if not c.tasks:  # a recipe for your own data: its command names the file
      assert "--config.data.jsonl=" in doc
      with pytest.raises(ValueError, match="data.jsonl: expected a JSONL file"):
        check_rl_config(c, files=False)
      c.data.jsonl = "TRAIN_JSONL"
      check_rl_config(c, files=False)
    elif "--config.teacher.path=" in doc:  # the command names the required teacher
      with pytest.raises(ValueError, match="teacher.path: expected an HF checkpoint folder "
                                           "with loss.advantage='opd' or loss.distill_topk"):
        check_rl_config(c)
      c.teacher.path = "TEACHER_PATH"
      check_rl_config(c, files=False)
    else:
      check_rl_config(c)
    worker = c.worker.to_dict()
    assert set(WorkerConfig.__dataclass_fields__) - set(worker) == {"name", "seed"}
    if "--config.worker.reward_model=" in doc:  # the command names the required checkpoint
      assert worker["reward_model"] == ""
      worker["reward_model"] = "RM_PATH"
    WorkerConfig(**worker)  # every worker field is one, and valid
    assert c.worker.weights_format == c.publish.format
    if "sft" in c:
      assert c.model is c.sft.model  # one model block for the warm start and RL
    else:  # starts from init_from_hf: its tokenizer, through its chat template
      assert (c.tokenizer.kind, c.tokenizer.path, c.tokenizer.chat_template) == ("hf", "", "auto")
      assert "--config.init_from_hf=" in doc


def test_unknown_variant_is_refused_naming_it():
  with pytest.raises(ValueError, match="unknown variant 'huge'"):
    load(os.path.join(REPO, "configs", "rl_local.py"), "huge")


@pytest.mark.parametrize("recipe, override, derived, want", [
    ("rl_dapo.py", "worker.max_new_tokens=200", "loss.overlong_buffer", 40),
    ("rl_ppo.py", "optimizer.lr=1e-6", "critic.optimizer.lr", 1e-5),
    ("rl_instruct.py", "optimizer.lr=2e-6", "critic.optimizer.lr", 2e-5),
    ("rl_lora.py", "optimizer.lr=1e-4", "critic.optimizer.lr", 1e-3),
])
def test_a_field_a_recipe_derives_follows_the_override_of_its_source(
    recipe, override, derived, want):
  """--config.* overrides apply after get_config(): a field it computed from another (DAPO's
  buffer, 20% of the budget; the critic's 10x lr) stayed at the recipe's numbers."""
  from absl import flags
  from ml_collections import config_flags
  argv = ["rlax-ps", f"--config={os.path.join(REPO, 'configs', recipe)}", f"--config.{override}"]
  values = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", None, "", flag_values=values,
                                           lock_config=True, sys_argv=argv)
  values(argv)
  node = config.value
  for part in derived.split("."):
    node = node[part]
  assert node == pytest.approx(want)


def test_the_rl_recipes_take_an_eval_budget_override():
  """heldout.py reads eval.max_new_tokens: a locked recipe without the field refused it."""
  for path in RECIPES:
    config = load(path)
    assert config.eval.max_new_tokens == 0, path
    config.lock()
    config.eval.max_new_tokens = 512
