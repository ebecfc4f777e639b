"""The RL prompt stream: JSONL or Parquet records from a path or a URL (gs:// on TPU VMs;
file:// here, through the same tensorstore reader), read at configurable (dotted) keys, bad
records named by file, line or row and key, and a feed whose checkpointed state resumes the
same stream."""

import itertools
import json

import pytest

from rlax_ps.train import prompts
from rlax_ps.train.prompts import PromptFeed, file_parts, file_weights, read_prompts
import collections
from rlax_ps.tasks import get_task
from rlax_ps.train.prompts import TaskPrompts

RECORDS = [{"prompt": "1+2=", "answer": "3", "task": "addition"},
           {"prompt": "say \u2028 this", "answer": "ok"},  # a JSON line with U+2028 inside
           {"prompt": "x", "answer": "", "task": "math"}]


def _write(tmp_path, lines, name="data.jsonl"):
  path = tmp_path / name
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return path


def test_records_read_the_same_from_a_path_and_a_url(tmp_path):
  path = _write(tmp_path, [json.dumps(r, ensure_ascii=False) for r in RECORDS] + [""])
  want = [dict(r, task=r.get("task", "reversal")) for r in RECORDS]
  assert read_prompts(str(path), default_task="reversal") == want
  assert read_prompts(f"file://{path}", default_task="reversal") == want


@pytest.mark.parametrize("line, message", [
    ("{not json", "data.jsonl:2: not JSON"),
    ("[1, 2]", "data.jsonl:2: expected an object, got list"),
    ('{"prompt": "", "answer": "1"}', "data.jsonl:2: field 'prompt': expected a non-empty "
                                      "string"),
    ('{"prompt": "a", "answer": [3]}', "data.jsonl:2: field 'answer': expected a string"),
    ('{"prompt": " \\n", "answer": "1"}', "data.jsonl:2: field 'prompt': expected a "
                                         "non-empty string"),
    ('{"prompt": "a", "answer": NaN}', "data.jsonl:2: field 'answer': expected a string or a "
                                       "finite number, got nan"),
    ('{"prompt": "a", "answer": 1e400}', "data.jsonl:2: field 'answer': .* got inf"),
    ('{"prompt": "a", "answer": "b", "task": 7}', "data.jsonl:2: field 'task': expected a "
                                                  "string, got 7"),
    ('{"prompt": "a", "answer": "b", "task": "nope"}', "data.heldout_jsonl .*data.jsonl:2: "
                                                       "field 'task': expected a built-in "
                                                       "task or a registered verifier "
                                                       "\\(addition, math; .*got 'nope'"),
])
def test_a_bad_record_is_refused_naming_its_line_and_field(tmp_path, line, message):
  path = _write(tmp_path, [json.dumps(RECORDS[0]), line])
  with pytest.raises(ValueError, match=message):
    read_prompts(str(path), known=["addition", "math"], field="data.heldout_jsonl")


def test_a_bad_fields_value_is_quoted_cut_short_in_its_one_line(tmp_path):
  """A verl-style nested ground truth where a string was expected: the error quotes its start,
  not megabytes of it."""
  tests = [f"assert f({i}) == {i}" * 50 for i in range(2000)]
  path = _write(tmp_path, [json.dumps({"prompt": "a", "answer": {"tests": tests}})])
  with pytest.raises(ValueError, match=r"data.jsonl:1: field 'answer': expected a string, "
                                       r"got \{'tests': \['assert f\(0\)") as e:
    read_prompts(str(path))
  assert len(str(e.value).split(" got ", 1)[1]) < 400 and "\n" not in str(e.value)


