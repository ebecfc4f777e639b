"""The RL config checks that run before any model, device or child starts
(rlax_ps.train.rl_checks): each wrong field is refused naming it; the char tokenizer is
refused for a checkpoint that ships another; a run's saved config names what changed."""

import json
import os

import pytest

from rl_testlib import REPO, rl_config
from rlax_ps.config_files import run_config_changes, save_run_config
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer, tokenizer_from_config
from rlax_ps.train.rl_checks import check_resumed_updates, check_rl_config

FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf")


def _set(config, **fields):
  for path, value in fields.items():
    block, _, name = path.rpartition("__")
    node = config
    for part in block.split("__") if block else ():
      node = node[part]
    node[name] = value
  return config


@pytest.mark.parametrize("fields, message", [
    ({"worker__samples_per_prompt": 1}, "worker.samples_per_prompt: loss.advantage='grpo' "
                                        "weighs each sample against the others"),
    ({"loss__advantage": "ppo"}, "loss.advantage: expected one of"),
    ({"loss__clip": 0.3}, r"loss: unknown fields \['clip'\]"),
    ({"rl__max_staleness": -1}, "rl: expected steps >= 1, max_staleness >= 0"),
    ({"rl__updates_per_batch": 0}, "rl.updates_per_batch: expected >= 1"),
    ({"rl__updates_per_batch": 2, "loss__policy_loss": "pg", "loss__advantage": "gpg"},
     "rl.updates_per_batch: expected 1 with loss.policy_loss='pg'"),
    ({"rl__ack_deadline_s": 0}, "rl.ack_deadline_s: expected seconds > 0"),
    ({"rl__ack_deadline_s": float("inf")}, "rl.ack_deadline_s: expected seconds > 0"),
    ({"rl__take_timeout_s": 0}, "rl.take_timeout_s: expected seconds > 0"),
    ({"rl__take_timeout_s": -1.0}, "rl.take_timeout_s: expected seconds > 0"),
    ({"rl__micro_batches": 3}, "rl.micro_batches: expected a divisor"),
    ({"rl__dynamic_sampling": True, "worker__allocator": "vigor"},
     "rl.dynamic_sampling: needs worker.allocator='fixed'"),
    ({"rl__dynamic_sampling": True, "rl__dynamic_sampling_max_factor": 0.5},
     "rl.dynamic_sampling_max_factor: expected >= 1"),
    ({"publish__format": "int8"}, "worker.weights_format: expected publish.format='int8'"),
    ({"publish__format": "x"}, r"publish.format: expected one of \('bf16', 'int8'\)"),
    ({"loss__correction": "m2po", "loss__clip_high": 0.3},
     r"loss.clip_high: expected unset with loss.correction='m2po' \(M2PO clips no ratio"),
    ({"rl__ref_sync_steps": 4}, "rl.ref_sync_steps: expected 0 with loss.kl_coef=0.0"),
    ({"loss__advantage": "opo", "loss__scale_rewards": "group"},
     "loss.scale_rewards: expected unset with advantage='opo'"),
    ({"rl__revisit_solved": 0.5}, "rl.revisit_solved, rl.revisit_failed: expected data.jsonl"),
    ({"worker__default_task": "no_such_task"}, "worker.default_task: 'no_such_task' is neither"),
    ({"loss__advantage": "remax", "loss__overlong_buffer": 0},
     "worker.greedy_baseline: expected True with loss.advantage='remax'"),
    ({"worker__greedy_baseline": True}, "worker.greedy_baseline: .* got True with "
                                        "loss.advantage='grpo'"),
    ({"loss__advantage": "remax", "loss__overlong_buffer": 0, "worker__greedy_baseline": True,
      "rl__dynamic_sampling": True},
     "rl.dynamic_sampling: expected False with loss.advantage='remax'"),
    ({"loss__advantage": "remax", "loss__overlong_buffer": 0, "worker__greedy_baseline": True,
      "rl__revisit_solved": 0.0, "data__jsonl": "a.jsonl"},
     r"rl.revisit_solved, rl.revisit_failed: expected 1.0 with loss.advantage='remax'"),
    ({"eval__on_workers": True, "worker__allocator": "vigor"},
     "eval.on_workers: needs worker.allocator='fixed'"),
    ({"eval__rounds_pass_k": 4}, "eval.rounds_pass_k: expected 0 without eval.on_workers"),
    ({"eval__on_workers": True, "eval__pass_k": 5},
     "eval.pass_k: expected at most worker.samples_per_prompt=4 with eval.on_workers"),
    ({"eval__on_workers": True, "eval__rounds_pass_k": 9},
     r"eval.rounds_pass_k: expected an int from 0 to worker.samples_per_prompt=4 .* got 9"),
    ({"worker__teacher": "T"}, "worker.teacher: expected '' with teacher.path set .* or "
                               "without loss.advantage='opd'"),
    ({"worker__teacher": "T", "teacher__path": "T", "loss__advantage": "opd"},
     "worker.teacher: expected '' with teacher.path set"),
    ({"worker__teacher": "T", "loss__advantage": "opd", "worker__teacher_topk": 4},
     "worker.teacher_topk: expected loss.distill_topk=0"),
    ({"worker__teacher": "T", "loss__advantage": "opd", "worker__teacher_tokenizer": "U",
      "loss__distill_topk": 4, "worker__teacher_topk": 4},
     "loss.distill_topk: expected 0 with worker.teacher_tokenizer"),
    ({"teacher__tokenizer": "U"}, "teacher.tokenizer: expected '' without teacher.path"),
    ({"data__jsonl": "a.jsonl,b.jsonl", "data__weights": "1"},
     r"data.weights: expected one weight >= 0 for each of the 2 file\(s\)"),
    ({"teacher__tokenizer": "U", "teacher__path": "T", "loss__advantage": "opd",
      "loss__distill_topk": 4}, "teacher.tokenizer: expected '' .* or with loss.distill_topk "
                                "> 0 .* got 'U' with teacher.path='T', loss.distill_topk=4"),
    ({"worker__temperature": 0.0}, r"worker.temperature: expected > 0 for RL .* got 0.0"),
    # The blocks the trainer reads once started: refused before the warm start and children.
    ({"optimizer__lr": -1.0}, r"optimizer.lr: expected > 0, got -1.0"),
    ({"optimizer__b2": 1.5}, r"optimizer.b2: expected in \[0, 1\), got 1.5"),
    ({"optimizer__grad_accum_steps": 3}, r"optimizer.grad_accum_steps: expected 1 in RL, got "
                                         r"3; rl.micro_batches splits"),
    ({"checkpoint__max_to_keep": 0}, r"checkpoint.max_to_keep: expected >= 1, got 0"),
    ({"eval__batch_size": 0}, r"eval.batch_size: expected >= 1, got 0"),
    ({"mesh__fsdp": 0}, r"mesh.fsdp: expected a positive int or -1, got 0"),
])
def test_each_wrong_field_is_refused_naming_it(fields, message):
  config = _set(rl_config(), **fields)
  with pytest.raises(ValueError, match=message):
    check_rl_config(config)


