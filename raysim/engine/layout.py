"""Where clients live: how many client hosts a federation starts and which host holds which client."""
from __future__ import annotations

import math

from raysim.core.errors import UserError


def host_layout(runtime, num_clients: int) -> tuple[int, int]:
    """(num_hosts, clients_per_host) for a federation of ``num_clients``; client k lives on host k % H."""
    if runtime.clients_per_host is not None:
        hosts = math.ceil(num_clients / runtime.clients_per_host)
        if runtime.num_hosts is not None and runtime.num_hosts < hosts:
            raise UserError(
                f"runtime.num_hosts = {runtime.num_hosts} hosts cannot hold {num_clients} clients at "
                f"runtime.clients_per_host = {runtime.clients_per_host}; need {hosts} hosts")
        hosts = min(hosts, runtime.num_hosts or hosts)
    else:
        hosts = min(runtime.num_hosts, num_clients)
    return hosts, math.ceil(num_clients / hosts)
