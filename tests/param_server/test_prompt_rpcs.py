"""Prompts, leases, rollouts and workers over gRPC: each RPC's happy path and its status codes."""

import re
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from param_server.client import (ParamServerError, make_routes, make_sample, routes_of,
                                 sample_logprobs)
from param_server.protos import param_server_pb2 as pb
from param_server.server import ServerConfig
from param_server.status_main import format_stats
from ps_testlib import REPO, TOKENS, client_for, publish_chain


def prompts(n, prefix="p"):
  return [pb.Prompt(id=f"{prefix}{i}", text=f"what is {i}+{i}?", token_ids=[1, i + 2], task="add",
                    metadata={"answer": str(2 * i)}) for i in range(n)]


def group_for(prompt, version=0, reward=1.0):
  samples = [make_sample([7, 8, 9], reward, text="4", logprobs=np.array([-0.1, -0.2, -0.3]),
                         finish_reason="stop") for _ in range(2)]
  return pb.RolloutGroup(prompt_id=prompt.id, samples=samples, policy_version=version)


def code_of(call):
  with pytest.raises(ParamServerError) as info:
    call()
  return info.value.code, info.value.details


def test_full_prompt_to_rollout_cycle(trainer, worker):
  publish_chain(trainer, 1)
  assert trainer.enqueue_prompts(prompts(3)).queue_depth == 3
  lease = worker.lease(3, deadline_s=30)
  assert [p.metadata["answer"] for p in lease.prompts] == ["0", "2", "4"]
  for p in lease.prompts:
    reply = worker.submit_rollouts(lease.lease_id, group_for(p), policy_version=0)
  assert reply.lease_closed
  assert worker.complete(lease) == 3
  take = trainer.take_rollouts(min_version=0, max_n=10)
  assert [r.prompt.id for r in take.rollouts] == ["p0", "p1", "p2"]
  assert all(r.worker_id == worker.worker_id for r in take.rollouts)
  np.testing.assert_allclose(sample_logprobs(take.rollouts[0].group.samples[0]), [-0.1, -0.2, -0.3], rtol=1e-6)
  assert trainer.ack(take) == 3
  stats = trainer.stats()
  assert (stats.rollouts_ready, stats.rollouts_in_flight, stats.rollouts_accepted) == (0, 0, 3)


def test_a_retried_submission_is_acknowledged_not_duplicated(trainer, worker):
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  first = worker.submit_rollouts(lease.lease_id, group_for(lease.prompts[0]))
  again = worker.submit_rollouts(lease.lease_id, group_for(lease.prompts[0]))
  assert again.duplicate and again.rollout_id == first.rollout_id
  assert len(trainer.take_rollouts(max_n=10).rollouts) == 1


def test_an_expired_lease_returns_its_prompts_and_rejects_late_rollouts(trainer, worker):
  trainer.enqueue_prompts(prompts(2))
  lease = worker.lease(2, deadline_s=0.2)
  time.sleep(0.5)
  assert trainer.stats().prompts_queued == 2
  other = client_for(worker.address, "worker")
  other.register("other")
  again = other.lease(2, deadline_s=30)
  assert sorted(p.id for p in again.prompts) == ["p0", "p1"]
  code, details = code_of(lambda: worker.submit_rollouts(lease.lease_id, group_for(lease.prompts[0])))
  assert code == grpc.StatusCode.FAILED_PRECONDITION and "expired" in details
  other.submit_rollouts(again.lease_id, group_for(again.prompts[0]))
  assert trainer.stats().rollouts_ready == 1
  other.close()


def test_renew_keeps_a_lease_alive(trainer, worker):
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=1.0)
  for _ in range(3):
    time.sleep(0.4)  # 3 x 0.4 s outlives the first deadline
    worker.renew(lease, deadline_s=1.0)
  worker.submit_rollouts(lease.lease_id, group_for(lease.prompts[0]))
  assert trainer.stats().leases_expired == 0


def test_release_puts_prompts_back(trainer, worker):
  trainer.enqueue_prompts(prompts(2))
  lease = worker.lease(2, deadline_s=30)
  assert worker.release(lease, ["p1"]) == 1
  assert [p.id for p in worker.lease(5, deadline_s=30).prompts] == ["p1"]