def test_the_critics_grad_accum_steps_is_refused_naming_its_block():
  config = _set(rl_config(path="configs/rl_ppo.py"), critic__optimizer__grad_accum_steps=2)
  with pytest.raises(ValueError, match=r"^critic.optimizer.grad_accum_steps: expected 1 in RL"):
    check_rl_config(config)


def test_vigor_groups_need_no_fixed_size_and_the_recipes_pass():
  vigor = _set(rl_config(path="configs/rl_vigor.py"), worker__samples_per_prompt=1)
  assert check_rl_config(vigor).advantage == "grpo"
  loss = check_rl_config(rl_config())
  assert loss.budget == rl_config().worker.max_new_tokens and loss.temperature == 1.0
  # The trainer scores the distribution the workers sample from.
  assert check_rl_config(_set(rl_config(), worker__temperature=0.7)).temperature == 0.7
  # ReMax's baseline is the greedy sample: one drawn sample a prompt is enough.
  remax = _set(rl_config(path="configs/rl_remax.py"), worker__samples_per_prompt=1)
  assert check_rl_config(remax).advantage == "remax"


def test_prompt_files_are_read_only_when_asked(tmp_path):
  bad = tmp_path / "train.jsonl"
  bad.write_text(json.dumps({"prompt": "1+1="}) + "\n")  # no answer
  config = _set(rl_config(), data__jsonl=str(bad))
  with pytest.raises(ValueError, match="train.jsonl.*'answer'"):
    check_rl_config(config)
  check_rl_config(config, files=False)  # the trainer reads them itself, later
  config.data.jsonl = str(tmp_path / "missing.jsonl")
  with pytest.raises((OSError, ValueError), match="missing.jsonl"):
    check_rl_config(config)


