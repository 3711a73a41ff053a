"""Fault kit: reusable network faults run beside an honest client (tcp: sockets; zenoh: key floods)."""
