"""Strict parsing of DeepSpeed hostfiles (``host slots=N`` per line).

A hostfile names the machines of a job. DeepSpeed's own parser takes any non-blank token as a host and hands
it on to ssh/pdsh; hftrain accepts only plain host names (RFC 1123) and IP addresses, so nothing read from the
file can ever be interpreted by a shell, and it reports the first bad line with its number and the fix. An IPv6
scope (``fe80::1%eth0``) must be an interface name or number; a name the C resolver would read as a number
(``0x7f.1``, ``0x7f`` are 127.0.0.1 and 0.0.0.127 to ``inet_aton``, a final label of digits) is neither a name
nor a canonical address and is refused.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from hftrain.errors import ConfigError

MAX_HOSTFILE_BYTES = 1 << 20
MAX_SLOTS = 4096
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_ENTRY = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)$")
_SCOPE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")  # a Linux interface name (IFNAMSIZ - 1) or index


@dataclass(frozen=True)
class HostEntry:
    """One machine of a hostfile.

    Args:
        host: a host name or IP address, as written.
        slots: processes to start on it.
        line: line number in the file (1-based).
    """

    host: str
    slots: int
    line: int


class HostfileError(ConfigError):
    """A hostfile is missing, malformed or names something that is not a host."""


def parse_hostfile(path: str | Path) -> list[HostEntry]:
    """Read and validate a DeepSpeed hostfile.

    Args:
        path: the hostfile; lines ``host slots=N``, ``#`` comments and blank lines.
    """
    path = Path(path)
    if not path.is_file():
        raise HostfileError(f"hostfile '{path}' does not exist or is not a file; pass an existing hostfile")
    if path.stat().st_size > MAX_HOSTFILE_BYTES:
        raise HostfileError(f"hostfile '{path}' is larger than {MAX_HOSTFILE_BYTES} bytes; it is not a hostfile")
    try:
        text = path.read_bytes().decode("ascii")
    except UnicodeDecodeError:
        raise HostfileError(
            f"hostfile '{path}' contains non-ASCII bytes; host names and addresses are plain ASCII"
        ) from None
    return parse_hostfile_text(text, source=str(path))


def parse_hostfile_text(text: str, *, source: str = "hostfile") -> list[HostEntry]:
    """Validate hostfile content (see ``parse_hostfile``).

    Args:
        text: the file's content.
        source: the name used in error messages.
    """
    entries: list[HostEntry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        if any(ord(c) < 32 and c != "\t" for c in line):
            raise HostfileError(f"{where}: control characters in the line; write 'host slots=N'")
        match = _ENTRY.match(line)
        if match is None:
            raise HostfileError(f"{where}: '{_shown(line)}' is not 'host slots=N'; write one host and slots per line")
        host, slots = match["host"], _slots(match["slots"], where)
        key = host_key(host)
        if key is None:
            raise HostfileError(
                f"{where}: '{_shown(host)}' is not a plain host name or IP address (letters, digits, '-' and '.' "
                "only); fix the name"
            )
        if key in seen:
            raise HostfileError(
                f"{where}: host '{host}' is already listed on line {seen[key]}; list each host once with all its slots"
            )
        seen[key] = number
        entries.append(HostEntry(host=host, slots=slots, line=number))
    if not entries:
        raise HostfileError(f"{source}: no 'host slots=N' line; list one host per line")
    return entries


def host_key(host: str) -> str | None:
    """A canonical form of a host name or address (for duplicate detection), or None when it is neither."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        scope = getattr(address, "scope_id", None)
        if scope is not None and not _SCOPE.match(scope):
            return None  # 'fe80::1%$(reboot)': the scope is handed to ssh/pdsh like the rest
        return str(address)
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        return None
    if name.split(".")[-1].isdigit():
        return None  # '10.0.0.256', 'node.1': a malformed IPv4 address, not a name (a top-level label has a letter)
    if _is_numeric_to_resolver(name):
        return None  # '0x7f', '0x7f.0x1': inet_aton's hexadecimal forms of an address
    return name.lower()


def _is_numeric_to_resolver(name: str) -> bool:
    """Whether the C library would read ``name`` as an IPv4 address (``inet_aton``'s a, a.b, hex and octal forms)."""
    try:
        socket.inet_aton(name)
    except OSError:
        return False
    return True


def _slots(value: str, where: str) -> int:
    if not value.isdigit() or not value.isascii():
        raise HostfileError(f"{where}: slots={_shown(value)} is not a positive integer; write e.g. slots=2")
    slots = int(value)
    if not 1 <= slots <= MAX_SLOTS:
        raise HostfileError(f"{where}: slots={value} must be between 1 and {MAX_SLOTS}")
    return slots


def _shown(text: str, limit: int = 60) -> str:
    """Text from the file as it may be echoed in a message: printable, and cut short."""
    shown = text.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= limit else shown[:limit] + "..."
