"""The router fits its open-file limit to --http-max-connections (``open_files_limit``, ``ensure_open_files``)."""

from __future__ import annotations

import resource

from kvpool.services.router.http_connections import RESERVED_FILES, ensure_open_files, open_files_limit

INF = resource.RLIM_INFINITY


def test_the_soft_limit_rises_to_fit_the_connections_as_far_as_the_hard_limit_goes() -> None:
    assert open_files_limit(256, 4096, 1000) == 1000 + RESERVED_FILES
    assert open_files_limit(256, INF, 1000) == 1000 + RESERVED_FILES
    assert open_files_limit(256, 600, 1000) == 600  # as far as it goes (the router warns)


def test_a_limit_that_fits_is_left_as_it_is() -> None:
    assert open_files_limit(4096, 4096, 100) == 4096
    assert open_files_limit(INF, INF, 10**6) == INF
    assert open_files_limit(300, 200, 1000) == 300  # never lowered


def test_this_process_fits_a_bound_within_its_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert ensure_open_files(64) == soft  # already fits: unchanged
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