@pytest.mark.parametrize("fields, message", [
    ({"worker__environment": "nope"}, "worker.environment: expected one of .*got 'nope'"),
    ({"worker__environment": "math=nope"}, "worker.environment: expected one of .*got 'nope'"),
    ({"worker__environment": "mth=calculator"}, r"worker.environment: expected tasks among "
                                                r".*got \['mth'\] in 'mth=calculator'"),
    ({"worker__environment": "calculator", "worker__environment_args": "{oops"},
     "worker.environment_args: expected a JSON object"),
    ({"worker__environment": "calculator", "worker__environment_args": '{"x": 1}'},
     "worker.environment_args: .*takes no arguments"),
])
def test_the_environment_is_made_before_the_start(fields, message):
  """A wrong environment name, task or argument fails here, not in the trainer and every
  worker after the warm start (a task the spec misspells would be single-turn)."""
  with pytest.raises(ValueError, match=message):
    check_rl_config(_set(rl_config(), **fields))
  check_rl_config(_set(rl_config(), worker__environment="addition=calculator,*=python"))


@pytest.mark.parametrize("fields, message", [
    ({"worker__reward_model": "/nope"},
     "worker.reward_model: no config.json in reward model folder '/nope'"),
    ({"worker__teacher": "/nope", "loss__advantage": "opd"}, "worker.teacher: .*/nope"),
    ({"worker__reward_terms": "nope:0.5"}, "worker.reward_terms: .*'nope'"),
])
def test_the_workers_models_and_reward_terms_are_checked_before_the_start(fields, message):
  """They failed in each worker, after the warm start, the server and the trainer had run
  (the reward model's as a traceback)."""
  with pytest.raises(ValueError, match=message):
    check_rl_config(_set(rl_config(), **fields))
  check_rl_config(_set(rl_config(), worker__reward_model=os.path.join(FIXTURES, "qwen3_reward"),
                       worker__reward_terms="addition:0.5"))


def test_the_built_in_tasks_prompts_are_checked_against_the_prompt_limit_before_the_start():
  """It was the trainer's check alone: `rlax-ps local` had started the server and workers
  when the trainer refused rl.max_prompt_tokens."""
  with pytest.raises(ValueError, match=r"^rl.max_prompt_tokens: 10 tokens may not hold the "
                                       r"prompts of task 'reversal' \(up to 12\)"):
    check_rl_config(_set(rl_config(), rl__max_prompt_tokens=10))
  check_rl_config(_set(rl_config(), rl__max_prompt_tokens=10, tasks__reversal__weight=0.0))


@pytest.mark.parametrize("line, message", [
    ({"prompt": "h\u00e9llo=", "answer": "1"}, r"data.jsonl .*train.jsonl:3: CharTokenizer"
                                                r".encode: character '\u00e9'"),
    ({"prompt": "1" * 40 + "=", "answer": "1"}, "data.jsonl .*train.jsonl:3: "
                                                "rl.max_prompt_tokens: 16 is too small"),
    ({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},
     "data.jsonl .*train.jsonl:3: prompt: a list of messages needs an HF tokenizer"),
    ({"prompt": "1+1=", "answer": "2", "task": "plain_fn_task"},
     "data.jsonl task: the verifier 'plain_fn_task' could not be made: TypeError"),
])
def test_each_record_is_encoded_and_its_tasks_verifier_made_naming_it(tmp_path, line, message):
  """What the trainer refuses of a record at its start (after the warm start) and a worker
  of a task's verifier at its first prompt is refused here, naming the file and line."""
  from algorithms.verifiers import VERIFIERS
  rewards = tmp_path / "plain_fn.py"
  rewards.write_text("from algorithms.verifiers import VerifierResult, register_verifier\n"
                     "@register_verifier('plain_fn_task')\n"
                     "def plain_fn(completion, reference):\n"
                     "  return VerifierResult(1.0, True)\n")
  data = tmp_path / "train.jsonl"
  data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n\n" + json.dumps(line)
                  + "\n")
  try:
    with pytest.raises(ValueError, match=message):
      check_rl_config(_set(rl_config(), data__jsonl=str(data), worker__verifiers=str(rewards)))
  finally:
    VERIFIERS.pop("plain_fn_task", None)


