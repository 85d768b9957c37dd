"""Joining Ray and placing the host pool on it.

Locally raysim starts its own Ray instance that only this machine can reach: every Ray process
(GCS, raylet, the agents, the driver, every actor) listens on 127.0.0.1, the dashboard and Ray's
API server are off, and Ray's token authentication is on (:func:`start_local_ray`). With
``--address``/``RAY_ADDRESS`` it joins an existing cluster with token authentication on too,
unless ``RAY_AUTH_MODE`` says otherwise, and never assumes a single node. The pool is reserved
as one placement group, so a federation either gets all its hosts or fails fast with the
resources it is missing (a group that cannot be placed would otherwise wait forever).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import time

from raysim.core.errors import Interrupted, TrainingDiverged, TryLater, UserError, first_line
from raysim.core.files import write_json

SLOT_SETTLE_TRIES, SLOT_SETTLE_S = 4, 0.25  # parallel_slots: up to 1 s for freed actors to show


LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def ray_session(address: str | None, runtime=None, methods=(), datasets=()):
    """Ray for the duration: joined at ``address`` (or RAY_ADDRESS), else started locally; left
    as it is if this process is already connected.

    ``methods``, ``datasets``: the run's method and dataset names. A plugin's module (a method's
    ``module:Class``, a dataset's ``module:Loader``) reaches every worker, on every node, through
    the job's ``runtime_env`` ``py_modules`` (:func:`job_runtime_env`): every actor and task of
    the job, Tune's trials and the federations' actors inside them, imports it from there.
    raysim's own methods and datasets add nothing (the same ``ray.init`` as ever). A process
    connected already (a caller's own ``ray.init``, a test session) keeps its job's runtime_env:
    the plugins then travel with the actors and tasks raysim starts (:func:`shipped`); Tune's
    trials themselves do not get them, so a method plugin, which a trial imports, needs
    :func:`job_runtime_env` in that ``ray.init``."""
    import ray

    if ray.is_initialized():
        with shipped(actor_runtime_env(plugin_sources(methods, datasets))):
            yield
        return
    runtime_env = job_runtime_env(methods, datasets)
    address = address or os.environ.get("RAY_ADDRESS")
    no_second_ray_instance()
    with own_signal_handlers():
        if address:
            join_cluster(address, runtime_env=runtime_env)
        else:
            start_local_ray(os.cpu_count(), niceness=runtime.worker_niceness if runtime is not None else 0,
                            runtime_env=runtime_env)
            private_session_folder()
    try:
        yield
    except (KeyboardInterrupt, Interrupted, TryLater):
        shutdown(bounded=True)
        raise
    except BaseException:
        shutdown()
        raise
    shutdown()


SHUTDOWN_BROKEN_S = 1.0  # how long ray.shutdown may take on a node whose raylet or GCS is gone or going


def shutdown(bounded: bool = False) -> None:
    """``ray.shutdown``; ``bounded`` (the driver ends on a signal), or where this driver's Ray node
    lost its raylet or GCS, it may take ``SHUTDOWN_BROKEN_S``: a SIGTERM to the process group, as
    ``scancel`` or a pod's end sends, sets the GCS and raylet draining (or ends them), and Ray then
    waits seconds on them. What is left of the node is ended by :func:`no_leftover_ray_processes`."""
    import threading

    import ray

    if not bounded and local_ray_failure() is None:
        ray.shutdown()
        return
    quitting = threading.Thread(target=ray.shutdown, name="raysim-ray-shutdown", daemon=True)
    quitting.start()
    quitting.join(SHUTDOWN_BROKEN_S)


def no_second_ray_instance() -> None:
    """Turn off Ray's auto-init in this driver: after ``ray.shutdown`` (a comparison ending on an
    error or Ctrl-C), a federation thread's last ``ray.get`` or ``ray.put`` would otherwise start a
    fresh local Ray instance and wait a minute for a GCS that is gone. One Ray instance per driver."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


@contextlib.contextmanager
def own_signal_handlers():
    """Keep this process's SIGTERM and SIGINT handlers across ``ray.init``, which replaces SIGTERM's
    with ``sys.exit(15)`` (Ray 2.60, ``ray/_private/worker.py``): a real SIGTERM would then abort
    the driver with a C++ stack dump (exit 134) instead of raysim's resume line and exit 143."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def private_session_folder() -> None:
    """Ray's session folder (its logs, sockets and the job's files) readable by this user only:
    Ray creates it with the umask's permissions, usually world-readable."""
    import ray

    try:
        folder = ray._private.worker._global_node.get_session_dir_path()
        os.chmod(folder, 0o700)
    except (AttributeError, OSError):  # Ray's internals moved, or not ours to change: left as Ray made it
        pass


