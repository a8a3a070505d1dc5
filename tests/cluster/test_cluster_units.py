"""The cluster backend's pure parts, without a cluster: splitting a batch by tokens, merging the ranks'
results, renumbering a rank's error, and the start-up resource check."""

from __future__ import annotations

import pytest

from server_mock.cluster import ClusterConfig, ClusterError
from server_mock.cluster.data_parallel import global_error, merge_results, split_by_tokens
from server_mock.cluster.placement import check_reachable, check_resources
from server_mock.errors import WorkerError


@pytest.mark.parametrize("lengths,parts", [([5, 40, 7, 33, 12, 12, 9], 2), ([3, 3, 3], 4), ([100, 1, 1, 1, 1], 3),
                                           ([], 2), (list(range(1, 30)), 3)])
def test_split_covers_every_datum_once_and_balances_tokens(lengths, parts):
    shards = split_by_tokens(lengths, parts)
    assert len(shards) == parts
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    assert all(s == sorted(s) for s in shards)
    loads = [sum(lengths[i] for i in s) for s in shards]
    if lengths:
        # greedy longest-first: no shard exceeds the ideal share by more than the longest datum
        assert max(loads) <= sum(lengths) / parts + max(lengths)
    assert split_by_tokens([10, 10, 10, 10], 2) in ([[0, 2], [1, 3]], [[0, 3], [1, 2]])


def test_merge_puts_outputs_back_in_request_order_and_sums_token_losses():
    shards = [[1, 3], [0, 2]]
    results = [{"outputs": ["b", "d"], "metrics": {"loss_sum": 1.5, "token_count": 3.0}},
               {"outputs": ["a", "c"], "metrics": {"loss_sum": 2.5, "token_count": 5.0}}]
    merged = merge_results(shards, results, 4)
    assert merged["outputs"] == ["a", "b", "c", "d"]
    assert merged["metrics"] == {"loss_sum": 4.0, "loss:sum": 4.0, "token_count": 8.0, "loss_mean": 0.5}
    empty = merge_results([[], []], [{"outputs": [], "metrics": {"loss_sum": 0.0, "token_count": 0.0}}] * 2, 0)
    assert empty["metrics"]["loss_mean"] == 0.0


def test_rank_error_names_the_request_datum():
    err = global_error(WorkerError(422, "non_finite_loss", "data[1]: the loss is not finite", "data"), [4, 7, 9])
    assert err.message == "data[7]: the loss is not finite" and err.code == "non_finite_loss" and err.status == 422
    other = WorkerError(400, "x", "no index here")
    assert global_error(other, [3]) is other


def test_resource_check_names_the_resource_and_what_the_cluster_offers():
    nodes = [{"CPU": 4.0}, {"CPU": 2.0, "GPU": 1.0}]
    check_resources(ClusterConfig(sampler_replicas=2, train_replicas=2, trainer_groups=1), {"CPU": 6.0}, nodes)
    with pytest.raises(ClusterError, match=r"not enough CPUs: .* need 7 CPUs; the cluster has 6 available"):
        check_resources(ClusterConfig(sampler_replicas=3, train_replicas=2, trainer_groups=2), {"CPU": 6.0}, nodes)
    with pytest.raises(ClusterError, match="not enough GPUs.*need 2 GPUs; the cluster has 1 available"):
        check_resources(ClusterConfig(sampler_replicas=1, train_replicas=1, gpus_per_replica=1), {"CPU": 6.0,
                                                                                                    "GPU": 1.0}, nodes)
    with pytest.raises(ClusterError, match="no node has 5 CPUs for one replica.*largest node offers 4"):
        check_resources(ClusterConfig(cpus_per_replica=5), {"CPU": 10.0}, nodes)
    with pytest.raises(ClusterError, match="2 model"):  # every served model gets its own replicas
        check_resources(ClusterConfig(sampler_replicas=2, train_replicas=2), {"CPU": 6.0}, nodes, models=2)


@pytest.mark.parametrize("field,value,limit", [("sampler_replicas", 0, "--sampler-replicas must be in [1, 256]"),
                                               ("train_replicas", 257, "--train-replicas must be in [1, 256]"),
                                               ("cpus_per_replica", 0.0, "--cpus-per-replica must be > 0"),
                                               ("gpus_per_replica", 1.5, "must be a whole number")])
