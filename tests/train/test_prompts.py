"""The RL prompt stream: JSONL records from a path or a URL (gs:// on TPU VMs; file:// here,
through the same tensorstore reader), bad records named by file, line and field, and a
feed whose checkpointed state resumes the same stream."""

import json

import pytest

from rlax_ps.train.prompts import PromptFeed, read_jsonl

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
  assert read_jsonl(str(path), default_task="reversal") == want
  assert read_jsonl(f"file://{path}", default_task="reversal") == want


@pytest.mark.parametrize("line, message", [
    ("{not json", "data.jsonl:2: not JSON"),
    ("[1, 2]", "data.jsonl:2: expected an object, got list"),
    ('{"prompt": "", "answer": "1"}', "data.jsonl:2: field 'prompt': expected a non-empty "
                                      "string"),
    ('{"prompt": "a", "answer": 3}', "data.jsonl:2: field 'answer': expected a string"),
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
    read_jsonl(str(path), known=["addition", "math"], field="data.heldout_jsonl")


def test_a_missing_file_or_object_is_refused_naming_the_field(tmp_path):
  for missing in (str(tmp_path / "nope.jsonl"), f"file://{tmp_path}/nope.jsonl"):
    with pytest.raises(ValueError, match=f"^data.jsonl: no (file|object at) .*nope.jsonl"):
      read_jsonl(missing)
  with pytest.raises(ValueError, match="^data.jsonl: cannot read bogus://b/k: .*scheme"):
    read_jsonl("bogus://b/k")
  with pytest.raises(ValueError, match="empty.jsonl: no prompt records"):
    read_jsonl(str(_write(tmp_path, [""], "empty.jsonl")))


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
  with pytest.raises(ValueError, match="checkpoint data state: expected"):
    again.restore({"position": 1})
