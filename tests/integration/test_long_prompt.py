"""``kvpool up``'s defaults serve long prompts, and advertise exactly what they serve.

The suite serves an 8K-token prompt on the defaults and checks the advertised
context and the refusal past it. The whole 32K (a cold 32K prefill: about a
minute of two cores on a quiet host, many more on a busy one, a quarter of the
suite's budget on its own) runs with ``KVPOOL_LONG_TESTS=1``. Only the ports,
the pool's segment size (the pool is not what bounds the context) and the
router's request timeout (so a busy host is slow, not failed) differ from the
defaults.
"""

from __future__ import annotations

import os
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


def complete(client: httpx.Client, tokens: int) -> None:
    """A prompt of ``tokens`` tokens (one a character) served, every token counted."""
    prompt = "".join(chr(ord("a") + i % 26) for i in range(tokens))
    answer = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                 "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == tokens
    assert answer.json()["usage"]["completion_tokens"] == 4


def test_defaults_advertise_32k_serve_8k_and_refuse_past_what_they_advertise(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.http_url, timeout=3600) as client:
        context = client.get("/v1/models").json()["data"][0]["max_model_len"]
        assert context == 32768  # the model's own: every cache and arena of the defaults holds it
        complete(client, 8_000)
        over = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * context, "stream": True})
        assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
        assert str(context) in over.json()["error"]["message"]


@pytest.mark.skipif(os.environ.get("KVPOOL_LONG_TESTS") != "1", reason="opt-in: KVPOOL_LONG_TESTS=1")
@pytest.mark.timeout(3600)  # a cold 32K prefill: about a minute on a quiet two-core host, more on a busy one
def test_defaults_serve_a_32k_prompt(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.http_url, timeout=3600) as client:
        complete(client, 32_000)
