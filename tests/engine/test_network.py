"""A local run is reachable from this machine only, and only with Ray's token.

The session's Ray instance is started the way `raysim run` starts its own
(raysim.engine.cluster.start_local_ray, called by tests/conftest.py). While a small federation
runs on it, every listening TCP socket of every process of this process tree (the GCS, the
raylet, the runtime-env agent, the driver, the Server and ClientHost actors, idle workers) is
read from /proc and must be on a loopback address; a gRPC call to the GCS without the token (or
with a wrong one) must be refused.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.app.experiment import federation

RUN = {
    "method": "fedavg", "rounds": 1, "seed": 2,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 16}},
    "model": {"name": "small_cnn"},
    "train": {"batch_size": 16, "lr": 0.05},
    "runtime": {"num_hosts": 1, "cpus_per_host": 1},
}


class Listener(NamedTuple):
    ip: str
    port: int
    pid: int
    name: str


def _tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _address(hex_addr: str, v6: bool) -> tuple[str, int]:
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)  # /proc/net/tcp{,6}: each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw), int(port, 16)


def listening(pids: list[int]) -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) held by these processes."""
    owner: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[int(target[8:-1])] = pid
    out = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(f"/proc/net/{table}") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[9]) in owner:  # 0A: LISTEN
                pid = owner[int(f[9])]
                try:
                    with open(f"/proc/{pid}/comm") as fh:
                        name = fh.read().strip()
                except OSError:
                    name = "?"
                out.append(Listener(*_address(f[1], v6), pid, name))
    return out


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # a dual-stack socket bound to ::ffff:127.0.0.1
    return addr.is_loopback


def test_the_probe_tells_loopback_from_every_interface():
    """The listing itself: a socket on 0.0.0.0 is reported, one on 127.0.0.1 is loopback."""
    with socket.socket() as wide, socket.socket() as narrow:
        wide.bind(("0.0.0.0", 0))
        narrow.bind(("127.0.0.1", 0))
        wide.listen()
        narrow.listen()
        mine = {(s.ip, s.port) for s in listening([os.getpid()])}
        assert ("0.0.0.0", wide.getsockname()[1]) in mine and ("127.0.0.1", narrow.getsockname()[1]) in mine
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")


@pytest.mark.slow
def test_a_local_run_listens_only_on_loopback(ray_session, tmp_path):
    seen: list[list[Listener]] = []

    def look(rnd, summary, evaluation):
        seen.append(listening(_tree(os.getpid())))

    federation(load_config(raw=RUN), str(tmp_path / "run"), progress=False, on_round=look).run()
    (sockets,) = seen
    names = {s.name for s in sockets}
    # the run's own processes are in the listing: Ray's daemons, this driver and both actor kinds
    assert {"gcs_server", "raylet", "ray::Server", "ray::ClientHost"} <= names, names
    assert os.getpid() in {s.pid for s in sockets}
    wide = sorted({f"{s.name} (pid {s.pid}) on {s.ip}:{s.port}" for s in sockets if not is_loopback(s.ip)})
    assert not wide, "listening beyond loopback: " + "; ".join(wide)


def test_token_authentication_is_on_and_enforced(ray_session):
    import grpc
    import ray
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    assert os.environ.get("RAY_AUTH_MODE") == "token"
    assert get_authentication_mode() == AuthenticationMode.TOKEN
    gcs = ray.get_runtime_context().gcs_address
    assert is_loopback(gcs.rsplit(":", 1)[0])
    token = AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True)
    with grpc.insecure_channel(gcs) as channel:
        nodes = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetAllNodeInfo
        request = gcs_service_pb2.GetAllNodeInfoRequest()
        for metadata in (None, [("authorization", "Bearer " + "0" * len(token))]):
            with pytest.raises(grpc.RpcError) as err:
                nodes(request, timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(nodes(request, timeout=10, metadata=[("authorization", f"Bearer {token}")]).node_info_list) == 1


def test_joining_a_cluster_asks_for_token_authentication(monkeypatch):
    """With --address raysim joins with RAY_AUTH_MODE=token unless the user set a mode; a missing
    or wrong token is one line that says where the token goes."""
    import ray

    from raysim.engine import cluster

    modes = []

    def fake_init(**kwargs):
        modes.append(os.environ.get("RAY_AUTH_MODE"))
        raise ray.exceptions.AuthenticationError("Token authentication is enabled but no authentication "
                                                 "token was found. More text")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(cluster, "_token_auth", lambda: os.environ.__setitem__("RAY_AUTH_MODE", "token"))
    monkeypatch.setattr(cluster, "probe_cluster", lambda address: None)  # as if a cluster answered there
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(UserError, match=r"cannot connect to the Ray cluster at 10\.0\.0\.1:6379: Token "
                                        r"authentication is enabled but no authentication token was found; "
                                        r".*RAY_AUTH_TOKEN_PATH.*RAY_AUTH_MODE=disabled") as err:
        with cluster.ray_session("10.0.0.1:6379"):
            pass
    assert "\n" not in str(err.value)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's explicit choice for their cluster stays
    with pytest.raises(UserError):
        with cluster.ray_session("10.0.0.1:6379"):
            pass
    assert modes == ["token", "disabled"]


@pytest.mark.parametrize("user_token", [None, "f" * 64])
def test_a_local_ray_is_started_with_token_auth_set_by_raysim(monkeypatch, user_token):
    """Ray 2.60 would turn token mode on by itself for a new local instance; raysim must not rely
    on that: RAY_AUTH_MODE=token and a token are in force *before* ray.init runs, the user's own
    token is kept, and the node address is held at loopback while ray.init runs. (ray.init is
    faked: this checks what raysim hands Ray; the session's real instance is checked above.)"""
    import ray
    from ray._private import ray_constants
    from ray._private.authentication import authentication_token_setup

    from raysim.engine import cluster

    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs, mode=os.environ.get("RAY_AUTH_MODE"), token=os.environ.get("RAY_AUTH_TOKEN"),
                    cluster_mode=ray_constants.ENABLE_RAY_CLUSTER)

    # the real _token_auth runs, but Ray's config of this process (the session's Ray) is left alone
    monkeypatch.setattr(authentication_token_setup, "Config", SimpleNamespace(initialize=lambda *_: None))
    monkeypatch.setattr(ray, "init", fake_init)
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    if user_token:
        monkeypatch.setenv("RAY_AUTH_TOKEN", user_token)
    before = ray_constants.ENABLE_RAY_CLUSTER
    cluster.start_local_ray(num_cpus=1)
    assert seen["mode"] == "token"
    assert seen["token"] == user_token if user_token else len(seen["token"]) == 64 and seen["token"] != "f" * 64
    assert seen["_node_ip_address"] == "127.0.0.1" and seen["dashboard_host"] == "127.0.0.1"
    assert seen["include_dashboard"] is False and seen["cluster_mode"] is False
    assert ray_constants.ENABLE_RAY_CLUSTER == before  # restored after ray.init
