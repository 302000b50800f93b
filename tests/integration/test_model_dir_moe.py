"""``kvpool up --model-dir`` serves a DeepSeek-V3 MoE directory: the official ``openai`` client gets transformers'
greedy text, and a chat's second turn finds its first turn cached: on its pipeline's device, or, moved to the
other pipeline, in the pool.

The directory is tiny and random (``tests.model.hf_directory``): four layers, MoE from layer 1 (8 routed experts in 4
groups, 2 groups and 2 experts a token, a shared expert, random router biases), DeepSeek-V3's YaRN scaling and
interleaved RoPE, bfloat16 weights, written by transformers' ``save_pretrained``. Two pipelines of four stages (one
layer each, three of them MoE), one decode shard and a pool store read it; transformers' ``generate`` reads the
same directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.test_model_dir import MAX_TOKENS, reference, transformers_text
from tests.integration.test_router_http import complete_groups, ext, wait_for_complete_groups
from tests.model.hf_directory import words, write_hf_directory

pytestmark = pytest.mark.cluster

MODEL = "tiny-dsv3-moe"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_directory(tmp_path_factory.mktemp("hf") / MODEL, num_layers=4, moe={})


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    up = up_cluster(UpSettings(model_dir=str(model_dir), pipelines=2, stages=4, decode_shards=1, stores=1,
                               segment_size="32MiB", http_port=0, grpc_port=0, device_cache_tokens=1024,
                               region_arena_bytes="16MiB", workdir=str(tmp_path_factory.mktemp("logs")))).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_completion_equals_transformers_generate(client: openai.OpenAI, model_dir: Path) -> None:
    prompt = words(list(range(30, 64)) + list(range(4, 30)))
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    prompt_ids = reference(model_dir)[1](prompt, add_special_tokens=False).input_ids
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids) == 60
    expected = transformers_text(model_dir, prompt_ids)
    assert expected and answer.choices[0].text == expected


def test_a_chat_s_second_turn_equals_transformers_and_finds_the_first_cached(
    client: openai.OpenAI, cluster: Cluster, model_dir: Path
) -> None:
    """The second turn finds the first turn's chunk in its pipeline's device cache; sent as a new session, it lands
    on the other pipeline (the least used), whose device never saw it, and restores the chunk from the pool."""
    tokenizer = reference(model_dir)[1]
    # 300 words: the first turn's prompt fills a 256-token chunk, which the second turn finds cached
    messages = [{"role": "user", "content": words([4 + (7 * i) % 60 for i in range(300)])}]
    groups_before = complete_groups(cluster)

    def turn(session: str) -> tuple[str, Any]:
        answer = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                max_tokens=MAX_TOKENS, temperature=0, prompt_cache_key=session)
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
        expected = transformers_text(model_dir, prompt_ids)
        assert expected and answer.choices[0].message.content == expected
        return expected, answer.usage

    first, usage = turn("moe-chat")
    assert usage.prompt_tokens_details.cached_tokens == 0
    wait_for_complete_groups(cluster, groups_before + 1)  # saves are write-through, off the request's path
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": words([9, 8, 7])}]
    _, usage = turn("moe-chat")
    assert usage.prompt_tokens_details.cached_tokens == 256
    assert (ext(usage)["device_tokens"], ext(usage)["pool_tokens"]) == (256, 0)
    _, moved = turn("moe-chat-moved")
    assert moved.prompt_tokens_details.cached_tokens == 256
    assert ext(moved)["pipeline"] != ext(usage)["pipeline"]
    assert (ext(moved)["device_tokens"], ext(moved)["pool_tokens"]) == (0, 256)
