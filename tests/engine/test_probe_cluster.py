"""raysim.engine.cluster.probe_cluster: before ray.init joins an --address, one TCP connect and one
gRPC call tell a Ray cluster from the usual mistakes, each a one-line UserError within seconds
(Ray's own connect retries for ~14 minutes). The session's own Ray is the cluster that answers;
a plain TCP listener is the wrong service; a closed port is nothing at all."""
import socket
import threading
import time

import pytest

from raysim.core.errors import UserError
from raysim.engine.cluster import probe_cluster


@pytest.fixture
def not_ray():
    """host:port of a TCP listener that answers every connection with an HTTP/1 error and closes."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    server.close()


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def refused(address: str) -> str:
    t0 = time.perf_counter()
    with pytest.raises(UserError) as err:
        probe_cluster(address)
    assert time.perf_counter() - t0 < 10 and "\n" not in str(err.value)
    return str(err.value)


def test_the_sessions_gcs_answers_and_each_mistake_is_named(ray_session, not_ray):
    gcs = ray_session.get_runtime_context().gcs_address  # 127.0.0.1:<port>, token authentication on
    probe_cluster(gcs)
    assert refused(f"ray://{gcs}") == (f"ray://{gcs} is a Ray cluster's GCS port, not its Ray Client server port: "
                                       f"give --address {gcs}")
    port = closed_port()
    assert refused(f"127.0.0.1:{port}").startswith(
        f"cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused; check that the cluster's head "
        f"node is running (`ray status` there), that {port} is its GCS port")
    assert refused(not_ray).startswith(f"no Ray GCS answers at {not_ray}, another service does (UNAVAILABLE")
    assert refused(f"ray://{not_ray}").startswith(f"no Ray Client server answers at ray://{not_ray}, another")
    assert refused("nohost").startswith("--address nohost: Invalid address format: nohost; expected host:port")
