"""A user's large prompt file: the checks before a run read it as a stream (memory does not
grow with the file, for a path, a URL read in byte ranges, or Parquet row batches), and the
data source's digest takes the records in one pass, matching the digest checkpoints keep."""

import json
import tracemalloc

import pytest

from rl_testlib import rl_config
from rlax_ps.train import prompts
from rlax_ps.train.rl_checks import check_rl_config, resume_lines
from rlax_ps.train.run import data_source


def _records(n):
  return [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)} for i in range(n)]


def _write(tmp_path, n, kind):
  if kind == "parquet":
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path = tmp_path / f"p{n}.parquet"
    pq.write_table(pa.Table.from_pylist(_records(n)), path)
    return str(path)
  path = tmp_path / f"p{n}.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in _records(n)))
  return f"file://{path}" if kind == "url" else str(path)


def _check_peak(path):
  """Peak bytes the Python heap grew by while check_rl_config read `path`."""
  config = rl_config()
  config.data.jsonl = path
  tracemalloc.start()
  try:
    check_rl_config(config)
    return tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()


@pytest.mark.parametrize("kind", ["path", "url", "parquet"])
def test_checking_a_prompt_file_holds_a_bounded_part_of_it(tmp_path, monkeypatch, kind):
  monkeypatch.setattr(prompts, "URL_CHUNK_BYTES", 4096)
  monkeypatch.setattr(prompts, "PARQUET_BATCH_ROWS", 256)
  small, large = _write(tmp_path, 400, kind), _write(tmp_path, 4000, kind)
  _check_peak(small)  # imports and caches, once
  assert _check_peak(large) < 2 * _check_peak(small)


@pytest.mark.parametrize("chunk", [7, 16, 4096])
def test_a_url_read_in_ranges_gives_every_line_whole(tmp_path, monkeypatch, chunk):
  """Lines cut by a range's end, a range ending on a newline (16 bytes: the first line), a
  line longer than a range, and a last line without a newline all come through whole."""
  monkeypatch.setattr(prompts, "URL_CHUNK_BYTES", chunk)
  lines = ['{"prompt":"1+2="}', '{"prompt": "' + "x" * 40 + '"}', "", '{"prompt":"z"}']
  path = tmp_path / "p.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
  got = prompts.read_prompts(f"file://{path}", answer_key="")
  assert [r["prompt"] for r in got] == ["1+2=", "x" * 40, "z"]
  assert prompts.read_bytes(f"file://{path}") == path.read_bytes()


def test_the_data_source_digests_records_in_one_pass_as_checkpoints_keep_them():
  """A generator is digested as it is read; the digest is the one of checkpoints written
  before (each record's sorted-key JSON, a line each)."""
  records = [("1+2=", "3", "addition"), ([{"role": "user", "content": "h\u00e9"}], "x", "math"),
             ("p", [{"role": "assistant", "content": "a"}], "math")]
  config = rl_config()
  config.data.jsonl = "train.jsonl"
  source = data_source(config, (r for r in records))
  assert source == {"seed": 0, "jsonl": "train.jsonl", "records": 3,
                    "digest": "943de9f869cfc579"}
  assert data_source(config, records) == source


def test_resume_lines_stream_the_file_they_digest(tmp_path):
  """`rlax-ps local`'s resume check digests data.jsonl as it reads it, and finds the
  checkpoint's data unchanged."""
  path = _write(tmp_path, 50, "path")
  config = rl_config()
  config.data.jsonl = path
  read = [(r["prompt"], r["answer"], r["task"])
          for r in prompts.config_records(config, "data.jsonl", path)]
  step = tmp_path / "checkpoints" / "4" / "metadata"
  step.mkdir(parents=True)
  (step / "metadata").write_text(json.dumps({"step": 4, "data_source": data_source(config, read)}))
  config.checkpoint.directory = str(tmp_path / "checkpoints")
  config.data.jsonl = path
  assert all("data:" not in line for line in resume_lines(config, str(tmp_path)))
