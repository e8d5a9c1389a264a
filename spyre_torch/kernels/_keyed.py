"""Imported first by every kernel module of spyre_torch: torch's backend autoload is this
package's entry point, so it configures the process (device/process.py: threads, ISA level,
the compile cache keyed by the kernels' sources) before any kernel here is decorated."""

from spyre_serve.device.process import configure

configure()