def test_the_char_tokenizer_is_refused_for_a_checkpoint_with_its_own(tmp_path):
  block = {"kind": "char"}
  with pytest.raises(ValueError, match=r"tokenizer.kind: 'char' .* set "
                                       r"--config.tokenizer.kind=hf"):
    tokenizer_from_config(block, os.path.join(FIXTURES, "tokenizer"))
  CharTokenizer().save(str(tmp_path))  # a warm start's export: the same tokenizer
  assert tokenizer_from_config(block, str(tmp_path)).vocab == CharTokenizer().vocab
  with pytest.raises(ValueError, match="tokenizer.kind: 'char'"):  # another alphabet
    tokenizer_from_config({"kind": "char", "alphabet": "0123456789"}, str(tmp_path))
  import shutil
  ckpt = tmp_path / "ckpt"  # a checkpoint shipping a BPE tokenizer
  shutil.copytree(os.path.join(FIXTURES, "qwen3"), ckpt)
  shutil.copy(os.path.join(FIXTURES, "tokenizer", "tokenizer.json"), ckpt)
  config = _set(rl_config(), init_from_hf=str(ckpt))
  with pytest.raises(ValueError, match="tokenizer.kind: 'char'"):
    check_rl_config(config)


def test_a_starting_checkpoint_missing_a_tensor_is_named_before_anything_starts(tmp_path):
  import shutil
  path = tmp_path / "llama"
  shutil.copytree(os.path.join(FIXTURES, "llama"), path)
  config = _set(rl_config(), init_from_hf=str(path), tokenizer__alphabet="".join(
      chr(33 + i) for i in range(93)))  # 96 ids: the fixture's vocabulary
  check_rl_config(config)
  shutil.copy(os.path.join(FIXTURES, "qwen2", "model.safetensors"), path)  # other tensors
  with pytest.raises(ValueError, match=f"init_from_hf: HF checkpoint '{path}': missing tensor"):
    check_rl_config(config)


def test_a_teachers_tokenizer_folder_without_a_tokenizer_is_named_before_anything_starts(
    tmp_path):
  config = _set(rl_config(), teacher__path=os.path.join(FIXTURES, "llama"),
                teacher__tokenizer=os.path.join(FIXTURES, "tokenizer"), loss__advantage="opd")
  check_rl_config(config)
  config.teacher.tokenizer = str(tmp_path)
  with pytest.raises(ValueError, match="teacher.tokenizer: expected a folder with the "
                                       "teacher's tokenizer.json"):
    check_rl_config(config)