def plugin_sources(methods=(), datasets=()) -> list[str]:
    """The module files and package folders the run's plugins need on every worker: the method
    plugins' (:func:`raysim.methods.registry.plugin_sources`), then the dataset plugins'
    (:func:`raysim.data.plugin_sources`)."""
    from raysim import data
    from raysim.methods import registry

    out = registry.plugin_sources(methods)
    return out + [path for path in data.plugin_sources(datasets) if path not in out]


def job_runtime_env(methods=(), datasets=()) -> dict | None:
    """The job's ``runtime_env`` for these methods and datasets: ``{"py_modules": [...]}`` shipping
    each plugin's module file or package folder from the driver (Ray uploads them once, by content
    hash, and puts them on every worker's ``sys.path``); None when no plugin is named."""
    sources = plugin_sources(methods, datasets)
    return {"py_modules": sources} if sources else None


# Where this process was connected to Ray before raysim's session, the job's runtime_env is fixed:
# the plugins' modules are uploaded as Ray uploads a job's (gcs:// URIs, by content hash) and given
# to each actor and task raysim starts (with_plugins). Ray deletes an upload no running actor uses
# once its pin expires: pinned for a day, longer than any search that reuses it.
_shipped: dict | None = None  # {"py_modules": [URI, ...]} inside shipped(), else None
SHIP_PIN_S = 24 * 3600


def actor_runtime_env(sources) -> dict | None:
    """``sources`` (module files, package folders) uploaded to the connected cluster, as the
    ``runtime_env`` of an actor: their URIs after the job's own py_modules (an actor's py_modules
    replace the job's, not add to them). None without sources, and through Ray Client
    (``ray://``), whose job runtime_env is the only way there."""
    if not sources:
        return None
    import tempfile

    import ray
    from ray._private.runtime_env.packaging import pin_runtime_env_uri
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray.util.client import ray as client

    if client.is_connected():
        return None
    keep_ignored = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") == "1"  # as ray.init reads it
    with tempfile.TemporaryDirectory(prefix="raysim-ship-") as scratch:
        uris = upload_py_modules_if_needed({"py_modules": list(sources)}, include_gitignore=not keep_ignored,
                                           scratch_dir=scratch)["py_modules"]
    for uri in uris:
        pin_runtime_env_uri(uri, expiration_s=SHIP_PIN_S)
    job = list((ray.get_runtime_context().runtime_env or {}).get("py_modules") or [])
    return {"py_modules": list(dict.fromkeys(job + uris))}


@contextlib.contextmanager
def shipped(runtime_env: dict | None):
    """Inside, the actors and tasks raysim starts from this process get ``runtime_env``
    (:func:`actor_runtime_env`; None: nothing added) in their options (:func:`with_plugins`)."""
    global _shipped
    before, _shipped = _shipped, runtime_env
    try:
        yield
    finally:
        _shipped = before


def shipped_plugins() -> dict | None:
    """What :func:`shipped` gives the actors now (a Tune trial's federation gets it too)."""
    return _shipped


def with_plugins(options: dict) -> dict:
    """Ray actor or task ``options`` with the shipped plugins' modules in their runtime_env
    (its other keys, e.g. the deterministic env_vars, kept); ``options`` as they are outside
    :func:`shipped`."""
    if not _shipped:
        return options
    return {**options, "runtime_env": {**(options.get("runtime_env") or {}), **_shipped}}


NODE_POLL_S = 0.02  # how often lean_start asks the GCS whether the new node has registered
# How often a Ray process retries connecting to a local socket not yet listening (the raylet's
# object manager to its own plasma store, started on another thread at the same moment; a worker
# to its raylet): every 20 ms for up to 10 s, where Ray's default retries once a second (10 times).
# The raylet's own start lost that race in 3 of 8 runs here and waited a whole second.
CONNECT_POLL = {"raylet_client_connect_timeout_milliseconds": 20, "raylet_client_num_connect_attempts": 500}
API_SERVER_ENV = "RAYSIM_RAY_API_SERVER"  # =1: raysim's own Ray starts Ray's API server after all
MONITOR_ENV = "RAYSIM_RAY_MONITOR"  # =1: raysim's own Ray starts Ray's autoscaler monitor after all


