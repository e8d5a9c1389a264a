"""Packaging of the layers' folders under one import name (pyproject.toml holds the rest).

The folders stay where docs/design.md puts them (`device/`, `models/`, `server/`, `deploy/`),
and install as `spyre_serve.device`, `spyre_serve.models`, ...: a top-level `models` or
`server` in site-packages would shadow, or be shadowed by, any other project's. `spyre_torch`
keeps its own name (torch's backend autoload finds it by that name).
"""

from setuptools import find_packages, setup

LAYERS = ("device", "models", "server", "deploy")

setup(
    packages=[f"spyre_serve.{p}" for p in find_packages(include=[f"{x}*" for x in LAYERS])]
    + find_packages(include=["spyre_torch*"]),
    package_dir={f"spyre_serve.{x}": x for x in LAYERS},
)
