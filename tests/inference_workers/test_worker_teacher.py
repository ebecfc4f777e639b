"""On-policy distillation with the teacher on the workers (worker.teacher): each finished
group's samples carry the teacher's scores of their tokens (projected to its vocabulary a
few positions at a time), which the trainer packs into the very batch inputs its own
teacher (teacher.path, all positions at once) computes."""

import numpy as np
import pytest
from flax import nnx

from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from rlax_ps import sync
from rlax_ps.models import ModelConfig, Transformer, save_hf_checkpoint
from rlax_ps.teacher import Teacher
from rlax_ps.train.rl import group_of
from rlax_ps.train.rollouts import BatchShape, build_batch, check_group
from worker_testlib import MODEL, SMALL, TOKENIZER, CONFIG, client, enqueue_addition


def test_the_workers_teacher_scores_equal_the_trainers_teacher_on_the_batch(
    server, versions, tmp_path):
  teacher = Transformer(ModelConfig(vocab_size=TOKENIZER.vocab_size, **dict(MODEL, num_layers=1)),
                        rngs=nnx.Rngs(7))
  save_hf_checkpoint(teacher, str(tmp_path / "teacher"))
  config = WorkerConfig(max_leases=1, teacher=str(tmp_path / "teacher"), teacher_topk=2,
                        teacher_dtype="float32", teacher_logits_chunk=4, **SMALL)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    assert Worker(wc, CONFIG, TOKENIZER, config).run().groups_submitted == 2
    taken = trainer.take_rollouts(0, 10).rollouts
  groups = [group_of(r, TOKENIZER) for r in taken]
  shape = BatchShape(groups=2, samples=3, prompt_len=32, response_len=SMALL["max_new_tokens"],
                     teacher_logp=True, teacher_topk=2)
  batch = build_batch(groups, shape)
  scored = Teacher(str(tmp_path / "teacher"), None, vocab_size=TOKENIZER.vocab_size,
                   dtype="float32", topk=2).scores(
      {k: v for k, v in batch.items() if not k.startswith("teacher")})
  assert batch["sample_mask"].sum() == 6 and np.any(batch["teacher_logp"] < -1.0)
  np.testing.assert_allclose(batch["teacher_logp"], scored["teacher_logp"], atol=2e-5)
  np.testing.assert_array_equal(batch["teacher_topk_ids"], scored["teacher_topk_ids"])
  np.testing.assert_allclose(batch["teacher_topk_logp"], scored["teacher_topk_logp"], atol=2e-5)
  # A group without them is refused where the loss needs them, naming the field.
  bare = type(taken[0])()
  bare.CopyFrom(taken[0])
  for s in bare.group.samples:
    s.ClearField("teacher_topk_ids")
    s.ClearField("teacher_topk_logprobs_f32")
  with pytest.raises(ValueError, match=r"samples\[0\].teacher_topk_ids: expected the teacher's "
                                       r"top 2 .* got shape None"):
    check_group(group_of(bare, TOKENIZER), shape)
  with pytest.raises(ValueError, match="WorkerConfig.teacher_topk: expected 0 without a teacher"):
    WorkerConfig(teacher_topk=2)
  with pytest.raises(ValueError, match="worker.teacher: HF checkpoint"):
    Worker(wc, CONFIG, TOKENIZER, WorkerConfig(teacher=str(tmp_path / "none"), **SMALL))