def start_local_ray(num_cpus: int, num_gpus: float | None = None, niceness: int = 0,
                    log_to_driver: bool = True, runtime_env: dict | None = None) -> None:
    """Start this process's own Ray instance, reachable from this machine only.

    * Loopback only. Ray 2.60 turns a node address of 127.0.0.1 into the machine's network
      address (``services.resolve_ip_for_localhost``) unless ``ray_constants.ENABLE_RAY_CLUSTER``
      is off, and its gRPC servers (GCS, raylet, every worker) bind all interfaces for any node
      address that is not loopback; so the node address is kept at 127.0.0.1 while ray.init runs,
      and every process, the runtime-env agent included, then listens on 127.0.0.1 alone.
    * Token authentication (``RAY_AUTH_MODE=token``), set here rather than left to Ray's default;
      without a token of the user's (``RAY_AUTH_TOKEN``/``RAY_AUTH_TOKEN_PATH``) the instance gets
      a random one in this process's environment, which Ray's processes inherit (nothing is
      written to ~/.ray).
    * No dashboard; its host stays loopback should it ever start.
    * Without two of Ray's waits (:func:`lean_start`): ``ray.init`` ~1 s sooner; and local
      sockets retried every 20 ms instead of every second (:data:`CONNECT_POLL`).
    """
    import ray
    from ray._private import ray_constants

    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        import secrets

        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _token_auth()
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # keep 127.0.0.1 as the node address (see above)
    try:
        with lean_start():
            ray.init(num_cpus=num_cpus, num_gpus=num_gpus, _node_ip_address=LOOPBACK, include_dashboard=False,
                     dashboard_host=LOOPBACK, _system_config={"worker_niceness": int(niceness), **CONNECT_POLL},
                     logging_level=logging.ERROR, log_to_driver=log_to_driver, configure_logging=True,
                     **({"runtime_env": runtime_env} if runtime_env else {}))
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode


@contextlib.contextmanager
def lean_start():
    """Inside, a local ``ray.init`` skips two waits and a process that raysim's own instance does
    not need (Ray 2.60; measured on the 2-core VM, ``ray.init`` 2.4-2.5 s -> 1.4-1.5 s):

    * Ray's API server, the dashboard's head process that Ray starts even with
      ``include_dashboard=False`` (for ``ray job`` and the state API, ``ray list``), is not
      started: ``ray.init`` waits 0.4-0.8 s for it to answer. raysim's instance is private to its
      driver (loopback, a token, a session folder only this user reads) and uses neither;
      ``RAYSIM_RAY_API_SERVER=1`` starts it as Ray would.
    * Ray's autoscaler monitor (``ray status``'s source; it scales nothing on one machine without
      an autoscaling config) is not started: a Python process whose start took ~0.5 s of CPU from
      the hosts' and server's own starts on two cores, then ~1 ms a round.
      ``RAYSIM_RAY_MONITOR=1`` starts it as Ray would.
    * The new node's registration is awaited by asking the GCS every ``NODE_POLL_S``: Ray's own
      wait (``services.get_node``) polls once a second, and the raylet registers ~0.4 s in.

    Where Ray's internals moved, ``ray.init`` runs as Ray wrote it."""
    from ray._private import node, services

    saved_api, saved_get_node = getattr(node.Node, "start_api_server", None), getattr(services, "get_node", None)
    saved_monitor = getattr(node.Node, "start_monitor", None)
    if saved_api is None or saved_get_node is None or saved_monitor is None:
        yield
        return

    def registered_node(gcs_address, node_id):
        _await_registration(gcs_address, node_id)
        return saved_get_node(gcs_address, node_id)

    services.get_node = registered_node
    if os.environ.get(API_SERVER_ENV) != "1":
        node.Node.start_api_server = lambda self, **_: None
    if os.environ.get(MONITOR_ENV) != "1":
        node.Node.start_monitor = lambda self: None
    try:
        yield
    finally:
        node.Node.start_api_server, services.get_node = saved_api, saved_get_node
        node.Node.start_monitor = saved_monitor


def _await_registration(gcs_address: str, node_id: str, timeout_s: float = 10.0) -> None:
    """Until the GCS lists the node ``node_id`` (hex), or ``timeout_s``: then Ray's own wait
    decides (it waits 30 s more, and raises where the node never came)."""
    import ray

    try:
        client = ray._raylet.GcsClient(address=gcs_address)
    except Exception:  # noqa: BLE001 - Ray's own wait follows, and reports what is wrong
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if any(nid.hex() == node_id for nid in client.get_all_node_info(timeout=5)):
                return
        except Exception:  # noqa: BLE001 - the GCS not answering yet: ask again
            pass
        time.sleep(NODE_POLL_S)


def join_cluster(address: str, runtime_env: dict | None = None) -> None:
    """Connect to the Ray cluster at ``address`` with token authentication on, unless
    ``RAY_AUTH_MODE`` is set (then it is the cluster's own setting, e.g. ``disabled``);
    ``runtime_env``: the job's (:func:`job_runtime_env`). An address where no Ray cluster answers
    is one line within seconds (:func:`probe_cluster`), before Ray's own connect, which retries
    for many minutes."""
    import ray

    if "RAY_AUTH_MODE" not in os.environ:
        _token_auth()
    probe_cluster(address)
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=True,
                 configure_logging=True, **({"runtime_env": runtime_env} if runtime_env else {}))
    except ray.exceptions.AuthenticationError as err:
        raise UserError(_token_message(address, str(err).split(". ")[0])) from None
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise UserError(f"cannot connect to the Ray cluster at {address}: {first_line(err)}") from None


