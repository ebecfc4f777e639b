"""RL on an instruct-style tokenizer: JSONL conversations go through the chat template, a
real worker samples from the rendered prompt and stops at the end-of-turn ids, the trainer
trains on exactly those prompts, scores held-out conversations, and its export carries the
template and stop ids for transformers / vLLM."""

import json
import os
import re
import threading

import numpy as np
import pytest

from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from param_server.protos import param_server_pb2 as pb
from rl_testlib import REPO, client, rl_config, start_server
from rlax_ps.tokenizers import HFTokenizer, tokenizer_from_config
from rlax_ps.train.rl import RLTrainer
from rlax_ps.train.rl_checks import prompt_limit

CHAT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf",
                    "chat_tokenizer")
CONVERSATIONS = [
    [{"role": "system", "content": "Answer with the number."},
     {"role": "user", "content": f"{a}+{b}="}] for a, b in ((1, 2), (12, 34), (5, 5), (7, 8))]


@pytest.mark.slow  # ~30 s; chat recipes run end to end in test_local's slow family runs too
def test_conversations_are_rendered_sampled_to_a_stop_id_trained_and_exported(tmp_path):
  records = [{"prompt": m, "answer": str(sum(map(int, m[1]["content"][:-1].split("+")))),
              "task": "addition"} for m in CONVERSATIONS]
  (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
  config = rl_config("tiny")
  config.tokenizer.kind, config.tokenizer.path = "hf", CHAT
  config.tokenizer.chat_template = "auto"
  config.tokenizer.chat_kwargs = '{"enable_thinking": false}'
  config.data.jsonl = str(tmp_path / "train.jsonl")
  config.data.heldout_jsonl = str(tmp_path / "heldout.jsonl")
  config.rl.steps, config.rl.max_prompt_tokens = 2, 64
  config.worker.max_new_tokens = config.worker.samples_per_prompt = 4
  config.eval.pass_k = 0
  tok = tokenizer_from_config(config.tokenizer)
  expected_prompts = {tuple(tok.encode_prompt(m)) for m in CONVERSATIONS}
  assert all(tok.render_prompt(m).endswith("assistant\n<think>\n\n</think>\n\n")
             for m in CONVERSATIONS)  # chat_kwargs reach the template

  server = start_server(tmp_path / "ps")
  trained = []
  try:
    with client(server.address, "trainer") as tc, client(server.address, "worker") as wc, \
        RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      take = tr._take_groups
      tr._take_groups = lambda: trained.extend(take() or []) or trained[-config.rl.groups_per_step:]
      worker = Worker(wc, tr.model_config, tok, WorkerConfig(**config.worker.to_dict()))
      thread = threading.Thread(target=worker.run, daemon=True)
      thread.start()
      summary = tr.train()
      worker.request_stop(60.0)  # a grace it cannot overrun: past it the worker exits the process
      thread.join(60)
      assert not thread.is_alive()
  finally:
    server.stop(grace=0)

  assert summary["step"] == 2 and len(trained) == 2 * config.rl.groups_per_step
  assert {tuple(int(t) for t in g.prompt_tokens) for g in trained} <= expected_prompts
  stops = set(tok.stop_ids)
  assert len(stops) == 2 and set(worker.params.stop_tokens) == stops
  for g in trained:
    for r in g.responses:  # up to and with the first stop id, else the whole budget
      r = [int(t) for t in r]
      ends = [i for i, t in enumerate(r) if t in stops]
      assert (ends == [len(r) - 1]) if ends else len(r) == config.worker.max_new_tokens
  assert set(summary["heldout_exact_match"]) == {"addition", "all"}

  export = tmp_path / "rl" / "hf"
  generation = json.loads((export / "generation_config.json").read_text())
  assert generation["eos_token_id"] == list(tok.stop_ids)
  again = HFTokenizer(str(export), chat_template="auto", chat_kwargs={"enable_thinking": False})
  assert again.stop_ids == tok.stop_ids
  assert [again.encode_prompt(m) for m in CONVERSATIONS] == [tok.encode_prompt(m)
                                                            for m in CONVERSATIONS]
  np.testing.assert_array_equal(sorted(os.listdir(export)), sorted(
      ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
       "tokenizer.json", "tokenizer_config.json"]))


