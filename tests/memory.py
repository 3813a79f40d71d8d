"""What a process's memory is, read from the process itself (``/proc/self/status``), not by counting parameters."""

from __future__ import annotations


def process_memory(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak since the last reset (``VmHWM``), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident memory (Linux's ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