PROBE_TIMEOUT_S = 3.0  # probe_cluster: the TCP connect, then the one gRPC call, each at most this long
GCS_PORT, CLIENT_PORT = 6379, 10001  # Ray's defaults: `ray start --head --port`, --ray-client-server-port


def probe_cluster(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Check that a Ray cluster answers at ``address`` (``host:port``, ``ray://host:port`` or
    ``auto``) as ``ray.init`` will dial it, or raise a one-line UserError naming the address and
    what to check, within about ``2 * timeout_s``.

    Ray 2.60's own connect waits far longer: each of its 20 tries (``RAY_NUM_REDIS_GET_RETRIES``)
    waits ``gcs_rpc_server_connect_timeout_s`` (5 s) for the channel, as long again for its pubsub,
    then ``py_gcs_connect_timeout_s`` (30 s) for the cluster id: about 14 minutes. Those two are
    process-wide settings (RayConfig, read when Ray is imported); lowering them would also cut
    short every later wait of the driver on a busy cluster. So they are left alone, and a TCP
    connect and one gRPC call answer first: the GCS's ``GetClusterId`` (a Ray Client server's
    ``ClusterInfo`` ping for ``ray://``), with the job's token where token authentication is on.
    Its status tells the mistakes apart: nothing listening, no answer (a firewall), another
    service on that port (the Ray Client port given without ``ray://``, or the GCS port with it),
    a missing or wrong token. Once the GCS has answered, Ray's connect succeeds at its first try."""
    from ray._private import services

    if "RAY_AUTH_MODE" not in os.environ:
        _token_auth()
    client = address.startswith("ray://")
    given = address
    if client:
        target = address[len("ray://"):].rstrip("/")
        target = target if ":" in target.rsplit("]", 1)[-1] else f"{target}:{CLIENT_PORT}"
    else:
        try:  # "auto" (or a RAY_ADDRESS) found as Ray finds it; localhost as the address Ray dials
            target = services.canonicalize_bootstrap_address(address)
        except (ConnectionError, ValueError) as err:
            raise UserError(f"--address {address}: {first_line(err)}; {_ADDRESS_FORMS}") from None
        if target is None:
            raise UserError(f"--address {address}: no running Ray cluster found on this machine; {_ADDRESS_FORMS}")
        if target != address:
            given = f"{address} (which Ray dials as {target})"
    host, _, port_text = target.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UserError(f"--address {address}: expected host:port; {_ADDRESS_FORMS}")
    port = int(port_text)
    role = (f"Ray Client server port (ray start --ray-client-server-port, {CLIENT_PORT} by default), not its GCS "
            "port (then give host:port, without ray://)" if client else
            f"GCS port (ray start --head --port, {GCS_PORT} by default), not its Ray Client server port (then "
            "give ray://host:port)")
    unreachable = (f"check that the cluster's head node is running (`ray status` there), that {port} is its {role}, "
                   "and that no firewall between here and there drops the connection")
    import socket
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except socket.timeout:
        raise UserError(f"cannot reach the Ray cluster at {given}: no answer within {timeout_s:g} s; {unreachable}") from None
    except OSError as err:
        raise UserError(f"cannot reach the Ray cluster at {given}: {err.strerror or first_line(err)}; "
                        f"{unreachable}") from None
    _answers_as_ray(address, given, target, client, timeout_s)


_ADDRESS_FORMS = (f"expected host:port (the head node's GCS port, {GCS_PORT} by default), ray://host:port (its "
                  f"Ray Client server, {CLIENT_PORT} by default) or auto (a cluster started on this machine)")


def _answers_as_ray(address: str, given: str, target: str, client: bool, timeout_s: float) -> None:
    """One gRPC call to ``target``: the GCS's GetClusterId, or a Ray Client server's ClusterInfo
    ping for ``ray://``; a one-line UserError unless it answers as that service."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc

    def call(as_client: bool):
        stub = ray_client_pb2_grpc.RayletDriverStub(channel) if as_client else \
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING) if as_client else \
            gcs_service_pb2.GetClusterIdRequest()
        method = stub.ClusterInfo if as_client else stub.GetClusterId
        try:
            method(request, timeout=timeout_s, metadata=_auth_metadata())
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            return err.code(), err.details() or ""

    what = "Ray Client server" if client else "GCS"
    with grpc.insecure_channel(target) as channel:
        status, detail = call(client)
        if status == grpc.StatusCode.UNIMPLEMENTED:  # a gRPC server, but another of Ray's
            other, _ = call(not client)
            if other in (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED):
                plain = address[len("ray://"):] if client else address
                raise UserError(f"{given} is a Ray cluster's {'GCS' if client else 'Ray Client server'} port, not its "
                                f"{what} port: give --address {plain if client else 'ray://' + plain}")
    if status == grpc.StatusCode.OK:
        return
    if status == grpc.StatusCode.UNAUTHENTICATED:
        if os.environ.get("RAY_AUTH_MODE", "token") != "token":
            raise UserError(f"the Ray cluster at {address} wants token authentication but RAY_AUTH_MODE="
                            f"{os.environ['RAY_AUTH_MODE']}: unset it and give the cluster's token in "
                            "RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN or ~/.ray/auth_token")
        raise UserError(_token_message(address, "the cluster refused this job's token" if _auth_metadata()
                                       else "the cluster wants a token and none was given"))
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise UserError(f"the Ray cluster at {given} does not answer: its {what} port took the connection but gave "
                        f"no answer within {timeout_s:g} s; check that the head node is healthy (`ray status` there)")
    port = f"Ray Client server port as ray://host:port ({CLIENT_PORT}" if client else f"GCS port as host:port ({GCS_PORT}"
    detail = (detail.strip().splitlines() or ["no detail"])[0]
    raise UserError(f"no {'Ray Client server' if client else 'Ray GCS'} answers at {given}, another service does ({status.name}: {detail[-90:]}); "
                    f"give the head node's {port} by default)")


def _auth_metadata() -> tuple:
    """The job's token as gRPC metadata where token authentication is on and a token is given."""
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    if os.environ.get("RAY_AUTH_MODE", "token") != "token" or not loader.has_token():
        return ()
    return tuple(loader.get_token_for_http_header().items())


def _token_message(address: str, why: str) -> str:
    return (f"cannot connect to the Ray cluster at {address}: {why}; raysim joins with token authentication: "
            "give the cluster's token in RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN or ~/.ray/auth_token (or set "
            "RAY_AUTH_MODE=disabled for a cluster without authentication)")


def _token_auth() -> None:
    """RAY_AUTH_MODE=token for this process and every process it starts; Ray reads its mode
    once, so its cached config is refreshed the way Ray does it itself, and a token it may have
    cached is dropped so the one in force now is read."""
    from ray._private.authentication.authentication_token_setup import _enable_token_auth
    from ray._raylet import AuthenticationTokenLoader

    _enable_token_auth()
    AuthenticationTokenLoader.instance().reset_cache()


def check_resources(cfg, num_hosts: int) -> None:
    """That the Ray cluster holds ``num_hosts`` hosts and the server, free or not. Short of it, a
    UserError where raysim started Ray on this machine (it will not grow); TryLater (exit 75) on a
    joined cluster, which may (an autoscaler, a lost node coming back)."""
    import ray

    total = ray.cluster_resources()
    rt = cfg.runtime
    short = UserError if started_here() else TryLater
    later = "" if short is UserError else " now (it may grow: rerun the same command later)"
    need_gpu = rt.gpus_per_host * num_hosts
    if need_gpu > 0 and total.get("GPU", 0) == 0:
        raise short(f"runtime.gpus_per_host = {rt.gpus_per_host} but the Ray cluster has no GPUs{later}; "
                    "set runtime.gpus_per_host=0 or join a cluster with GPUs")
    need_cpu = rt.cpus_per_host * num_hosts + rt.server_cpus
    for name, need in (("CPU", need_cpu), ("GPU", need_gpu)):
        if need > total.get(name, 0) + 1e-9:
            raise short(f"the federation needs {need:g} {name} ({num_hosts} hosts x "
                        f"{rt.cpus_per_host if name == 'CPU' else rt.gpus_per_host:g}) but the Ray cluster "
                        f"has {total.get(name, 0):g}{later}; lower runtime.num_hosts or runtime.{name.lower()}s_per_host")


def started_here() -> bool:
    """Whether this process started the Ray node it is connected to (raysim's own local instance),
    rather than joining a cluster."""
    try:
        import ray
        node = ray._private.worker._global_node
        return node is not None and bool(node.all_processes)
    except Exception:  # noqa: BLE001 -- Ray's internals moved: take it as joined
        return False


def host_bundles(cfg, num_hosts: int) -> list[dict]:
    rt = cfg.runtime
    bundle = {"CPU": rt.cpus_per_host}
    if rt.gpus_per_host:
        bundle["GPU"] = rt.gpus_per_host
    return [dict(bundle) for _ in range(num_hosts)]


def launch_pool(cfg, num_hosts: int) -> tuple:
    """Reserve the pool and start every ClientHost; returns (hosts, their start() refs, placement group).

    Nothing waits for the hosts here, so their processes start (and load the data) while the
    server loads it. Inside a Tune trial the hosts go into the trial's own placement group
    (bundles 1..H); otherwise raysim reserves one for them.
    """
    import ray
    from ray.util.placement_group import get_current_placement_group, placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raysim.engine import wire
    from raysim.engine.determinism import actor_options
    from raysim.engine.host import ClientHost

    wire.install()  # the driver's tensors to the hosts (records moved home) as bytes too
    rt = cfg.runtime
    pg, own_pg, first_bundle = get_current_placement_group(), None, 1
    if pg is None:
        check_resources(cfg, num_hosts)
        pg = own_pg = placement_group(host_bundles(cfg, num_hosts), strategy="PACK")
        first_bundle = 0
        ready, _ = ray.wait([pg.ready()], timeout=rt.pg_timeout_s)
        if not ready:  # the cluster has the resources (check_resources) but not free now: try later
            ray.util.remove_placement_group(pg)
            raise TryLater(f"could not reserve {num_hosts} hosts x {host_bundles(cfg, 1)[0]} within "
                           f"{rt.pg_timeout_s:g}s; the cluster has {_free()} free (busy, or a node was lost "
                           "and not yet replaced); rerun the same command later (cluster/supervise.sh does)")
    actor = health_checked(ClientHost)
    hosts = []
    for h in range(num_hosts):
        opts = dict(num_cpus=rt.cpus_per_host, num_gpus=rt.gpus_per_host, **actor_options(rt),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + h))
        hosts.append(actor.options(**with_plugins(opts)).remote(h, cfg, num_hosts))
    return hosts, [h.start.remote() for h in hosts], own_pg


def _free() -> str:
    import ray
    free = ray.available_resources()
    return ", ".join(f"{free.get(k, 0):g} {k}" for k in ("CPU", "GPU") if k in free or k == "CPU")


HEALTH = "health"  # the actors' concurrency group for health checks
HEALTH_POLL_S = 0.5  # alive(): how often the caller's check runs while a health check is awaited


def health_checked(cls):
    """``ray.remote(cls)`` with a second thread that answers :func:`silent`'s health checks while
    the actor's one training thread is busy (its calls still run one at a time, in order): so a
    check tells a stopped or wedged process (no answer) from a busy one."""
    import ray
    return ray.remote(concurrency_groups={HEALTH: 1})(cls)


def silent(actors: dict, timeout: float) -> list:
    """The keys of ``actors`` ({name: handle}) that do not answer a health check within ``timeout``
    seconds (checked at once); a dead actor counts as silent."""
    import ray

    refs = {}
    for name, actor in actors.items():
        try:
            refs[name] = actor.ping.options(concurrency_group=HEALTH).remote()
        except Exception:  # noqa: BLE001 -- a handle Ray no longer knows: as good as silent
            refs[name] = None
    pending = [r for r in refs.values() if r is not None]
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout) if pending else ([], [])
    answered = set()
    for name, ref in refs.items():
        if ref is not None and ref in ready:
            try:
                ray.get(ref, timeout=0)
                answered.add(name)
            except Exception:  # noqa: BLE001 -- died meanwhile
                pass
    return [name for name in actors if name not in answered]