def test_a_path_under_the_home_folder_is_read(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  _write(tmp_path, [json.dumps(RECORDS[0])], "mine.jsonl")
  assert read_prompts("~/mine.jsonl, ~/mine.jsonl") == [RECORDS[0], RECORDS[0]]


def test_a_missing_file_or_object_is_refused_naming_the_field(tmp_path):
  for missing in (str(tmp_path / "nope.jsonl"), f"file://{tmp_path}/nope.jsonl"):
    with pytest.raises(ValueError, match="^data.jsonl: no (file|object at) .*nope.jsonl"):
      read_prompts(missing)
  with pytest.raises(ValueError, match="^data.jsonl: cannot read bogus://b/k: .*scheme"):
    read_prompts("bogus://b/k")
  with pytest.raises(ValueError, match="empty.jsonl: no prompt records"):
    read_prompts(str(_write(tmp_path, [""], "empty.jsonl")))


def test_verl_style_parquet_rows_are_read_at_dotted_keys(tmp_path):
  """A verl data file: the prompt a list of chat messages, the answer under
  reward_model.ground_truth (an int in some datasets), no task column."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+2?"}],
           "reward_model": {"style": "rule", "ground_truth": "3"}},
          {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "2+2?"}],
           "reward_model": {"style": "rule", "ground_truth": "4"}}]
  path = tmp_path / "train.parquet"
  pq.write_table(pa.Table.from_pylist(rows), path)
  want = [{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"], "task": "math"}
          for r in rows]
  for where in (str(path), f"file://{path}"):
    assert read_prompts(where, default_task="math", answer_key="reward_model.ground_truth",
                        known=["math"]) == want
  ints = tmp_path / "ints.parquet"
  pq.write_table(pa.Table.from_pylist([{"q": "1+2?", "a": 3}]), ints)
  assert read_prompts(str(ints), default_task="math", prompt_key="q", answer_key="a") == [
      {"prompt": "1+2?", "answer": "3", "task": "math"}]
  with pytest.raises(ValueError, match=r"train.parquet:row 0: field 'reward_model.answer': "
                                       r"expected a string, got None"):
    read_prompts(str(path), default_task="math", answer_key="reward_model.answer")
  (tmp_path / "bad.parquet").write_bytes(b"not parquet")
  with pytest.raises(ValueError, match="data.jsonl: .*bad.parquet is not a readable Parquet"):
    read_prompts(str(tmp_path / "bad.parquet"))
  (tmp_path / "spark.parquet").mkdir()  # a folder of part files (Spark, datasets)
  with pytest.raises(ValueError, match="data.jsonl: cannot read .*spark.parquet: "):
    read_prompts(str(tmp_path / "spark.parquet"))


def test_several_files_joined_by_commas_are_read_in_order(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  first = _write(tmp_path, [json.dumps(r) for r in RECORDS[:2]], "a.jsonl")
  pq.write_table(pa.Table.from_pylist([{"prompt": "2+2=", "answer": "4"}]), tmp_path / "b.parquet")
  got = read_prompts(f"{first}, file://{tmp_path}/b.parquet", default_task="addition")
  assert [r["prompt"] for r in got] == ["1+2=", "say \u2028 this", "2+2="]
  bad = _write(tmp_path, ['{"prompt": "a"}'], "bad.jsonl")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'answer'"):
    read_prompts(f"{first},{bad}")


def test_a_restored_feed_goes_on_with_the_same_records():
  source = [{"prompt": str(i), "answer": str(i), "task": "t"} for i in range(7)]
  feed = PromptFeed(source, seed=3)
  first = feed.take(4)
  state = feed.state()
  rest = feed.take(10)  # past the end of an epoch: the stream repeats, reshuffled
  assert [i for i, _ in rest] == list(range(4, 14))
  epochs = [[r["prompt"] for _, r in (first + rest)[k:k + 7]] for k in (0, 7)]
  assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(s["prompt"] for s in source)
  assert epochs[0] != [s["prompt"] for s in source] and epochs[0] != epochs[1]
  again = PromptFeed(source, seed=3)
  again.restore(state)
  assert again.take(10) == rest
  for partial in ({"position": 1}, {"iterator": state["iterator"]}):  # (ids would repeat)
    with pytest.raises(ValueError, match="checkpoint data state: expected"):
      again.restore(partial)


def test_each_seed_orders_every_epoch_its_own_way_and_an_older_checkpoint_keeps_its_order():
  """grain orders epoch e by its shuffle seed + e: with the run's seed as that seed, seed 1's
  epochs were seed 0's from its second on (runs over seeds repeated one another's data
  order). A checkpoint saved before the order was recorded resumes in the order it read."""
  source = [{"prompt": str(i), "answer": str(i), "task": "t"} for i in range(50)]

  def epochs(feed, n=4):
    taken = [rec["record"] for _, rec in feed.take(50 * n)]
    return [tuple(taken[k:k + 50]) for k in range(0, 50 * n, 50)]

  seen = [epochs(PromptFeed(source, seed=s)) for s in range(4)]
  for a in range(4):
    for b in range(a + 1, 4):
      assert not set(seen[a]) & set(seen[b]), (a, b)
  saved = PromptFeed(source, seed=0)
  saved.take(13)
  state = {k: v for k, v in saved.state().items() if k != "order"}  # as saved before
  old = PromptFeed(source, seed=0)
  old.restore(state)
  order1 = [rec["record"] for rec in itertools.islice(
      prompts.prompt_dataset(source, 0, order=1), 20)]
  assert [rec["record"] for _, rec in old.take(7)] == order1[13:20]
  assert order1[:50] != list(seen[0][0])  # (the orders differ: the check above can fail)
  assert old.state()["order"] == 1  # and it checkpoints that order again
  fresh = PromptFeed(source, seed=0)
  fresh.take(3)
  assert fresh.state()["order"] == prompts.ORDER


@pytest.mark.slow  # ~5 s; test_resume_changes mixes weighted files in the default suite
def test_weighted_files_are_mixed_in_their_proportions_each_shuffled_on_its_own():
  """data.weights "3,1" over a file of 3 records and one of 7: three prompts of the first for
  one of the second, each file's records all fed once before any again; a restored feed goes
  on with the same records."""
  source = [{"prompt": str(i), "answer": str(i), "task": "t"} for i in range(10)]
  parts = file_parts([3, 7], file_weights({"jsonl": "a.jsonl,b.jsonl", "weights": "3,1"}))
  assert parts == [(0, 3, 3.0), (3, 10, 1.0)]
  feed = PromptFeed(source, seed=3, parts=parts)
  taken = [rec["record"] for _, rec in feed.take(400)]
  first = [r for r in taken if r < 3]
  assert len(first) == 300
  assert all(sorted(first[k:k + 3]) == [0, 1, 2] for k in range(0, 300, 3))
  second = [r for r in taken if r >= 3]
  assert all(sorted(second[k:k + 7]) == list(range(3, 10)) for k in range(0, 98, 7))
  assert first[:3] != first[3:6] or first[3:6] != first[6:9]  # shuffled anew each epoch
  state = feed.state()
  rest = feed.take(20)
  again = PromptFeed(source, seed=3, parts=parts)
  again.restore(state)
  assert again.take(20) == rest
  # A weight of 0: the file is never fed.
  zero = PromptFeed(source, seed=3, parts=file_parts([3, 7], (0.0, 1.0)))
  assert {rec["record"] for _, rec in zero.take(50)} == set(range(3, 10))


def test_an_empty_file_among_several_is_read_as_none_and_drawn_from_only_without_weight(
    tmp_path):
  first = _write(tmp_path, [json.dumps(r) for r in RECORDS[:2]], "a.jsonl")
  empty = _write(tmp_path, [""], "empty.jsonl")
  sizes = []
  got = read_prompts(f"{empty},{first}", default_task="math", sizes=sizes)
  assert len(got) == 2 and sizes == [0, 2]
  assert file_parts(sizes, (0.0, 1.0), [str(empty), str(first)]) == [(0, 0, 0.0), (0, 2, 1.0)]
  with pytest.raises(ValueError, match=f"data.weights: {empty} has no prompt records to draw; "
                                       f"expected a weight of 0 for it"):
    file_parts(sizes, (1.0, 1.0), [str(empty), str(first)])


@pytest.mark.parametrize("weights, message", [
    ("3", r"data.weights: expected one weight >= 0 for each of the 2 file\(s\) of data.jsonl "
          r"\['a.jsonl', 'b.jsonl'\], with a positive sum, got '3'"),
    ("x,1", "got 'x,1'"), ("-1,2", "got '-1,2'"), ("0,0", "got '0,0'"), ("inf,1", "got 'inf,1'"),
])
def test_data_weights_that_do_not_weigh_each_file_are_refused_naming_the_field(weights,
                                                                              message):
  assert file_weights({"jsonl": "a.jsonl, b.jsonl", "weights": ""}) == ()
  assert file_weights({"jsonl": "a.jsonl, b.jsonl", "weights": (3, 1)}) == (3.0, 1.0)
  assert file_weights({"jsonl": "a.jsonl, b.jsonl", "weights": "0,1"}) == (0.0, 1.0)
  with pytest.raises(ValueError, match=message):
    file_weights({"jsonl": "a.jsonl, b.jsonl", "weights": weights})


def test_an_empty_answer_key_reads_prompts_alone_held_out_only_for_the_reward_model(
    tmp_path):
  import ml_collections

  from rlax_ps.train.prompts import config_records
  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "hi", "task": "reward_model"}\n{"prompt": "yo", "answer": 3}\n')
  assert read_prompts(str(path), "math", answer_key="") == [
      {"prompt": "hi", "answer": "", "task": "reward_model"},
      {"prompt": "yo", "answer": "", "task": "math"}]
  # The answer is required unless answer_key is "" or the task is the reward model's.
  assert read_prompts(str(path), "math")[1] == {"prompt": "yo", "answer": "3", "task": "math"}
  path.write_text('{"prompt": "hi", "task": "reward_model"}\n{"prompt": "yo"}\n')
  with pytest.raises(ValueError, match=r"p.jsonl:2: field 'answer': expected a string, got None"):
    read_prompts(str(path), "math")
  config = ml_collections.ConfigDict({"data": {"answer_key": ""},
                                      "worker": {"default_task": "math", "reward_model": "rm"}})
  assert len(config_records(config, "data.jsonl", str(path))) == 2
  with pytest.raises(ValueError, match=r"data.heldout_jsonl: held-out records of task\(s\) "
                                       r"\['math'\] are scored against their answers"):
    config_records(config, "data.heldout_jsonl", str(path))
  path.write_text('{"prompt": "hi"}\n')  # held out for the reward model to score
  config.worker.default_task = "reward_model"
  assert config_records(config, "data.heldout_jsonl", str(path)) == [
      {"prompt": "hi", "answer": "", "task": "reward_model"}]


def test_an_answer_its_verifier_cannot_score_against_is_refused_before_training(tmp_path):
  """A code record's answer in another format (APPS' {"inputs", "outputs"}) passed the data
  check and its verifier raised on every sample: all scored 0, nothing learned, while the
  run looked well. A verifier's check_reference refuses it first, naming line and field;
  one of a user's verifiers is run too."""
  import ml_collections

  from algorithms.verifiers import VERIFIERS, register_verifier
  from rlax_ps.train.prompts import config_records
  config = ml_collections.ConfigDict({"data": {"answer_key": "solution"},
                                      "worker": {"default_task": "code"}})
  good = '{"prompt": "write f", "solution": "[\\"assert f(1) == 2\\"]"}'
  path = _write(tmp_path, [good, '{"prompt": "write g", "solution": "{\\"inputs\\": [1]}"}'])
  with pytest.raises(ValueError, match=r"data.jsonl .*data.jsonl:2: field 'solution': not a "
                                       r"reference the 'code' verifier can score against: "
                                       r"reference: expected a sequence of test source strings"):
    config_records(config, "data.jsonl", str(path))
  assert len(config_records(config, "data.jsonl", str(_write(tmp_path, [good] * 2)))) == 2

  @register_verifier("_digits_only")
  class DigitsOnly:
    @staticmethod
    def check_reference(reference):
      if not reference.isdigit():
        raise ValueError(f"expected digits, got {reference!r}")

  @register_verifier("_own_check")
  class OwnCheck:  # a method of its instances: not the data check, whatever it does
    def check_reference(self, reference):
      raise AssertionError("not called")

  @register_verifier("_broken_check")
  class BrokenCheck:
    @staticmethod
    def check_reference(reference):
      return reference["tests"]  # a TypeError on a string

  try:
    config.worker.default_task = "_own_check"
    assert len(config_records(config, "data.jsonl", str(_write(tmp_path, [good] * 2)))) == 2
    config.worker.default_task = "_broken_check"
    with pytest.raises(ValueError, match=r"data.jsonl:1: field 'solution': not a reference the "
                                         r"'_broken_check' verifier can score against: "
                                         r"TypeError: string indices"):
      config_records(config, "data.jsonl", str(_write(tmp_path, [good])))
    config.worker.default_task = "_digits_only"
    path = _write(tmp_path, ['{"prompt": "a", "solution": "12"}',
                             '{"prompt": "b", "solution": "1a"}'])
    with pytest.raises(ValueError, match=r"data.jsonl:2: field 'solution': .*'_digits_only' "
                                         r"verifier .*expected digits, got '1a'"):
      config_records(config, "data.jsonl", str(path))
  finally:
    for name in ("_digits_only", "_own_check", "_broken_check"):
      del VERIFIERS[name]


