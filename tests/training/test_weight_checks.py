"""`push_stats`: the weight pushes' stats of a run's transfers, combined into one step's metrics."""

from types import SimpleNamespace

from selfopd.training.weight_checks import push_stats


def _engine(stats: dict[str, float]) -> SimpleNamespace:
    """An engine holding a transfer whose last push left `stats` (a real `WeightTransfer` needs vLLM servers)."""
    return SimpleNamespace(weight_sync=SimpleNamespace(stats=stats))


def _stats(verified: float, seconds: float) -> dict[str, float]:
    """The keys `WeightTransfer.push` reports."""
    return {"time/push": seconds, "time/push_broadcast": seconds / 2, "time/push_verify": seconds / 4 * verified,
            "sync/verified": verified, "sync/untrained_tensors": 0.0, "sync/gigabytes": 0.5,
            "sync/broadcasts": 3.0, "sync/groups": 1.0}


def test_push_stats_sums_costs_and_verified_means_every_push_was():
    """Student and `ema` teacher transfers: times, bytes and counts add up; the flag is 1 only when
    both pushes were verified (a sum would report 2, or 1 with one skipped)."""
    for student, teacher, verified in [(1.0, 1.0, 1.0), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 0.0)]:
        run = SimpleNamespace(student_engine=_engine(_stats(student, 4.0)), teacher=SimpleNamespace(engine=_engine(_stats(teacher, 2.0))))
        totals = push_stats(run)
        assert totals["sync/verified"] == verified
        assert totals["time/push"] == 6.0 and totals["sync/gigabytes"] == 1.0
        assert totals["sync/broadcasts"] == 6.0 and totals["sync/groups"] == 2.0


def test_push_stats_of_one_shared_transfer_is_its_own():
    """A `self` teacher shares the student's transfer: counted once; engines without one add nothing."""
    shared = _engine(_stats(0.0, 4.0))
    assert push_stats(SimpleNamespace(student_engine=shared, teacher=SimpleNamespace(engine=shared))) == _stats(0.0, 4.0)
    local, fixed = SimpleNamespace(), SimpleNamespace(weight_sync=None)  # in process; a frozen teacher's server
    assert push_stats(SimpleNamespace(student_engine=shared, teacher=SimpleNamespace(engine=local))) == _stats(0.0, 4.0)
    assert push_stats(SimpleNamespace(student_engine=local, teacher=SimpleNamespace(engine=fixed))) == {}


def test_an_engine_that_loads_its_own_weights_reports_its_own_stats():
    """The colocated engine has no transfer: its `stats` are the push's (a `self` teacher is the same engine)."""
    colocated = SimpleNamespace(stats={"time/push": 2.0, "time/push_verify": 0.0, "sync/verified": 0.0})
    assert push_stats(SimpleNamespace(student_engine=colocated, teacher=SimpleNamespace(engine=colocated))) == colocated.stats


def test_the_sampler_probe_is_skipped_when_a_filter_renormalises_the_sampler():
    """check_sampler compares a server's sampled logprobs with the trainer's whole tempered distribution:
    with rollout.top_p < 1, top_k > 0 or min_p > 0 the server's are over the kept tokens only, so the
    probe would fail every such run; it is skipped, and a run without a filter does ask the server."""
    import pytest

    from selfopd.config import load_config
    from selfopd.training.weight_checks import check_sampler

    class Asked(Exception):
        pass

    def sample(*args, **kwargs):
        raise Asked

    for sets in (["rollout.top_k=20"], ["rollout.min_p=0.05"], ["rollout.top_p=0.95"]):
        config = load_config(None, [*sets, "loss.is_cap=0"])
        run = SimpleNamespace(config=config, model=object(), student_engine=SimpleNamespace(sample=sample))
        assert check_sampler(run) == {}
    run = SimpleNamespace(config=load_config(None, []), model=object(), student_engine=SimpleNamespace(sample=sample),
                          probe=([1, 2], [3]))
    with pytest.raises(Asked):
        check_sampler(run)