def local_ray_failure() -> str | None:
    """Why this driver's own Ray node can no longer run anything (its raylet or GCS process
    exited), or None. Only for a Ray instance this process started; a joined cluster's processes
    are not this driver's to watch."""
    try:
        import ray
        node = ray._private.worker._global_node
        dead = node.dead_processes() if node is not None else []
    except Exception:  # noqa: BLE001 -- Ray's internals moved: nothing to say
        return None
    for kind, process in dead:
        if kind in ("raylet", "gcs_server"):
            what = "GCS (its control store)" if kind == "gcs_server" else "raylet"
            return f"Ray's {what} on this machine exited (pid {process.pid}, status {process.returncode})"
    return None


def await_pool(hosts: list, starts: list, num_clients: int, run_dir: str | None = None) -> list[dict]:
    """Wait for the hosts' start(); check they hold the ``num_clients`` clients the server counts."""
    ready = ray_get(starts)
    held = sum(r["clients"] for r in ready)
    if held != num_clients:  # both sides build the federation from the same config: a bug if not
        raise RuntimeError(f"the hosts hold {held} clients but the server counts {num_clients}")
    if run_dir is not None:
        write_hosts(run_dir, ready, num_clients)
    return ready


def create_pool(cfg, num_hosts: int, num_clients: int, run_dir: str | None = None):
    """Start the ClientHost actors and wait for them; returns (hosts, owner(client_id) -> host
    index, placement group). With ``run_dir``, where each host landed (Ray node id and address,
    pid, device, threads, its clients) is written to ``run_dir/hosts.json``."""
    hosts, starts, pg = launch_pool(cfg, num_hosts)
    try:
        await_pool(hosts, starts, num_clients, run_dir)
    except BaseException:
        stop_pool(hosts, pg)
        raise
    return hosts, owner_of(num_hosts), pg


