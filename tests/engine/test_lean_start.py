"""raysim's own Ray starts without Ray's API server, without Ray's once-a-second wait for the node
(raysim.engine.cluster.lean_start) and with local sockets retried every 20 ms (CONNECT_POLL): the
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
    assert ray_session.get(ray_session.remote(lambda: 7).remote()) == 7  # the node works without it


def test_lean_start_changes_rays_start_only_inside(monkeypatch):
    from ray._private import node, services

    monkeypatch.delenv(cluster.API_SERVER_ENV, raising=False)
    api, get_node = node.Node.start_api_server, services.get_node
    with cluster.lean_start():
        assert node.Node.start_api_server is not api
        assert node.Node.start_api_server(object(), include_dashboard=False, raise_on_failure=False) is None
        assert services.get_node is not get_node
    assert node.Node.start_api_server is api and services.get_node is get_node


def test_the_api_server_is_kept_where_the_user_asks(monkeypatch):
    from ray._private import node

    monkeypatch.setenv(cluster.API_SERVER_ENV, "1")
    api = node.Node.start_api_server
    with cluster.lean_start():
        assert node.Node.start_api_server is api


def test_a_registered_node_is_found_at_once_and_a_missing_one_waits_its_timeout(ray_session):
    import ray._private.worker as worker

    node = worker._global_node
    t0 = time.monotonic()
    cluster._await_registration(node.gcs_address, node.node_id)
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    cluster._await_registration(node.gcs_address, "ab" * 28, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("missing", ["start_api_server", "get_node"])
def test_where_rays_internals_moved_ray_starts_as_ray_wrote_it(monkeypatch, missing):
    from ray._private import node, services

    owner = node.Node if missing == "start_api_server" else services
    monkeypatch.delattr(owner, missing)
    other = (services, "get_node") if missing == "start_api_server" else (node.Node, "start_api_server")
    before = getattr(*other)
    with cluster.lean_start():
        assert getattr(*other) is before


def test_raysims_own_ray_retries_local_sockets_every_20_ms(ray_session):
    """Ray's default retries a socket not yet listening once a second: the raylet's object manager
    lost that race with its own plasma store in 3 of 8 starts and waited a second."""
    import ray._private.worker as worker

    config = worker._global_node._config
    assert config["raylet_client_connect_timeout_milliseconds"] == 20
    assert config["raylet_client_num_connect_attempts"] == 500  # Ray's own 10 s in all
    assert cluster.CONNECT_POLL.items() <= config.items()