def test_bytes_not_utf8_are_refused_naming_the_line_and_a_utf8_bom_is_read(tmp_path):
  """A file saved by an editor that writes a byte-order mark reads; one with bytes that are
  not UTF-8 is refused naming its line, not with a bare UnicodeDecodeError."""
  path = tmp_path / "data.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORDS[0]).encode() + b"\r\n")
  assert read_prompts(str(path)) == [RECORDS[0]]
  path.write_bytes(json.dumps(RECORDS[0]).encode() + b"\n\n" + b'{"prompt": "\xff"}\n')
  with pytest.raises(ValueError, match="data.jsonl:3: not UTF-8"):
    read_prompts(str(path))


@pytest.mark.parametrize("record, key", [
    ({"prompt": "x", "answer": "\ud800"}, "answer"),
    ({"prompt": "cut \ud83d", "answer": "1"}, "prompt"),
    ({"prompt": [{"role": "user", "content": "\udc00"}], "answer": "1"}, "prompt"),
])
def test_a_lone_surrogate_is_refused_naming_its_line_and_field(tmp_path, record, key):
  """JSON's "\\ud83d" (an emoji cut in half) parses to a string that cannot be encoded: the
  trainer would fail on it only when the record is fed, mid-run."""
  path = _write(tmp_path, [json.dumps(RECORDS[0]), json.dumps(record)])
  with pytest.raises(ValueError, match=f"data.jsonl:2: field '{key}': not valid Unicode"):
    read_prompts(str(path), default_task="math")