def stop_pool(hosts: list, pg, unawaited=()) -> None:
    """Kill the hosts and free their placement group; collect start() refs nobody waited for, so
    Ray reports no "unhandled error" for them on exit."""
    import ray

    for h in hosts:
        ray.kill(h)
    for ref in unawaited:
        try:
            ray.get(ref, timeout=10)
        except Exception:
            pass
    if pg is not None:
        ray.util.remove_placement_group(pg)


def owner_of(num_hosts: int):
    """Client k lives on host k mod H."""
    return lambda c: c % num_hosts


def write_hosts(run_dir: str, ready: list[dict], num_clients: int) -> None:
    """``hosts.json``: one entry per host, with the Ray node it was placed on and its client ids as
    ``client_range: [start, stop, step]`` (client k lives on host k mod H)."""
    import ray

    addresses = {n["NodeID"]: n.get("NodeManagerAddress") for n in ray.nodes()}
    hosts = []
    for info in ready:
        h = info.get("host")
        hosts.append({**info, "node_ip": addresses.get(info.get("node_id")),
                      "client_range": [h, num_clients, len(ready)]})
    nodes = sorted({i.get("node_id") for i in ready if i.get("node_id")})
    write_json(os.path.join(run_dir, "hosts.json"),
               {"num_hosts": len(ready), "num_nodes": len(nodes), "hosts": hosts}, indent=1)


