"""raysim's own Ray starts without Ray's API server and autoscaler monitor, without Ray's
once-a-second wait for the node (raysim.engine.cluster.lean_start) and with local sockets retried
every 20 ms (CONNECT_POLL): the
session's Ray instance (tests/conftest.py) is started the way `raysim run` starts its own, so it is
the real thing checked here."""
from __future__ import annotations

import time

import pytest

from raysim.engine import cluster


def test_raysims_own_ray_runs_no_api_server(ray_session):
    import ray._private.worker as worker

    node = worker._global_node
    assert "raylet" in node.all_processes and "gcs_server" in node.all_processes
    assert "dashboard" not in node.all_processes  # Ray's API server: the dashboard's head process
    assert "monitor" not in node.all_processes  # Ray's autoscaler monitor
    assert ray_session.get(ray_session.remote(lambda: 7).remote()) == 7  # the node works without them


def test_lean_start_changes_rays_start_only_inside(monkeypatch):
    from ray._private import node, services

    monkeypatch.delenv(cluster.API_SERVER_ENV, raising=False)
    monkeypatch.delenv(cluster.MONITOR_ENV, raising=False)
    api, get_node, monitor = node.Node.start_api_server, services.get_node, node.Node.start_monitor
    with cluster.lean_start():
        assert node.Node.start_api_server is not api
        assert node.Node.start_api_server(object(), include_dashboard=False, raise_on_failure=False) is None
        assert node.Node.start_monitor is not monitor and node.Node.start_monitor(object()) is None
        assert services.get_node is not get_node
    assert node.Node.start_api_server is api and services.get_node is get_node and node.Node.start_monitor is monitor


@pytest.mark.parametrize("env, method", [("API_SERVER_ENV", "start_api_server"), ("MONITOR_ENV", "start_monitor")])
def test_the_api_server_and_the_monitor_are_kept_where_the_user_asks(monkeypatch, env, method):
    from ray._private import node

    monkeypatch.setenv(getattr(cluster, env), "1")
    kept = getattr(node.Node, method)
    with cluster.lean_start():
        assert getattr(node.Node, method) is kept


def test_a_registered_node_is_found_at_once_and_a_missing_one_waits_its_timeout(ray_session):
    import ray._private.worker as worker

    node = worker._global_node
    t0 = time.monotonic()
    cluster._await_registration(node.gcs_address, node.node_id)
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    cluster._await_registration(node.gcs_address, "ab" * 28, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("missing", ["start_api_server", "get_node", "start_monitor"])
def test_where_rays_internals_moved_ray_starts_as_ray_wrote_it(monkeypatch, missing):
    from ray._private import node, services

    patched = {"start_api_server": node.Node, "get_node": services, "start_monitor": node.Node}
    monkeypatch.delattr(patched[missing], missing)
    before = {name: getattr(owner, name) for name, owner in patched.items() if name != missing}
    with cluster.lean_start():
        assert all(getattr(patched[name], name) is fn for name, fn in before.items())


def test_raysims_own_ray_retries_local_sockets_every_20_ms(ray_session):
    """Ray's default retries a socket not yet listening once a second: the raylet's object manager
    lost that race with its own plasma store in 3 of 8 starts and waited a second."""
    import ray._private.worker as worker

    config = worker._global_node._config
    assert config["raylet_client_connect_timeout_milliseconds"] == 20
    assert config["raylet_client_num_connect_attempts"] == 500  # Ray's own 10 s in all
    assert cluster.CONNECT_POLL.items() <= config.items()