def test_partial_rollouts_released_with_a_prompt_reach_the_next_lease(trainer, worker):
  publish_chain(trainer, 1)
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  begun = make_sample([7, 8], 0.0, logprobs=np.array([-0.1, -0.2]))
  assert worker.release(lease, partial=[pb.PartialRollouts(
      prompt_id="p0", samples=[begun], policy_version=0)]) == 1
  again = worker.lease(1, deadline_s=30).prompts[0]
  assert again.id == "p0" and list(again.partial) == [begun] and again.partial_version == 0
  stats = trainer.stats()
  assert (stats.prompts_resumed, stats.samples_resumed, stats.tokens_resumed) == (1, 1, 2)
  assert re.search(r"prompts resumed\s+1 \(1 begun samples, 2 tokens continued\)",
                   format_stats(stats))


def test_a_renewal_naming_more_tokens_than_the_server_holds_gets_a_status(trainer, worker):
  publish_chain(trainer, 1)
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  begun = make_sample([7, 8], 0.0, logprobs=np.array([-0.1, -0.2]))
  worker.renew(lease, 30, partial=[pb.PartialRollouts(prompt_id="p0", samples=[begun])])
  more = make_sample([9], 0.0, logprobs=np.array([-0.3]))
  code, details = code_of(lambda: worker.renew(lease, 30, partial=[pb.PartialRollouts(
      prompt_id="p0", samples=[more], kept=[3])]))
  assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("partial[0].kept[0]")
  worker.renew(lease, 30, partial=[pb.PartialRollouts(prompt_id="p0", samples=[more], kept=[2])])
  assert worker.release(lease) == 1
  (again,) = worker.lease(1, deadline_s=30).prompts[0].partial
  assert list(again.token_ids) == [7, 8, 9]


def test_increments_a_lease_reply_could_not_carry_get_a_status_and_the_prompt_goes_on(
    trainer, worker):
  """Each renewal under the 1 MiB message limit, the samples joined past it: refused with
  RESOURCE_EXHAUSTED (the next lease of the prompt failed to send, at every deadline)."""
  publish_chain(trainer, 1)
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  n = 100_000  # ~0.7 MB a renewal
  piece = lambda first: make_sample(list(range(first, first + n)), 0.0,  # noqa: E731
                                    logprobs=np.full(n, -0.5))
  worker.renew(lease, 30, partial=[pb.PartialRollouts(prompt_id="p0", samples=[piece(0)])])
  code, details = code_of(lambda: worker.renew(lease, 30, partial=[pb.PartialRollouts(
      prompt_id="p0", samples=[piece(n)], kept=[n])]))
  assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
  assert re.match(r"partial\[0\]: prompt 'p0' would hold \d+ bytes .* more than the 1048576 "
                  r"a lease can carry", details), details
  assert worker.release(lease) == 1
  (again,) = worker.lease(1, deadline_s=30).prompts[0].partial
  assert list(again.token_ids) == list(range(n))


def test_a_silent_workers_leases_expire_long_before_their_deadlines(start_server):
  """A worker killed without notice falls silent: after silent_worker_heartbeats periods its
  leases expire, their prompts queued again with the samples its renewal carried, while a
  worker that keeps beating (or leasing) keeps its own."""
  server = start_server(heartbeat_interval_s=0.1, silent_worker_heartbeats=3,
                        reap_interval_s=0.05)
  with client_for(server, "trainer") as trainer, client_for(server, "worker") as dead, \
       client_for(server, "worker") as alive:
    trainer.enqueue_prompts(prompts(4))
    dead.register("dies")
    alive.register("lives")
    gone, kept = dead.lease(2, deadline_s=600), alive.lease(2, deadline_s=600)
    begun = make_sample([7, 8], 0.0, logprobs=np.array([-0.1, -0.2]))
    dead.renew(gone, 600, partial=[pb.PartialRollouts(prompt_id=gone.prompts[0].id,
                                                      samples=[begun])])
    end = time.monotonic() + 20
    while trainer.stats().leases_expired == 0 and time.monotonic() < end:
      alive.heartbeat(version=-1, tokens_per_s=0.0)
      time.sleep(0.05)
    stats = trainer.stats()
    assert stats.leases_expired == 1 and stats.prompts_queued == 2
    alive.renew(kept, 600)  # still its own
    code, details = code_of(lambda: dead.submit_rollouts(gone.lease_id,
                                                         group_for(gone.prompts[0])))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "expired" in details
    back = {p.id: p for p in alive.lease(4, deadline_s=600).prompts}
  assert set(back) == {p.id for p in gone.prompts}
  assert list(back[gone.prompts[0].id].partial) == [begun]
  with pytest.raises(ValueError, match=r"ServerConfig.silent_worker_heartbeats: expected 0 "
                                       r"\(off\) or >= 2, got 1"):
    ServerConfig(silent_worker_heartbeats=1)