def test_prompts_longer_than_the_packed_capacity_are_refused_before_sampling(tmp_path):
  config = rl_config("tiny")
  config.tokenizer.kind, config.tokenizer.path = "hf", CHAT
  config.tokenizer.chat_template = "auto"
  config.rl.max_prompt_tokens = 30  # the one-turn conversations fit, a long one does not
  long = [{"role": "user", "content": "hello world " * 6}]
  (tmp_path / "train.jsonl").write_text(
      "".join(json.dumps({"prompt": p, "answer": "3", "task": "addition"}) + "\n"
              for p in (CONVERSATIONS[0][1:], long, CONVERSATIONS[1][1:])))
  config.data.jsonl = str(tmp_path / "train.jsonl")
  # `rlax-ps train` names the prompt's file and line, as `rlax-ps local`'s check does.
  where = re.escape(f"data.jsonl {tmp_path / 'train.jsonl'}:2: ")
  with pytest.raises(ValueError, match=where + r"rl.max_prompt_tokens: 30 is too small for "
                                       r"this prompt of \d+ tokens"):
    RLTrainer(config, str(tmp_path / "a"), object())
  # A model with fewer positions than rl.max_prompt_tokens + worker.max_new_tokens: a prompt
  # no worker could sample is refused at the start, naming that bound (every group of it
  # was rejected after sampling, one by one).
  config.rl.max_prompt_tokens = 200
  config.model.max_position_embeddings = 8 + config.worker.max_new_tokens
  with pytest.raises(ValueError, match=re.escape(
      f"data.jsonl {tmp_path / 'train.jsonl'}:1: the model's max_position_embeddings={config.model.max_position_embeddings} - "
      f"worker.max_new_tokens={config.worker.max_new_tokens}: 8 is too small for this "
      f"prompt of")):
    RLTrainer(config, str(tmp_path / "c"), object())
  with pytest.raises(ValueError, match="worker.max_new_tokens: 8 leaves no room for a prompt"):
    prompt_limit(config, 8)
  config.model.max_position_embeddings = 128
  # The built-in tasks' prompts, rendered as conversations, outgrow 16 tokens: the trainer's
  # start says so, not the first feed (after the server, workers and compiles started).
  config.data.jsonl, config.rl.max_prompt_tokens = "", 16
  with pytest.raises(ValueError, match=r"rl.max_prompt_tokens: 16 tokens may not hold the "
                                       r"prompts of task 'addition' \(up to \d+\)"):
    RLTrainer(config, str(tmp_path / "b"), object())


def test_a_verl_parquet_file_feeds_the_trainer_through_the_chat_template(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"data_source": "x", "prompt": m, "reward_model": {"ground_truth": str(i)}}
          for i, m in enumerate(CONVERSATIONS)]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
  config = rl_config("tiny")
  config.tokenizer.kind, config.tokenizer.path = "hf", CHAT
  config.tokenizer.chat_template = "auto"
  config.rl.max_prompt_tokens = 64
  config.data.jsonl = str(tmp_path / "train.parquet")
  config.data.answer_key = "reward_model.ground_truth"
  config.worker.default_task = "math"
  with RLTrainer(config, str(tmp_path / "rl"), object()) as tr:
    taken = sorted((r["answer"], r["task"], tuple(tr.tokenizer.encode_prompt(r["prompt"])))
                   for _, r in tr.feed.take(4))
  tok = tokenizer_from_config(config.tokenizer)
  assert taken == [(str(i), "math", tuple(tok.encode_prompt(m)))
                   for i, m in enumerate(CONVERSATIONS)]


