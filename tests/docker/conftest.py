"""The docker tests' shared fixtures: the image (built once per module; a rebuild with nothing changed takes
seconds) and the credentials `kvpool certs` writes for compose's services."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import tls
from tests.docker.support import base_image, compose, figure, identity, run, stage_build_extra


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`kvpool certs` into a folder of the test's (compose.yaml mounts it through KVPOOL_TLS_DIR); the test
    process dials as the master, the role pool stats needs."""
    folder = tmp_path_factory.mktemp("compose-tls")
    run(sys.executable, "-m", "kvpool.services.cli", "certs", str(folder))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPOOL_TLS_DIR", str(folder))
        tls.configure(identity(folder / "master"))
        try:
            yield folder
        finally:
            tls.configure(tls.SecuritySettings(ca="", cert="", key=""))


@pytest.fixture(scope="module")
def image() -> str:
    for tool in ("docker", "docker-compose"):
        assert shutil.which(tool), f"{tool} is not installed (KVPOOL_DOCKER_TESTS=1 asks for this test)"
    run("docker", "info")  # the daemon answers
    base = base_image()
    stage_build_extra()
    start = time.monotonic()
    compose("build", timeout=3600, env={"KVPOOL_BASE_IMAGE": base})
    size = int(run("docker", "image", "inspect", "--format", "{{.Size}}", "kvpool").strip())
    base_size = int(run("docker", "image", "inspect", "--format", "{{.Size}}", base).strip())
    figure("image build", f"{time.monotonic() - start:.0f} s on {base}; image {size / 1e6:.0f} MB, "
           f"base {base_size / 1e6:.0f} MB, the venv layer and apt libraries {(size - base_size) / 1e6:.0f} MB")
    return base
