"""Generated protobuf and gRPC code for `param_server.proto` (package rlax_ps.v1).

The generated modules are committed. Regenerate after editing the .proto, from
the repo root (`make protos`):

  .venv/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. \
    --grpc_python_out=. param_server/protos/param_server.proto

`tests/param_server/test_proto_codegen.py` fails when the committed code is stale.
"""

# What a worker's decode loop spends time on: pb.WorkerTime's fields NAME_s besides total_s
# and slot_s (the worker's heartbeats, `rlax-ps status`, the metrics' activity label).
WORKER_ACTIVITIES = ("decoding", "waiting_prompts", "waiting_weights", "submitting", "scoring")

# A sample's metadata key, "1" where a verifier (its task's or a reward term's) raised on it
# and scored it 0: the trainer counts them so a broken verifier shows past the worker's log.
SCORE_ERROR = "score_error"

# A prompt's metadata key: the sampling seed the trainer gave it (from its own seed and the
# prompt's place in its feed). A worker's samples of that prompt draw their seeds from it
# (else from the worker's seed and the prompt id), so any worker samples it alike: in
# another workdir, after a stop hands it to another worker, with several workers.
PROMPT_SEED = "seed"
