"""``kvpool up``'s defaults serve a 32K-token prompt, and advertise exactly what they serve.

One cold 32K prefill (about a minute on a quiet two-core host, many more on
a busy one): the one long test of the cluster tier. Only the ports, the
pool's segment size (the pool is not what bounds the context) and the
router's request timeout (so a busy host is slow, not failed) differ from the
defaults.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("long")
    config = workdir / "cluster.toml"
    config.write_text("[router]\nrequest_timeout_s = 3600\n")
    settings = UpSettings(http_port=0, grpc_port=0, segment_size="64MiB", workdir=str(workdir / "logs"))
    up = up_cluster(settings, str(config)).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.mark.timeout(3600)  # a cold 32K prefill: about a minute on a quiet two-core host, more on a busy one
def test_defaults_serve_a_32k_prompt_and_advertise_what_they_serve(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.http_url, timeout=3600) as client:
        context = client.get("/v1/models").json()["data"][0]["max_model_len"]
        assert context == 32768  # the model's own: every cache and arena of the defaults holds it
        prompt = "".join(chr(ord("a") + i % 26) for i in range(32_000))
        answer = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                     "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == 32_000
        assert answer.json()["usage"]["completion_tokens"] == 4
        over = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * context, "stream": True})
        assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
        assert str(context) in over.json()["error"]["message"]

