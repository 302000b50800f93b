"""kvpool's service processes, installed as ``kvpool.services``.

The folder stays at the top of the tree (``services/master/``, ``services/store/``,
``services/prefill/``, ``services/decode/``, ``services/router/``) and installs
under the ``kvpool`` namespace (``[tool.setuptools.package-dir]`` in
pyproject.toml), so no top-level package named ``services`` is ever importable.
"""

if __name__ == "services":
    raise ImportError("this folder installs as kvpool.services: import kvpool.services, not services")