def test_leases_recovered_after_a_restart_expire_once_their_worker_stays_silent(start_server):
  """A restarted server has heard from no worker: the holder of a lease recovered from the
  log that never comes back falls silent like any other, and the lease expires then, not
  at its deadline (600 s here); one that comes back and beats keeps its own."""
  fast = dict(heartbeat_interval_s=0.1, silent_worker_heartbeats=3, reap_interval_s=0.05)
  first = start_server(**fast)
  with client_for(first, "trainer") as trainer, client_for(first, "worker") as dead, \
       client_for(first, "worker") as alive:
    trainer.enqueue_prompts(prompts(4))
    dead.register("dies")
    alive.register("lives")
    dead.lease(2, deadline_s=600)
    kept = alive.lease(2, deadline_s=600)
    alive_id = alive.worker_id
  first.stop(grace=0)
  again = start_server(**fast)
  with client_for(again, "trainer") as trainer, client_for(again, "worker") as alive:
    alive.worker_id = alive_id  # (the client a worker keeps across the restart)
    assert trainer.stats().leases_active == 2
    assert not trainer.stats().workers  # none heard from yet: none listed
    end = time.monotonic() + 20
    while trainer.stats().leases_expired == 0 and time.monotonic() < end:
      alive.heartbeat(version=-1, tokens_per_s=0.0)
      time.sleep(0.05)
    stats = trainer.stats()
    assert stats.leases_expired == 1 and stats.prompts_queued == 2 and stats.leases_active == 1
    assert [w.worker_id for w in stats.workers] == [alive_id]
    alive.renew(kept, 600)  # still its own


def test_lease_long_poll_wakes_when_prompts_arrive(trainer, worker):
  timer = threading.Timer(0.2, lambda: trainer.enqueue_prompts(prompts(1)))
  timer.start()
  lease = worker.lease(1, deadline_s=30, wait_s=5)
  timer.join()
  assert [p.id for p in lease.prompts] == ["p0"]
  assert worker.lease(1, deadline_s=30, wait_s=0.05).lease_id == ""


def test_unacked_rollouts_are_delivered_again(trainer, worker):
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  worker.submit_rollouts(lease.lease_id, group_for(lease.prompts[0]))
  first = trainer.take_rollouts(max_n=5, ack_deadline_s=0.2)
  time.sleep(0.4)
  second = trainer.take_rollouts(max_n=5, ack_deadline_s=30)
  assert [r.rollout_id for r in second.rollouts] == [r.rollout_id for r in first.rollouts]
  code, _ = code_of(lambda: trainer.ack(first))
  assert code == grpc.StatusCode.NOT_FOUND
  assert trainer.ack(second) == 1
  stats = trainer.stats()
  assert stats.takes_requeued == 1
  assert re.search(r"takes requeued\s+1 \(given back unacked", format_stats(stats))


def test_take_drops_stale_rollouts_and_requeues_their_prompts(trainer, worker):
  publish_chain(trainer, 3)
  trainer.enqueue_prompts(prompts(2))
  lease = worker.lease(2, deadline_s=30)
  worker.submit_rollouts(lease.lease_id, group_for(lease.prompts[0], version=0))
  worker.submit_rollouts(lease.lease_id, group_for(lease.prompts[1], version=2))
  take = trainer.take_rollouts(min_version=1, max_n=5)
  assert [r.prompt.id for r in take.rollouts] == ["p1"] and take.dropped_stale == 1
  assert trainer.stats().prompts_queued == 1


