"""``kvpool up --model-dir``: a Hugging Face directory served through the HTTP API gives transformers' greedy output.

The directory is tiny and random (``tests.model.hf_directory``: DeepSeek-V3's YaRN scaling and interleaved RoPE,
bfloat16 weights, a word-level tokenizer, a chat template), written by transformers' ``save_pretrained``. One
pipeline of two stages and one decode shard read it; transformers' ``generate`` reads the same directory.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.model.hf_directory import load_reference, words, write_hf_directory

if TYPE_CHECKING:  # imported where used: importing it scans its whole package, ~1 s of every test worker's collection
    import transformers

pytestmark = pytest.mark.cluster

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_directory(tmp_path_factory.mktemp("hf") / "tiny-dsv3")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    up = up_cluster(UpSettings(model_dir=str(model_dir), pipelines=1, stages=2, decode_shards=1, stores=0,
                               http_port=0, grpc_port=0, device_cache_tokens=1024, region_arena_bytes="16MiB",
                               workdir=str(tmp_path_factory.mktemp("logs")))).start()
    try:
        yield up
    finally:
        up.stop()


def post(cluster: Cluster, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(f"{cluster.http_url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


@functools.cache
def reference(model_dir: Path) -> tuple[transformers.DeepseekV3ForCausalLM, transformers.PreTrainedTokenizerBase]:
    import transformers

    return load_reference(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)


def transformers_text(model_dir: Path, prompt_ids: list[int]) -> str:
    """What transformers' greedy generate writes for the prompt, decoded as the server decodes (EOS stops it)."""
    model, tokenizer = reference(model_dir)
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS,
                             do_sample=False)[0, len(prompt_ids):].tolist()
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_the_models_endpoint_names_the_directory_and_its_context(cluster: Cluster) -> None:
    with urllib.request.urlopen(f"{cluster.http_url}/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]
    assert model["id"] == "tiny-dsv3"
    assert 0 < model["max_model_len"] <= 1024  # the directory's max_position_embeddings bounds it


def test_greedy_completion_equals_transformers_generate(cluster: Cluster, model_dir: Path) -> None:
    prompt = words(list(range(30, 64)) + list(range(4, 30)))
    answer = post(cluster, "/v1/completions", {"model": "tiny-dsv3", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                               "temperature": 0})
    prompt_ids = reference(model_dir)[1](prompt, add_special_tokens=False).input_ids
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids) == 60  # type: ignore[index]
    expected = transformers_text(model_dir, prompt_ids)
    assert expected and answer["choices"][0]["text"] == expected  # type: ignore[index]


def test_greedy_chat_through_the_directory_s_template_equals_transformers_generate(
    cluster: Cluster, model_dir: Path
) -> None:
    messages = [{"role": "user", "content": words(list(range(10, 40)))}]
    answer = post(cluster, "/v1/chat/completions", {"model": "tiny-dsv3", "messages": messages,
                                                    "max_tokens": MAX_TOKENS, "temperature": 0})
    prompt_ids = reference(model_dir)[1].apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)  # type: ignore[index]
    expected = transformers_text(model_dir, prompt_ids)
    assert expected and answer["choices"][0]["message"]["content"] == expected  # type: ignore[index]


def test_up_refuses_a_directory_it_cannot_serve_before_starting_anything(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    done = subprocess.run([sys.executable, "-m", "kvpool.services.cli", "up", "--model-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"model_dir: {tmp_path}/config.json: model_type: 'llama' is not supported" in done.stderr
