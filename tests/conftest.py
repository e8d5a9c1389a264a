"""The test process is configured as every entry point configures its own (device/process.py:
threads, the kernels' ISA level, the compile cache keyed by the sources), before any test module
imports a kernel."""

from spyre_serve.device.process import configure

configure()
