"""The rendezvous: where the processes of a job meet, whether it can be reached, and over which interface.

gloo binds to the interface of the host name's address unless ``GLOO_SOCKET_IFNAME`` names one; on a machine
whose host name resolves to loopback (common in containers) a multi-machine job then hangs or fails to
connect. The right interface is the one the kernel routes the rendezvous address over, which a UDP socket's
``connect`` reveals without sending a packet.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from hftrain.errors import ConfigError
from hftrain.launch.hostfile import host_key

INTERFACE_VARIABLES = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


class RendezvousError(ConfigError):
    """The rendezvous settings are missing or invalid, or the address cannot be reached."""


@dataclass(frozen=True)
class Rendezvous:
    """A rendezvous endpoint.

    Args:
        addr: host name or IP address of the main process (``MASTER_ADDR``).
        port: its TCP port (``MASTER_PORT``).
    """

    addr: str
    port: int

    def __str__(self) -> str:
        return f"{self.addr}:{self.port}"


def parse_rendezvous(addr: str | None, port: str | int | None, *, source: str = "MASTER_ADDR/PORT") -> Rendezvous:
    """Validate an address and port given by a user or a launcher.

    Args:
        addr: a host name or IP address.
        port: a TCP port number.
        source: where they came from, for messages.
    """
    if not addr or port in (None, ""):
        raise RendezvousError(
            f"{source}: the rendezvous address and port are not set; pass --master_addr/--master_port to the "
            "launcher (or export MASTER_ADDR and MASTER_PORT)"
        )
    if host_key(addr) is None:
        raise RendezvousError(f"{source}: '{addr}' is not a plain host name or IP address")
    text = str(port)
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise RendezvousError(f"{source}: port '{text}' is not a TCP port (1-65535)")
    return Rendezvous(addr, int(text))


def resolve(addr: str) -> str:
    """The IP address of ``addr`` (itself when it is one); unresolvable names are an error."""
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as error:
        raise RendezvousError(f"rendezvous address '{addr}' does not resolve ({error}); check the host name") from None


def route_source(ip: str) -> str:
    """The local address the kernel would send from to reach ``ip`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((ip, 9))
        except OSError as error:
            raise RendezvousError(f"no route from this machine to the rendezvous address {ip} ({error})") from None
        return probe.getsockname()[0]


def interface_addresses() -> dict[str, list[str]]:
    """Network interfaces of this machine and their IP addresses."""
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address.split("%")[0] for a in addrs if a.family in families]
        for name, addrs in psutil.net_if_addrs().items()
    }


def interface_for(addr: str) -> tuple[str, str]:
    """``(interface, local address)`` this machine reaches ``addr`` through.

    Args:
        addr: the rendezvous host name or address.
    """
    source = route_source(resolve(addr))
    for name, addresses in interface_addresses().items():
        if source in addresses:
            return name, source
    raise RendezvousError(f"the local address {source} that reaches {addr} belongs to no interface of this machine")


def is_loopback(interface: str, addresses: Mapping[str, list[str]]) -> bool:
    """Whether every address of ``interface`` is a loopback address."""
    found = addresses.get(interface, [])
    return bool(found) and all(ipaddress.ip_address(a).is_loopback for a in found)


def is_local(addr: str) -> bool:
    """Whether ``addr`` is an address of this machine (this node hosts the rendezvous)."""
    ip = resolve(addr)
    return ipaddress.ip_address(ip).is_loopback or any(ip in a for a in interface_addresses().values())


def check_connect(rendezvous: Rendezvous, *, timeout: float = 3.0) -> str | None:
    """None when a TCP connection to the rendezvous succeeds within ``timeout`` s, else why not.

    Args:
        rendezvous: the endpoint.
        timeout: seconds to wait for the connection.
    """
    try:
        with socket.create_connection((rendezvous.addr, rendezvous.port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer from {rendezvous} within {timeout:g} s (a firewall, or the wrong address)"
    except OSError as error:
        return f"cannot connect to {rendezvous} ({error.strerror or error})"
