"""``kvpool up``'s defaults serve a 32K-token prompt, and advertise exactly what they serve.

One cold 32K prefill (about a minute on two cores): the one long test of the
cluster tier. Only the ports and the pool's segment size differ from the
defaults (the pool is not what bounds the context).
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
    settings = UpSettings(http_port=0, grpc_port=0, segment_size="64MiB",
                          workdir=str(tmp_path_factory.mktemp("long")))
    up = up_cluster(settings).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.mark.timeout(900)  # a cold 32K prefill: about a minute on a quiet two-core host, more on a busy one
def test_defaults_serve_a_32k_prompt_and_advertise_what_they_serve(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.http_url, timeout=600) as client:
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