@pytest.mark.parametrize("call, code, field", [
    (lambda t, w: w.lease(0, deadline_s=1), grpc.StatusCode.INVALID_ARGUMENT, "n"),
    (lambda t, w: w.lease(1, deadline_s=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "deadline_s"),
    (lambda t, w: w.renew("nope", 1.0), grpc.StatusCode.NOT_FOUND, "lease_id"),
    (lambda t, w: w.renew("x", 1.0, partial=[pb.PartialRollouts(
        prompt_id="p0", samples=[pb.Sample(token_ids=[1], logprobs=[-0.5, -1.0])])]),
     grpc.StatusCode.INVALID_ARGUMENT, "partial[0].samples[0].logprobs"),
    (lambda t, w: w.complete("nope"), grpc.StatusCode.NOT_FOUND, "lease_id"),
    (lambda t, w: w.release("", ()), grpc.StatusCode.INVALID_ARGUMENT, "lease_id"),
    (lambda t, w: w.release("x", (), partial=[pb.PartialRollouts(
        prompt_id="p0", samples=[pb.Sample(token_ids=[-1])])]), grpc.StatusCode.INVALID_ARGUMENT,
     "partial[0].samples[0].token_ids[0]"),
    (lambda t, w: w.submit_rollouts("nope", pb.RolloutGroup(prompt_id="p0", samples=[pb.Sample()])),
     grpc.StatusCode.NOT_FOUND, "lease_id"),
    (lambda t, w: w.submit_rollouts("x", pb.RolloutGroup(prompt_id="p0")), grpc.StatusCode.INVALID_ARGUMENT,
     "group.samples"),
    (lambda t, w: t.enqueue_prompts([pb.Prompt(id="empty")]), grpc.StatusCode.INVALID_ARGUMENT, "prompts[0]"),
    (lambda t, w: t.take_rollouts(max_n=0), grpc.StatusCode.INVALID_ARGUMENT, "max_groups"),
    (lambda t, w: t.take_rollouts(ack_deadline_s=-1), grpc.StatusCode.INVALID_ARGUMENT, "ack_deadline_s"),
    (lambda t, w: t.ack("nope"), grpc.StatusCode.NOT_FOUND, "take_id"),
    (lambda t, w: w.heartbeat(version=-9), grpc.StatusCode.INVALID_ARGUMENT, "version"),
    (lambda t, w: w.register(""), grpc.StatusCode.INVALID_ARGUMENT, "name"),
    (lambda t, w: next(w.watch(after_version=-3, timeout_s=5)), grpc.StatusCode.INVALID_ARGUMENT, "after_version"),
])
def test_bad_requests_get_a_status_naming_the_field(trainer, worker, call, code, field):
  trainer.enqueue_prompts(prompts(1))
  before = trainer.stats()
  got, details = code_of(lambda: call(trainer, worker))
  assert got == code and details.startswith(field)
  after = trainer.stats()
  assert (after.prompts_queued, after.leases_active, after.rollouts_ready) == (
      before.prompts_queued, before.leases_active, before.rollouts_ready)
  assert after.errors == before.errors + 1


def routed_group(prompt, experts=4):
  """group_for(prompt) with routing replay's routes: 2 prompt tokens, 2 of 3 sample tokens."""
  group = group_for(prompt)
  rng = np.random.default_rng(0)
  group.prompt_routes.CopyFrom(make_routes(rng.integers(0, experts, (2, 3, 2))))
  for s in group.samples:
    s.routes.CopyFrom(make_routes(rng.integers(0, experts, (2, 3, 2))))
  return group


@pytest.mark.parametrize("experts,id_bytes", [(4, 1), (300, 2)])
def test_routes_travel_with_their_group(trainer, worker, experts, id_bytes):
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  sent = routed_group(lease.prompts[0], experts)
  assert sent.prompt_routes.id_bytes == id_bytes
  worker.submit_rollouts(lease.lease_id, sent)
  got = trainer.take_rollouts(max_n=1).rollouts[0].group
  np.testing.assert_array_equal(routes_of(got.prompt_routes), routes_of(sent.prompt_routes))
  assert routes_of(got.samples[1].routes).shape == (2, 3, 2)
  np.testing.assert_array_equal(routes_of(got.samples[1].routes),
                                routes_of(sent.samples[1].routes))


def _drop_prompt_routes(g):
  g.ClearField("prompt_routes")


def _drop_sample_routes(g):
  g.samples[1].ClearField("routes")


def _one_token_short(g):
  g.samples[0].routes.ids = g.samples[0].routes.ids[:6]


def _odd_bytes(g):
  g.prompt_routes.ids = g.prompt_routes.ids[:-1]


def _other_layers(g):
  g.samples[0].routes.CopyFrom(make_routes(np.zeros((2, 2, 2), np.int32)))


def _bad_width(g):
  g.prompt_routes.id_bytes = 3


@pytest.mark.parametrize("spoil,field", [
    (_drop_prompt_routes, "group.prompt_routes"), (_drop_sample_routes, "group.samples[1].routes"),
    (_one_token_short, "group.samples[0].routes"), (_odd_bytes, "group.prompt_routes.ids"),
    (_other_layers, "group.samples[0].routes"), (_bad_width, "group.prompt_routes")])
def test_malformed_routes_get_a_status_naming_the_field(trainer, worker, spoil, field):
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  group = routed_group(lease.prompts[0])
  spoil(group)
  code, details = code_of(lambda: worker.submit_rollouts(lease.lease_id, group))
  assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
  worker.submit_rollouts(lease.lease_id, routed_group(lease.prompts[0]))  # the lease holds
  assert len(trainer.take_rollouts(max_n=10).rollouts) == 1


def test_a_group_over_the_servers_limit_is_refused_before_sending(trainer, worker):
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  assert worker.max_request_bytes == (1 << 20) + (64 << 10)  # told when it registered
  big = group_for(lease.prompts[0])
  big.samples[0].text = "x" * worker.max_request_bytes
  before = trainer.stats().errors
  code, details = code_of(lambda: worker.submit_rollouts(lease.lease_id, big))
  assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("group: ")
  assert "rlax-ps serve --max_message_bytes" in details
  assert trainer.stats().errors == before  # never sent
  worker.submit_rollouts(lease.lease_id, group_for(lease.prompts[0]))


def test_groups_larger_than_grpcs_default_pass_when_the_server_takes_them(start_server):
  server = start_server(max_message_bytes=24 << 20)
  with client_for(server, "trainer") as trainer, client_for(server, "worker") as worker:
    worker.register("w")
    trainer.enqueue_prompts(prompts(1))
    lease = worker.lease(1, deadline_s=30)
    big = group_for(lease.prompts[0])
    big.samples[0].text = "x" * (17 << 20)  # more than 4x gRPC's default limit
    worker.submit_rollouts(lease.lease_id, big)
    assert len(trainer.take_rollouts(max_n=1).rollouts[0].group.samples[0].text) == 17 << 20


def test_a_group_near_the_limit_with_a_long_prompt_is_taken(trainer, worker):
  """Each within the request limit, a group and its prompt together exceed it: the take
  reply (one group at least) still goes out (it failed every take: the group came back at
  its ack deadline and failed again, for ever)."""
  limit = worker.max_request_bytes
  long_prompt = pb.Prompt(id="long", text="p" * (limit // 2))
  trainer.enqueue_prompts([long_prompt])
  lease = worker.lease(1, deadline_s=30)
  big = group_for(lease.prompts[0])
  big.samples[0].text = "x" * (limit - (200 << 10))
  worker.submit_rollouts(lease.lease_id, big)
  (taken,) = trainer.take_rollouts(max_n=1).rollouts
  assert taken.group.ByteSize() + taken.prompt.ByteSize() > limit
  assert len(taken.group.samples[0].text) == limit - (200 << 10)
  assert taken.prompt.text == long_prompt.text


def test_a_foreign_lease_is_rejected(trainer, worker):
  trainer.enqueue_prompts(prompts(1))
  lease = worker.lease(1, deadline_s=30)
  code, details = code_of(lambda: worker.submit_rollouts(
      lease.lease_id, group_for(lease.prompts[0]), worker_id="someone-else"))
  assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("worker_id")


def test_workers_register_heartbeat_and_show_in_stats(trainer, worker, viewer):
  publish_chain(trainer, 2)
  assert worker.heartbeat(version=1, tokens_per_s=123.0).latest_version == 1
  stats = viewer.stats()
  assert stats.workers_alive == 1
  (w,) = stats.workers
  assert (w.worker_id, w.version, w.tokens_per_s) == (worker.worker_id, 1, 123.0)
  table = format_stats(stats)
  assert worker.worker_id in table and "v1 (bf16)" in table


def test_a_leaving_worker_is_listed_and_counted_no_more(trainer, worker, viewer):
  publish_chain(trainer, 1)
  worker.heartbeat(version=0)
  assert viewer.stats().workers_alive == 1
  assert worker.heartbeat(version=0, leaving=True).latest_version == 0
  stats = viewer.stats()
  assert stats.workers_alive == 0 and not stats.workers


def test_relays_report_their_version_apart_from_the_workers(trainer, worker, viewer):
  publish_chain(trainer, 3)
  worker.heartbeat(version=2)
  reply = worker.heartbeat(version=0, worker_id="relay@zone-a:50052", kind="relay")
  assert reply.latest_version == 2
  stats = viewer.stats()
  assert stats.workers_alive == 1  # the relay is no worker
  kinds = {w.worker_id: (w.kind, w.version) for w in stats.workers}
  assert kinds == {worker.worker_id: ("", 2), "relay@zone-a:50052": ("relay", 0)}
  table = format_stats(stats)
  assert "workers alive 1 of 1" in " ".join(table.split())
  relay_row = next(l for l in table.splitlines() if l.startswith("relay@zone-a:50052"))
  assert relay_row.split()[1:3] == ["0", "2"]  # holds v0, two versions behind
  code, details = code_of(lambda: worker.heartbeat(version=1, kind="mirror"))
  assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("kind")


def test_rlax_ps_status_prints_the_table(server, trainer):
  trainer.enqueue_prompts(prompts(4))
  out = subprocess.run([sys.executable, "-m", "rlax_ps", "status", f"--address={server.address}",
                        f"--token={TOKENS['viewer']}"], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert "prompts queued" in out.stdout and " 4" in out.stdout.split("prompts queued")[1].splitlines()[0]
