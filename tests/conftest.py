"""The test process is configured as every entry point configures its own (device/process.py:
threads, the kernels' ISA level, the compile cache keyed by the sources), before any test module
imports a kernel.

Tests marked ``background("name")`` read a long subprocess started when collection ends
(tests/background.py): they run last, so their jobs overlap the rest of the suite."""

import pytest

from spyre_serve.device.process import configure

configure()

from tests import background  # noqa: E402  (after configure: nothing here imports a kernel)

# a test reading a background job may wait for it past the suite's 600 s a test: the job ran
# niced beside the suite, and on a busy machine it may still be compiling when its test comes
BACKGROUND_TEST_TIMEOUT = 3600


def pytest_configure(config):
    config.addinivalue_line("markers", "background(name): reads background job `name`, runs last")


def pytest_collection_modifyitems(session, config, items):
    names = [m.args[0] for item in items for m in item.iter_markers("background")]
    if not config.option.collectonly:
        background.start(names)
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)
    for item in items:
        if item.get_closest_marker("background") is not None:
            item.add_marker(pytest.mark.timeout(BACKGROUND_TEST_TIMEOUT))


def pytest_sessionfinish(session, exitstatus):
    background.stop()
