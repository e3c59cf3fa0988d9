"""Backends: one module per device API, each holding only what differs for its API (azyx.device is the protocol a
backend follows; its docstring lists the steps, with opencl.py as the example).

A backend registers by its module: azyx/backends/<kind>.py with a `CONFIG` at its top level and a Device subclass of
that kind. What finds, registers and probes those modules is not any backend's, and lives below azyx.runtime, in
azyx.registry.
"""
