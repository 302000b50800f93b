"""The tier guard fires: a test not marked ``cluster`` cannot start a process."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess

import pytest

from tests.process_guard import ProcessRefused, take_refusals

@pytest.mark.parametrize(
    "start",
    [
        pytest.param(lambda: subprocess.run(["true"], check=True), id="subprocess"),
        pytest.param(lambda: subprocess.run(["ip", "netns", "add", "kvpool-guard"]), id="ip-netns"),
        pytest.param(os.fork, id="fork"),
        pytest.param(lambda: os.posix_spawn("/bin/true", ["true"], {}), id="posix_spawn"),
        pytest.param(lambda: os.system("true"), id="system"),
        pytest.param(lambda: multiprocessing.get_context("spawn").Process(target=print).start(), id="multiprocessing"),
    ],
)
def test_unmarked_test_cannot_start_a_process(start, request) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProcessRefused, match=rf"{re.escape(request.node.nodeid)} started a process .* not marked @pytest.mark.cluster"):
        start()
    assert len(take_refusals()) == 1


def test_a_swallowed_refusal_still_fails_the_test_by_name(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        import subprocess

        def test_swallows():
            try:
                subprocess.run(["true"])
            except Exception:
                pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "tests.process_guard", "-p", "no:cacheprovider",
                                         "-o", "asyncio_default_fixture_loop_scope=function")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_inner.py::test_swallows (call) tried to start a process*exec 'true'*"])


@pytest.mark.cluster
def test_a_cluster_test_may_start_a_process() -> None:
    assert subprocess.run(["true"]).returncode == 0