def test_config_bounds(field, value, limit):
    assert any(limit in p for p in ClusterConfig(**{field: value}).problems())


def test_bad_address_is_refused_naming_it():
    with pytest.raises(ClusterError, match="'nohost'"):
        check_reachable("nohost", 1.0)
    with pytest.raises(ClusterError, match=r"cannot reach the Ray cluster at 127\.0\.0\.1:1 "):
        check_reachable("127.0.0.1:1", 1.0)



def test_merge_adds_kl_and_entropy_sums_and_recomputes_their_means():
    """With kl_coef / return_entropy each rank reports sums over its counted tokens; the call's means are the
    merged sums over the merged token count (not a mean of means)."""
    shards = [[0], [1]]
    results = [
        {"outputs": [{"a": 0}], "metrics": {"loss_sum": 1.0, "token_count": 3.0, "kl_sum": 0.3, "entropy_sum": 6.0}},
        {"outputs": [{"a": 1}], "metrics": {"loss_sum": 2.0, "token_count": 1.0, "kl_sum": 0.5, "entropy_sum": 1.0}},
    ]
    metrics = merge_results(shards, results, 2)["metrics"]
    assert metrics["kl_sum"] == pytest.approx(0.8) and metrics["kl_mean"] == pytest.approx(0.2)
    assert metrics["entropy_sum"] == pytest.approx(7.0) and metrics["entropy_mean"] == pytest.approx(1.75)
    assert metrics["kl:mean"] == metrics["kl_mean"] and metrics["entropy:sum"] == metrics["entropy_sum"]
    plain = merge_results(shards, [{"outputs": r["outputs"], "metrics": {"loss_sum": 1.0, "token_count": 2.0}}
                                   for r in results], 2)["metrics"]
    assert set(plain) == {"loss_sum", "loss_mean", "token_count", "loss:sum"}


def test_replica_books_keep_pinned_entries_skip_stale_reports_and_forget_a_lost_replica():
    """The front end's books of the replicas' pool entries (cluster/replica_adapters.py) against a real
    ``ByteBudget``: a running call's snapshots are never reclaimed; an older report than one taken changes
    nothing; a replica lost gives its charges back; a reserve refused leaves the budget as it was."""
    from server_mock.cluster.replica_adapters import ReplicaAdapters, Report
    from server_mock.service.quotas import ByteBudget, PoolCharge

    budget = ByteBudget(1 << 40, 300, "lora", "max_adapter_bytes", "max_adapter_bytes_total")
    dropped: list[tuple[int, list[str]]] = []
    books = ReplicaAdapters(PoolCharge(budget, "tiny"), lambda replica, ids: dropped.append((replica, ids)))
    books.reserve(0, {"a": 100, "b": 100}, pooled=True)  # a running call on replica 0
    assert budget.held == budget.shared == 200
    assert books.reclaim(200) == 0 and budget.held == 200 and not dropped  # pinned: kept
    books.settle(0, {"a": 100, "b": 100}, Report(7, 2, {"a": 100, "b": 100}))
    books.settle(0, {}, Report(7, 1, {}))  # stale: replica 0's call 1 ended before call 2
    assert books.charged(0) == {"a": 100, "b": 100}
    books.reserve(1, {"c": 100}, pooled=False)  # one set of weights: pinned, nothing charged
    books.settle(1, {"c": 100}, Report(8, 1, {}))
    assert budget.held == 200
    with pytest.raises(WorkerError, match="--max-adapter-bytes-total=300"):
        books.reserve(1, {"c": 100, "d": 100, "e": 100, "f": 100}, pooled=True)
    assert budget.held == 200 and not dropped and books.charged(1) == {}
    books.reserve(1, {"c": 100, "d": 100}, pooled=True)  # 100 missing: replica 0's oldest entry goes
    assert dropped == [(0, ["a"])] and budget.held == 300 and books.charged(0) == {"b": 100}
    books.settle(1, {"c": 100, "d": 100}, None, lost=True)
    assert books.charged(1) == {} and budget.held == 100
