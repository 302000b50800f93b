"""Where the packages are: ``kvpool/`` as it lies, and ``services/`` installed under it as
``kvpool.services``, so that no top-level ``services`` package reaches site-packages.
Everything else about the distribution is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["kvpool", "kvpool.*"]),
              "kvpool.services", *(f"kvpool.services.{p}" for p in find_packages("services"))],
    package_dir={"kvpool.services": "services"},
)