def test_an_hf_tokenizer_saves_its_files_and_its_chat_template(tmp_path):
  source = os.path.join(FIXTURES, "chat_tokenizer")
  tok = HFTokenizer(source, chat_template=os.path.join(source, "llama3.jinja"))
  tok.save(str(tmp_path / "out"))
  saved = sorted(os.listdir(tmp_path / "out"))
  assert saved == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
  again = HFTokenizer(str(tmp_path / "out"), chat_template="auto")
  assert again.chat_template == tok.chat_template
  assert again.encode_prompt([{"role": "user", "content": "hi"}]) == tok.encode_prompt(
      [{"role": "user", "content": "hi"}])
  (tmp_path / "src").mkdir()  # a template that comes as a file of its own is copied along
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / "src" / name).write_bytes(open(os.path.join(source, name), "rb").read())
  (tmp_path / "src" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
  HFTokenizer(str(tmp_path / "src")).save(str(tmp_path / "out2"))
  assert (tmp_path / "out2" / "chat_template.jinja").read_text() == (
      "{{ messages[0]['content'] }}!")


def test_json_written_whole_or_not_at_all(tmp_path, monkeypatch):
  """summary.json, run_config.json: a write cut short (a kill, a full disk) leaves the file
  as it was, not half of the new one."""
  from rlax_ps import config_files
  path = str(tmp_path / "summary.json")
  config_files.write_json(path, {"step": 1})

  def full_disk(fd):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(config_files.os, "fsync", full_disk)
  with pytest.raises(OSError):
    config_files.write_json(path, {"step": 2, "more": "x" * 100_000})
  with open(path) as f:
    assert json.load(f) == {"step": 1}


def test_a_saved_run_config_names_each_changed_field(tmp_path):
  config = rl_config().sft
  assert run_config_changes(str(tmp_path), config) == []  # none saved
  save_run_config(config, str(tmp_path))
  assert run_config_changes(str(tmp_path), config) == []
  config.model.num_layers = config.model.num_layers + 2
  config.train.steps = 7
  changes = run_config_changes(str(tmp_path), config)
  assert len(changes) == 2 and changes[0].startswith("model.num_layers: ")
  assert changes[1].endswith("-> 7") and changes[1].startswith("train.steps: ")
  # One a kill cut short (written whole now, or not at all) is named with what to do.
  (tmp_path / "run_config.json").write_text('{"check')
  with pytest.raises(ValueError, match=r"^--workdir: cannot read .*run_config.json .*; delete "
                                       r"it"):
    run_config_changes(str(tmp_path), config)
  save_run_config(config, str(tmp_path))
  assert run_config_changes(str(tmp_path), config) == []
  assert sorted(os.listdir(tmp_path)) == ["run_config.json"]


def test_another_number_of_updates_per_batch_is_refused_on_resume():
  """The optimizer counts updates and its lr schedule reads steps as count // updates per
  batch: 4 in the checkpoint at step 100 and 1 now put the lr at step 400's."""
  saved = {"step": 100, "config": {"rl": {"updates_per_batch": 4}}}
  with pytest.raises(ValueError, match=r"rl.updates_per_batch: 4 in the checkpoint at step "
                                       r"100, 1 now: .* at step 400's; resume with 4"):
    check_resumed_updates(saved, 1)
  check_resumed_updates(saved, 4)
  check_resumed_updates(None, 2)  # a fresh run
  with pytest.raises(ValueError, match="rl.updates_per_batch: 1 in the checkpoint"):
    check_resumed_updates({"step": 3, "config": {"rl": {}}}, 2)  # (1 when not recorded)


def test_a_recipe_for_your_own_data_is_refused_without_it_naming_data_jsonl():
  """configs/rl_instruct.py (and the recipes made from it) took the built-in addition and
  reversal tasks when data.jsonl was left out: an instruct model trained on toy sums, said
  nowhere. It names no task now, so data.jsonl is asked for before anything starts."""
  for recipe in ("rl_instruct.py", "rl_lora.py", "rl_tools.py"):
    config = rl_config("tiny", f"configs/{recipe}")
    assert not config.data.jsonl
    with pytest.raises(ValueError, match=r'data.jsonl: expected a JSONL file of \{"prompt", '
                                         r'"answer"\} records, as the config names no '
                                         r"built-in task"):
      check_rl_config(config, files=False)
    config.data.jsonl = "train.jsonl"
    check_rl_config(config, files=False)  # (the file itself is read with files=True)
  check_rl_config(rl_config("tiny"), files=False)  # rl_local: the built-in tasks


def test_a_checkpoints_mistakes_are_named_before_anything_starts(tmp_path):
  """rlax-ps local found a mistyped init_from_hf as a tokenizer without a file ('HFTokenizer
  path'), and a model embedding fewer ids than its tokenizer, or a prompt past its
  positions, only once the server, trainer and workers had started (a child's crash)."""
  import shutil

  from flax import nnx

  from rlax_ps.models import ModelConfig, Transformer, save_hf_checkpoint
  chat = os.path.join(REPO, "tests", "fixtures", "hf", "chat_tokenizer")
  tok = HFTokenizer(chat)

  def model(folder, vocab, positions=256, tokenizer=True):
    config = ModelConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                         num_heads=2, num_kv_heads=1, max_position_embeddings=positions)
    save_hf_checkpoint(Transformer(config, rngs=nnx.Rngs(0)), str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer else ():
      shutil.copy(os.path.join(chat, name), folder / name)
    return str(folder)

  data = tmp_path / "data.jsonl"
  data.write_text(json.dumps({"prompt": "1+1 " * 40, "answer": "2"}) + "\n")
  config = rl_config(path="configs/rl_instruct.py")
  config.data.jsonl, config.rl.max_prompt_tokens = str(data), 200
  for start, message in (
      (str(tmp_path / "mistyped"), r"^init_from_hf: no config.json in HF checkpoint folder"),
      (model(tmp_path / "bare", tok.vocab_size, tokenizer=False),
       r"^tokenizer.path: unset, so the tokenizer of init_from_hf's folder, which has none"),
      (model(tmp_path / "small", 80), r"^init_from_hf: .*small: config.json vocab_size: "
                                      r"expected at least 336 \(the tokenizer's ids\), got 80"),
      (model(tmp_path / "short", tok.vocab_size, positions=64),
       r"data.jsonl .*:1: the model's max_position_embeddings=64 - worker.max_new_tokens=\d+: "
       r"\d+ is too small for this prompt of \d+ tokens")):
    config.init_from_hf = start
    with pytest.raises(ValueError, match=message):
      check_rl_config(config)
  config.init_from_hf = model(tmp_path / "fine", tok.vocab_size)
  check_rl_config(config)