def test_a_number_answer_is_the_text_it_was_written_as(tmp_path):
  """json's float repr sent 0.00001 as '1e-05' (which the math verifier does not take for
  0.00001) and trained 2.50 as '2.5'; a Parquet float is written without an exponent."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  from algorithms.verifiers.math_answer import MathAnswerVerifier
  lines = ['{"prompt": "a", "answer": 0.00001}', '{"prompt": "b", "answer": 2.50}',
           '{"prompt": "c", "answer": 1e3}', '{"prompt": "d", "answer": 12}']
  got = [r["answer"] for r in read_prompts(str(_write(tmp_path, lines)))]
  assert got == ["0.00001", "2.50", "1e3", "12"]
  assert MathAnswerVerifier()(r"\boxed{0.00001}", got[0]).passed
  pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": x}
                                       for x in (1e-05, 1e16, 1000.0, 2.5)]),
                 tmp_path / "f.parquet")
  assert [r["answer"] for r in read_prompts(str(tmp_path / "f.parquet"))] == [
      "0.00001", "10000000000000000", "1000", "2.5"]


def test_a_demonstration_where_one_reference_is_read_says_where_demonstrations_go(tmp_path):
  from ml_collections import ConfigDict
  from rlax_ps.train.prompts import config_records
  path = _write(tmp_path, [json.dumps({"prompt": "p", "answer": [
      {"role": "assistant", "content": "a"}]})], "heldout.jsonl")
  config = ConfigDict({"data": {"prompt_key": "prompt", "answer_key": "answer",
                                "task_key": "task"}, "worker": {"default_task": "math"}})
  with pytest.raises(ValueError, match=r"heldout.jsonl:1: field 'answer': .* the data.jsonl of "
                                       r"`rlax-ps sft` takes those; a held-out or RL record's "
                                       r"answer is the one reference its verifier checks"):
    config_records(config, "data.heldout_jsonl", str(path))


def test_the_built_in_stream_mixes_tasks_in_proportion_to_their_weights():
  tasks = [get_task("addition"), get_task("reversal")]
  stream = TaskPrompts(tasks, [1.0, 3.0], seed=0)
  counts = collections.Counter(stream[i]["task"] for i in range(400))
  assert 60 <= counts["addition"] <= 140 and 260 <= counts["reversal"] <= 340, counts
