"""The package list, found rather than written out: every package under ``fedfusion/`` (a new sub-package is in the
wheel without an edit here) plus the three top-level folders that install as its sub-packages (pyproject's
``[tool.setuptools.package-dir]``). Everything else about the distribution is in pyproject.toml."""

from setuptools import find_packages, setup

MAPPED = ["fedfusion.strategies", "fedfusion.clients", "fedfusion.recipes"]  # strategies/, clients/, recipes/

setup(packages=[*find_packages(include=["fedfusion", "fedfusion.*"]), *MAPPED])
