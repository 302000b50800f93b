"""``kvpool up --model-dir`` serves a DeepSeek-V3 MoE directory: the official ``openai`` client gets transformers'
greedy text, and a chat's second turn finds its first turn cached.

The directory is tiny and random (``tests.model.hf_directory``): four layers, MoE from layer 1 (8 routed experts in 4
groups, 2 groups and 2 experts a token, a shared expert, random router biases), DeepSeek-V3's YaRN scaling and
interleaved RoPE, bfloat16 weights, written by transformers' ``save_pretrained``. One pipeline of four stages (one
layer each, three of them MoE), one decode shard and a pool store read it; transformers' ``generate`` reads the
same directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.test_model_dir import MAX_TOKENS, reference, transformers_text
from tests.model.hf_directory import words, write_hf_directory

pytestmark = pytest.mark.cluster

MODEL = "tiny-dsv3-moe"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_directory(tmp_path_factory.mktemp("hf") / MODEL, num_layers=4, moe={})


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    up = up_cluster(UpSettings(model_dir=str(model_dir), pipelines=1, stages=4, decode_shards=1, stores=1,
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
    client: openai.OpenAI, model_dir: Path
) -> None:
    tokenizer = reference(model_dir)[1]
    # 300 words: the first turn's prompt fills a 256-token chunk, which the second turn finds cached
    messages = [{"role": "user", "content": words([4 + (7 * i) % 60 for i in range(300)])}]
    for turn in (1, 2):
        answer = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                max_tokens=MAX_TOKENS, temperature=0, prompt_cache_key="moe-chat")
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        usage = answer.usage
        assert usage is not None and usage.prompt_tokens == len(prompt_ids)
        expected = transformers_text(model_dir, prompt_ids)
        assert expected and answer.choices[0].message.content == expected
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        assert (cached == 0) if turn == 1 else (cached == 256), (turn, usage)
        messages += [{"role": "assistant", "content": expected}, {"role": "user", "content": words([9, 8, 7])}]
