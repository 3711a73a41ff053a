"""The test bed both the tests and the benchmarks stand on, written once for both.

What it holds is neither the product nor a measurement: free loopback ports for the servers a test or a
benchmark starts (`ports`); the network namespaces they run in (`netns`: two namespaces joined by a
shaped link, delay and rate, with `tc netem` or a user-space TUN delay line; a veth pair cut by iptables;
a LAN of namespaces whose hosts stall); and the fault kit every network-facing surface must pass
(`fault_kit`: TCP faults and Zenoh floods, each beside an honest client); and the driver that runs the
official openpi-client against the OpenPI front door in its own venv (`openpi_client_driver.py`, run by
path with `.venv-openpi`'s Python, never imported).

Why a package of its own, at the top of the repository: `tests/` imports nothing from `benchmarks/` (a
benchmark may change or go away without a test noticing) and `benchmarks/` imports nothing from `tests/`;
what both need lives here, below both. It is not part of the installed `lerobot_zenoh` package (a user's
install never needs it), and it imports nothing from `tests/` or `benchmarks/`.
"""
