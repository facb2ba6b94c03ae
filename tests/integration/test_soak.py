"""The fault-injection soak's short variant (benches/soak.py): steady load through Envoy on
the simulated fleet while engines are killed and frozen, their KV events dropped and
reordered, the sidecar killed and the feed stalled; then every invariant must hold. The
long run and its figures: docs/reliability.md."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
import soak  # noqa: E402


def test_a_short_soak_loses_nothing_and_fails_no_request_it_should_not(build):
    # 30 s of faults: a whole round of the five kinds takes at most ~22 s (each fault's
    # longest plus its gap), and the engines outgrow their replay buffer by ~8 s, so a
    # later round's sidecar kill lands past it (at 25 s, four runs: every kind, 8-9 faults,
    # 4-6 restarts past the buffer, 3600-6300 requests).
    args = soak.parser().parse_args(["--seconds", "30", "--engines", "3", "--clients", "4", "--build", build,
                                     "--gap-min", "0.5", "--gap-max", "1.5", "--churn-blocks", "200000",
                                     "--churn-rate", "40000", "--log-max-blocks", "50000", "--seed", "7",
                                     # ~8 s of an engine's batches (~30 a second here): the soak
                                     # puts a round's sidecar kill after the other faults until
                                     # an engine outgrew it, while a restart's gap (down <= 1.5 s
                                     # plus a checkpoint's age) stays well inside it.
                                     "--buffer-steps", "250"])
    r = soak.run(args)
    print(r)
    assert r["violations"] == []
    # Every kind of fault happened, and the run did real work.
    assert all(n >= 1 for n in r["faults"].values()), r["faults"]
    assert r["zmq_messages"]["dropped"] > 0 and r["zmq_messages"]["reordered"] > 0
    assert r["requests_ok"] > 500 and r["down_marks"] >= 1
    # The index is exact, also after sidecar restarts that ZMQ's replay alone could not
    # make exact (the checkpoint does).
    assert sum(r["engine_blocks"].values()) > 0 and r["sidecar_restarts_past_replay_buffer"] >= 1
    assert all(m == {"missing": 0, "phantom": 0} for m in r["mismatched_blocks"].values())
    assert r["churn"]["blocks"] >= 200_000 and r["churn"]["mismatched_blocks"] == 0