def test_prompt_only_records_go_out_with_the_raw_prompt_a_reward_model_renders(tmp_path):
  """data.answer_key "": prompts alone, of task reward_model, which needs worker.reward_model;
  each prompt carries its messages beside the rendered text (the reward model's template
  renders them again)."""
  (tmp_path / "train.jsonl").write_text(
      "".join(json.dumps({"prompt": m}) + "\n" for m in CONVERSATIONS))
  config = rl_config("tiny")
  config.tokenizer.kind, config.tokenizer.path = "hf", CHAT
  config.tokenizer.chat_template = "auto"
  config.rl.max_prompt_tokens = 64
  config.data.jsonl, config.data.answer_key = str(tmp_path / "train.jsonl"), ""
  config.worker.default_task = "reward_model"
  with pytest.raises(ValueError, match="worker.reward_model: data.jsonl has prompts of task "
                                       "'reward_model'; expected a reward model checkpoint"):
    RLTrainer(config, str(tmp_path / "a"), object())
  config.worker.reward_model = os.path.join(os.path.dirname(CHAT), "qwen3_reward")
  sent = []

  class Queue:
    def enqueue_prompts(self, prompts):
      sent.extend(prompts)

    def version_info(self):
      return pb.VersionInfo()

  with RLTrainer(config, str(tmp_path / "b"), Queue()) as tr:
    tr._feed_prompts()
  assert len(sent) >= len(CONVERSATIONS)
  for p in sent:
    raw = json.loads(p.metadata["prompt"])
    assert raw in CONVERSATIONS and p.task == "reward_model" and p.extra == b""
    assert p.text == tr.tokenizer.render_prompt(raw)


def test_supervised_data_refuses_an_empty_answer_key(tmp_path):
  from rlax_ps.config_files import load
  from rlax_ps.train.sft import SFTTrainer
  (tmp_path / "train.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n')
  config = load(os.path.join(REPO, "configs", "sft_tiny.py"), "tiny")
  config.data.jsonl, config.data.answer_key = str(tmp_path / "train.jsonl"), ""
  with pytest.raises(ValueError, match="data.answer_key: supervised data needs answers"):
    SFTTrainer(config, str(tmp_path / "sft"))


@pytest.mark.slow  # ~17 s
def test_sft_trains_on_a_prompt_files_conversations_through_the_template(tmp_path):
  """rlax-ps sft on data.jsonl: the batches hold the rendered conversations followed by the
  answer and the end-of-turn eos, the loss falls, and data.heldout_jsonl is what is scored."""
  from rlax_ps.config_files import load
  from rlax_ps.train.sft import SFTTrainer
  records = [{"prompt": m, "answer": str(sum(map(int, m[1]["content"][:-1].split("+"))))}
             for m in CONVERSATIONS]
  (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  config = load(os.path.join(REPO, "configs", "sft_tiny.py"), "tiny")
  config.tokenizer.kind, config.tokenizer.path = "hf", CHAT
  config.tokenizer.chat_template = "auto"
  config.data.jsonl = config.data.heldout_jsonl = str(tmp_path / "train.jsonl")
  config.data.seq_len, config.train.steps = 96, 30
  config.optimizer.warmup_steps = 0
  config.eval.num_examples = 2
  with SFTTrainer(config, str(tmp_path / "sft")) as tr:
    tok = tr.tokenizer
    batch = tr.data.batch(0)
    first = list(batch["tokens"][0][:len(tok.encode_prompt(CONVERSATIONS[0]))])
    assert tuple(first) in {tuple(tok.encode_prompt(m)) for m in CONVERSATIONS}
    answers = tok.decode(batch["targets"][batch["loss_mask"] > 0], skip_special=False)
    assert answers.endswith("<|im_end|>") and "<|im_end|>" == tok._tok.id_to_token(tok.eos_id)
    losses = []
    for _ in range(3):
      losses.append(tr.train(until=tr.step + 10, progress=False)["loss"])
    # Held out: the file's records, scored by the math verifier (no task given).
    assert set(tr.evaluate()) == {"math", "all"} and tr.heldout.size == len(CONVERSATIONS)
  # Falls, and to under 0.6 of an untrained model's ln(vocab).
  assert losses[0] > losses[1] > losses[2] and losses[-1] < 0.6 * np.log(tok.vocab_size)