def ray_get(refs):
    """ray.get that turns a user error raised inside an actor back into a plain UserError."""
    import ray
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, TrainingDiverged):
            raise cause from None
        if isinstance(cause, UserError):
            raise UserError(first_line(cause)) from None
        raise


def remote_traceback(err) -> str:
    """A RayTaskError's remote traceback as plain text: the actor's line (``ray::ClientHost.train_clients()
    (pid=..., ...)``) cut to the call and its pid, then the frames and the error as Python printed them."""
    lines = _ANSI.sub("", str(err)).splitlines()
    # a call whose argument was another call's failure carries that one's traceback: keep the innermost
    starts = [i for i, ln in enumerate(lines) if ln.startswith("ray::") or "RayTaskError: ray::" in ln]
    if starts:
        lines = lines[starts[-1]:]
        lines[0] = lines[0][lines[0].index("ray::"):]
    if lines and lines[0].startswith("ray::"):
        call = lines[0].split(" (", 1)
        pid = re.search(r"pid=(\d+)", lines[0])
        lines[0] = f"Traceback in {call[0]}" + (f" (pid {pid.group(1)})" if pid else "") + ":"
    body = [ln for ln in lines if ln.strip() and set(ln.strip()) - set("^~")]
    return "\n".join(body) + "\n"


def alive(actor, timeout: float = 30.0, check=None) -> bool:
    """Whether ``actor`` answers a health check (its health thread: a busy actor answers too)
    within ``timeout`` seconds; a dead one is known at once. ``check``: called every
    ``HEALTH_POLL_S`` while waiting (the watchdog's, which raises once the run is stopped)."""
    import ray

    try:
        ref = actor.ping.options(concurrency_group=HEALTH).remote()
    except Exception:  # noqa: BLE001 -- a handle Ray no longer knows
        return False
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        left = deadline - time.monotonic()
        ready, _ = ray.wait([ref], timeout=max(0.0, min(HEALTH_POLL_S, left)))
        if ready:
            try:
                ray.get(ref, timeout=0)
                return True
            except Exception:  # noqa: BLE001 -- died meanwhile
                return False
        if left <= HEALTH_POLL_S:
            return False


def server_placement(avoid_node: str | None = None, cpus: float = 0.0):
    """Inside a Tune trial the server takes bundle 0 of the trial's placement group (the hosts take
    1..H); otherwise Ray places it, away from ``avoid_node`` where another live node has room: a
    Server replaced after its node failed would otherwise often land on that dying node again
    (Ray still counts it alive for a while) and cost a second restart."""
    import ray
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
    pg = get_current_placement_group()
    if pg is not None:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    if avoid_node is None:
        return None
    others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != avoid_node
              and n.get("Resources", {}).get("CPU", 0) >= cpus]
    return NodeAffinitySchedulingStrategy(others[0], soft=True) if others else None


