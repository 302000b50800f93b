"""The tools around the services: benchmarks, replay, the simulator, the
local cluster launcher and ``kvpool up``.

Layering: ``kvpool.tools`` sits above the five roles in ``services/``. It may
start role processes (through the one launcher, ``kvpool.tools.cluster``) but
never imports a role's module; nothing else under ``kvpool/`` imports or starts
``kvpool.tools`` or ``services``.
"""
