"""Where a federation's server and hosts live: Ray actors (the default), or plain objects in the
driver's process (``InProcess``: the same round loop without Ray, for tests and debugging).

The round loop (:mod:`raysim.engine.loop`) talks to both the same way: ``handle.method.remote(...)``
returns a reference, and ``backend.get(refs)`` waits for it.

Both turn torch's "no deterministic kernel" error of a host (``runtime.deterministic``) into a
one-line user error naming the operation and the model (:mod:`raysim.engine.determinism`).
"""
from __future__ import annotations

from raysim.core.errors import TryLater, UserError, first_line
from raysim.engine import cluster


class RayActors:
    """A Server actor and a pool of ClientHost actors in one placement group: the pool calls are
    :mod:`raysim.engine.cluster`'s; this class adds the determinism error to ``get``."""

    model = "?"  # the federation's model (cfg.model.name), for the determinism error; set by launch_pool

    await_pool = staticmethod(cluster.await_pool)
    stop_pool = staticmethod(cluster.stop_pool)
    alive = staticmethod(cluster.alive)

    def server(self, cfg, avoid_node: str | None = None):
        """A Server actor; ``avoid_node``: the node of the one it replaces (see cluster.server_placement)."""
        from raysim.engine.server import Server
        where = cluster.server_placement(avoid_node, cfg.runtime.server_cpus)
        options = cluster.with_plugins(dict(num_cpus=cfg.runtime.server_cpus, scheduling_strategy=where))
        return cluster.health_checked(Server).options(**options).remote(cfg)

    def launch_pool(self, cfg, num_hosts: int):
        self.model = cfg.model.name
        return cluster.launch_pool(cfg, num_hosts)

    def kill(self, actor) -> None:
        import ray
        ray.kill(actor)

    def fits(self, cfg, num_hosts: int) -> bool:
        """Whether the cluster holds ``num_hosts`` hosts and the server at all (free or not)."""
        try:
            cluster.check_resources(cfg, num_hosts)
            return True
        except (UserError, TryLater):
            return False

    def get(self, refs):
        import ray

        from raysim.engine.determinism import nondeterministic_error
        try:
            return cluster.ray_get(refs)
        except ray.exceptions.RayTaskError as err:
            user = nondeterministic_error(getattr(err, "cause", None), self.model)
            if user is None:
                raise
            raise user from None

    def wait(self, refs: list, timeout: float | None = None) -> tuple[list, list]:
        """(the refs done, the others) as soon as at least one is done, or after ``timeout`` seconds."""
        import ray
        return ray.wait(refs, num_returns=1, timeout=timeout)

    def pending(self, refs, timeout: float) -> list:
        """The refs of ``refs`` (one, or a list) not done after waiting up to ``timeout`` seconds."""
        import ray
        flat = refs if isinstance(refs, list) else [refs]
        if not flat:
            return []
        return ray.wait(flat, num_returns=len(flat), timeout=timeout)[1]

    def lost(self) -> tuple:
        """The exceptions that mean an actor (or an object it held) is gone, or that the code it
        ran raised (:meth:`is_code_error` tells them apart)."""
        import ray
        gone = ("RayActorError", "RayTaskError", "ObjectLostError", "OutOfMemoryError", "WorkerCrashedError",
                "NodeDiedError")  # the last three: a process or node killed (Ray's memory monitor, a crash)
        return tuple(getattr(ray.exceptions, name) for name in gone if hasattr(ray.exceptions, name))

    def is_code_error(self, err: BaseException) -> bool:
        """Whether ``err`` is an exception raised by the code an actor ran (a method's bug), not
        a lost process, node or object (those are Ray's own errors, also as a task's cause)."""
        import ray
        cause = getattr(err, "cause", None)
        return (isinstance(err, ray.exceptions.RayTaskError)
                and not isinstance(cause, (ray.exceptions.RayError, KeyboardInterrupt, SystemExit)))

    def out_of_memory(self, err: BaseException) -> bool:
        """Whether Ray's memory monitor killed the actor (its OutOfMemoryError, also as a cause)."""
        import ray
        return isinstance(err, ray.exceptions.OutOfMemoryError) or isinstance(
            getattr(err, "cause", None), ray.exceptions.OutOfMemoryError)

    def traceback(self, err: BaseException) -> str:
        """The traceback of a code error as text: the remote one Ray carried (the method's file
        and line), without Ray's colour codes."""
        import ray
        if isinstance(err, ray.exceptions.RayTaskError):
            return cluster.remote_traceback(err)
        return InProcess.traceback(self, err)

    def error_line(self, err: BaseException) -> str:
        """``Type: first line`` of a code error (of its cause, for one raised in an actor)."""
        cause = getattr(err, "cause", None) or err
        return first_line(cause, with_type=True, limit=300)


class _Done:
    """The result of a call that already ran (InProcess's stand-in for an ObjectRef)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _value(x):
    """A call's argument as the callee sees it: a reference's value (also inside a list, where
    a Ray callee would fetch it itself)."""
    if isinstance(x, list) and any(isinstance(e, _Done) for e in x):
        return [_value(e) for e in x]
    return x.value if isinstance(x, _Done) else x


class _Method:
    def __init__(self, fn, model: str):
        self._fn, self._model = fn, model

    def remote(self, *args, **kwargs):
        from raysim.engine.determinism import nondeterministic_error
        try:
            return _Done(self._fn(*[_value(a) for a in args], **{k: _value(v) for k, v in kwargs.items()}))
        except RuntimeError as err:
            user = nondeterministic_error(err, self._model)
            if user is None:
                raise
            raise user from None


class _Handle:
    """An object called like an actor: ``handle.method.remote(...)`` runs it now."""

    def __init__(self, obj, model: str = "?"):
        self.obj, self._model = obj, model

    def __getattr__(self, name):
        return _Method(getattr(self.obj, name), self._model)


class InProcess(RayActors):
    """Server and hosts as objects in this process. Payloads still go through ``ray.put`` when a
    Ray instance is up (hosts read them from the object store as on a cluster)."""

    def server(self, cfg, avoid_node: str | None = None):
        from raysim.engine.server import Server
        return _Handle(Server(cfg), cfg.model.name)

    def launch_pool(self, cfg, num_hosts: int):
        from raysim.engine.host import ClientHost
        hosts = [_Handle(ClientHost(h, cfg, num_hosts, gpu_ids=[]), cfg.model.name) for h in range(num_hosts)]
        return hosts, [h.start.remote() for h in hosts], None

    def await_pool(self, hosts, starts, num_clients: int, run_dir=None):
        ready = self.get(starts)
        if sum(r["clients"] for r in ready) != num_clients:
            raise RuntimeError(f"the hosts hold {sum(r['clients'] for r in ready)} clients but the server counts "
                               f"{num_clients}")
        return ready

    def stop_pool(self, hosts, pg, unawaited=()) -> None:
        pass

    def kill(self, actor) -> None:
        pass

    def fits(self, cfg, num_hosts: int) -> bool:
        return True

    def get(self, refs):
        return [_value(r) for r in refs] if isinstance(refs, list) else _value(refs)

    def wait(self, refs: list, timeout: float | None = None) -> tuple[list, list]:
        return list(refs), []

    def pending(self, refs, timeout: float) -> list:
        return []

    def alive(self, actor, timeout: float = 0.0, check=None) -> bool:
        return True

    def lost(self) -> tuple:
        return ()

    def traceback(self, err: BaseException) -> str:
        import traceback
        return "".join(traceback.format_exception(err))