def parallel_slots(cfg, num_jobs: int) -> int:
    """How many federations run at once: ``runtime.parallel_federations``, or as many as the
    cluster's free CPUs and GPUs fit (one inside a Tune trial, whose placement group holds one)."""
    import ray
    from ray.util.placement_group import get_current_placement_group

    rt = cfg.runtime
    if rt.parallel_federations is not None:
        return max(1, min(rt.parallel_federations, num_jobs))
    if get_current_placement_group() is not None or rt.num_hosts is None:
        return 1

    def fits_now() -> int:
        free = ray.available_resources()
        fits = int((free.get("CPU", 0) + 1e-9) // max(rt.cpus_per_host * rt.num_hosts + rt.server_cpus, 1e-9))
        if rt.gpus_per_host:
            fits = min(fits, int((free.get("GPU", 0) + 1e-9) // (rt.gpus_per_host * rt.num_hosts)))
        return fits

    # Ray frees a killed actor's resources asynchronously, so right after a previous run the free
    # count can lag by a few hundred ms; look a few times before settling for fewer slots.
    fits = fits_now()
    for _ in range(SLOT_SETTLE_TRIES):
        if fits >= num_jobs:
            break
        time.sleep(SLOT_SETTLE_S)
        fits = max(fits, fits_now())
    return max(1, min(fits, num_jobs))


# ----------------------------------------------------------------------------- lost actors, leftovers

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain_reason(err: BaseException) -> str:
    """Why an actor is gone, in a few plain words: the innermost cause's reason and the process id
    (Ray's text carries colour codes, the calling actor's repr and a paragraph of advice)."""
    seen = set()
    while getattr(err, "cause", None) is not None and id(err) not in seen:
        seen.add(id(err))
        err = err.cause
    text = _ANSI.sub("", str(err))
    why = re.search(r"The actor is dead because ([^.\n]*)", text)
    if why:
        reason = why.group(1).strip()
    else:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("ray::")]
        reason = _cut(lines[0], 160) if lines else type(err).__name__
    pid = re.search(r"\bpid[:=] ?(\d+)", text)
    return f"{reason}, pid {pid.group(1)}" if pid else reason


def _cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word's end, with "…" where it was cut."""
    if len(text) <= limit:
        return text
    head = text[:limit - 1]
    return (head.rsplit(" ", 1)[0] if " " in head else head).rstrip(" ,;:") + "…"


def quiet_worker_death_notices() -> None:
    """Drop Ray's own "(raylet) A worker died or was killed ..." notice (a coloured paragraph on
    stdout): the round loop says in one line which actor was lost and that it replaces it. Other
    notices (out of memory, autoscaler) still print. A no-op if Ray's internals moved."""
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_raysim_quiet", False):
        return

    def print_to_stdstream(data, *args, **kwargs):
        if data.get("pid") == "raylet" and all(
                str(line).lstrip().startswith("A worker died or was killed") for line in data.get("lines", [])):
            return
        return original(data, *args, **kwargs)

    print_to_stdstream._raysim_quiet = True
    ray_worker.print_to_stdstream = print_to_stdstream


# A SIGTERM to the process group (scancel, a pod's end) reaches the GCS and raylet but not the
# workers (Ray gives each its own process group): the GCS and raylet then drain for seconds,
# waiting on workers nobody asked to end. Every file is written by then; nothing is lost by a
# SIGKILL after this grace.
LEFTOVER_GRACE_S = 1.0


@contextlib.contextmanager
def no_leftover_ray_processes():
    """On leaving, end what is left of the Ray node started inside (the Ray processes among this
    process's descendants that were not there on entering, nor below one that was). ``ray.shutdown``
    stops them on a normal exit; a Ctrl-C inside ``ray.init`` leaves the dashboard and runtime-env
    agents waiting ~60 s on a GCS that is gone. A driver that joined a cluster starts none."""
    before = {pid for pid, _ in _descendants(os.getpid())}
    try:
        yield
    finally:
        stop_descendants(lambda cmd: "ray" in cmd, skip=before, grace_s=LEFTOVER_GRACE_S)


def stop_descendants(match, skip=frozenset(), grace_s: float = 3.0) -> list[int]:
    """SIGTERM this process's descendants whose command line ``match``es (none in ``skip`` or below
    one), SIGKILL those still there after ``grace_s``; returns their pids (Linux /proc; elsewhere
    nothing)."""
    import signal

    pids = [pid for pid, cmd in _descendants(os.getpid(), skip) if match(cmd)]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _running(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return pids


def _descendants(root: int, skip=frozenset()) -> list[tuple[int, str]]:
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for e in entries:
        try:
            with open(f"/proc/{e}/stat", encoding="utf-8") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, stack = [], [root]
    while stack:
        for pid in children.get(stack.pop(), []):
            if pid in skip:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out.append((pid, cmd))
            stack.append(pid)
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
